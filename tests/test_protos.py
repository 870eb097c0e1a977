"""Prototype primitives (fedskew.algorithms.protos) on hand-checkable tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedskew.algorithms.protos import (
    ClassAccumulator,
    aggregate_prototypes,
    class_means,
    kmeans,
    nearest_prototype_scores,
    pack,
)
from fedskew.errors import ConfigError


def test_class_means_and_counts():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    means, counts = class_means(values, torch.tensor([0, 0, 2]), 3)
    assert torch.equal(means, torch.tensor([[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]]))
    assert counts.tolist() == [2, 0, 1]
    classes, rows, cnt = pack(means, counts)
    assert classes.tolist() == [0, 2] and cnt.tolist() == [2, 1]
    assert torch.equal(rows, torch.tensor([[2.0, 3.0], [5.0, 6.0]]))


def test_accumulator_over_batches_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g)
    y = torch.randint(0, 5, (50,), generator=g)
    acc = ClassAccumulator.zeros(5, 4, "cpu")
    for s in range(0, 50, 8):
        acc.add(x[s : s + 8], y[s : s + 8])
    m1, c1 = acc.means()
    m2, c2 = class_means(x, y, 5)
    assert torch.allclose(m1, m2, atol=1e-6) and torch.equal(c1, c2)


def test_aggregation_weighted_vs_mean_never_both_factors():
    # client A: class 0 = (0, 0), 1 sample; client B: class 0 = (4, 8), 3 samples, class 1 = (1, 1), 2 samples
    classes = torch.tensor([0, 0, 1])
    protos = torch.tensor([[0.0, 0.0], [4.0, 8.0], [1.0, 1.0]])
    counts = torch.tensor([1, 3, 2])
    weighted, present = aggregate_prototypes(classes, protos, counts, 3, "weighted")
    assert torch.allclose(weighted[0], torch.tensor([3.0, 6.0]))  # (0*1 + 4*3) / 4, (0 + 8*3) / 4
    assert torch.allclose(weighted[1], torch.tensor([1.0, 1.0]))  # one holder: its own prototype
    assert present.tolist() == [True, True, False]  # class 2: nobody holds it -> no prototype
    assert torch.equal(weighted[2], torch.zeros(2))
    mean, _ = aggregate_prototypes(classes, protos, counts, 3, "mean")
    assert torch.allclose(mean[0], torch.tensor([2.0, 4.0]))  # plain mean over the 2 holders
    # equal counts: both rules coincide and are a convex combination (the printed Eq. 6 would halve it)
    eq, _ = aggregate_prototypes(classes, protos, torch.tensor([5, 5, 5]), 3, "weighted")
    assert torch.allclose(eq, mean)
    with pytest.raises(ConfigError, match="allowed: weighted, mean"):
        aggregate_prototypes(classes, protos, counts, 3, "sum")


def test_aggregation_of_multi_prototype_tables():
    classes = torch.tensor([1, 1])
    protos = torch.tensor([[[0.0, 0.0], [2.0, 2.0]], [[2.0, 4.0], [4.0, 6.0]]])  # [P, K=2, D=2]
    table, present = aggregate_prototypes(classes, protos, torch.tensor([1, 1]), 2, "mean")
    assert table.shape == (2, 2, 2) and present.tolist() == [False, True]
    assert torch.allclose(table[1], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_nearest_prototype_with_class_mask():
    table = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.tensor([[1.0, 1.0], [9.0, 1.0], [1.0, 9.0]])
    scores = nearest_prototype_scores(x, table)
    assert scores.argmax(1).tolist() == [0, 1, 2]
    assert torch.allclose(scores[0], -torch.tensor([2.0, 82.0, 82.0]))  # minus squared distances
    masked = nearest_prototype_scores(x, table, torch.tensor([True, False, True]))
    assert masked.argmax(1).tolist() == [0, 0, 2]  # class 1 excluded: (9, 1) is nearer (0, 0) than (0, 10)
    assert torch.isinf(masked[:, 1]).all()
    per_sample = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    assert nearest_prototype_scores(x, table, per_sample).argmax(1).tolist() == [0, 1, 0]


def test_nearest_of_k_prototypes_per_class():
    table = torch.tensor([[[0.0, 0.0], [20.0, 20.0]], [[10.0, 10.0], [-5.0, -5.0]]])  # [C=2, K=2, D=2]
    x = torch.tensor([[19.0, 19.0], [-4.0, -4.0], [9.0, 9.0]])
    assert nearest_prototype_scores(x, table).argmax(1).tolist() == [0, 1, 1]
    k_mask = torch.tensor([[True, False], [True, True]])  # class 0's second prototype does not exist
    assert nearest_prototype_scores(x, table, k_mask).argmax(1).tolist() == [1, 1, 1]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), c=st.integers(1, 8), d=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_nearest_prototype_matches_brute_force(n, c, d, seed):
    g = torch.Generator().manual_seed(seed)
    x, table = (
        torch.randn(n, d, generator=g, dtype=torch.float64),
        torch.randn(c, d, generator=g, dtype=torch.float64),
    )
    scores = nearest_prototype_scores(x, table)
    assert torch.allclose(-scores, torch.cdist(x, table).pow(2), atol=1e-9)


def test_kmeans_recovers_separated_blobs_deterministically():
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([c + 0.1 * torch.randn(30, 2, generator=g) for c in centers])
    found, assign = kmeans(x, 3, generator=torch.Generator().manual_seed(1))
    order = torch.cdist(centers, found).argmin(1)
    assert sorted(order.tolist()) == [0, 1, 2]
    assert torch.allclose(found[order], centers, atol=0.1)
    assert all(len(set(assign[i * 30 : (i + 1) * 30].tolist())) == 1 for i in range(3))
    again, _ = kmeans(x, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(found, again)
    few, a = kmeans(x[:2], 5, generator=torch.Generator().manual_seed(0))
    assert few.shape == (2, 2) and sorted(a.tolist()) == [0, 1]  # k capped at the number of points
