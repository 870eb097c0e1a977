"""The few-shot protocol: K shots per class, the per-class divmod IID rule and the contiguous class chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedskew.data.datasets.sklearn_digits import digits
from fedskew.data.federated import build_federated
from fedskew.data.partition import class_chunks, few_shot_indices, iid_divmod
from fedskew.errors import ConfigError, DataError
from tests.partition.strategies import SETTINGS, balanced, run


@st.composite
def uneven(draw: st.DrawFn) -> tuple[np.ndarray, int, int, int]:
    """(labels, num_classes, num_clients, seed): random class sizes (some below N), a few classes empty."""
    num_classes = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(0, 40), min_size=num_classes, max_size=num_classes))
    seed = draw(st.integers(0, 2**31 - 1))
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), sizes))
    return labels, num_classes, draw(st.integers(1, 15)), seed


def _counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


@SETTINGS
@given(problem=uneven())
def test_iid_divmod_deals_each_class_by_the_divmod_rule(problem):
    labels, num_classes, n, seed = problem
    parts = iid_divmod(labels, n, seed, num_classes=num_classes)
    flat = np.concatenate(parts)
    assert np.array_equal(np.sort(flat), np.arange(len(labels)))  # every sample exactly once
    q, r = np.divmod(np.bincount(labels, minlength=num_classes), n)
    expected = q[None, :] + (np.arange(n)[:, None] >= n - r[None, :])
    assert np.array_equal(_counts(labels, parts, num_classes), expected)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(parts, iid_divmod(labels, n, seed, num_classes=num_classes), strict=True)
    )


def test_iid_divmod_is_the_papers_example():
    """16 shots of 10 classes over 10 clients: per class [1,1,1,1,2,2,2,2,2,2], every client every class."""
    labels = balanced(10, 16, 0)
    counts = _counts(labels, run({"name": "iid_divmod"}, labels, 10, seed=3), 10)
    assert np.array_equal(counts, np.repeat([[1], [1], [1], [1], [2], [2], [2], [2], [2], [2]], 10, axis=1))
    assert counts.sum(0).tolist() == [16] * 10


def test_iid_divmod_shuffles_within_classes():
    labels = balanced(2, 40, 1)
    draws = {tuple(iid_divmod(labels, 4, s, num_classes=2)[0]) for s in range(5)}
    assert len(draws) == 5


@SETTINGS
@given(problem=uneven())
def test_class_chunks_gives_disjoint_contiguous_class_blocks(problem):
    labels, num_classes, n, seed = problem
    n = min(n, num_classes)
    parts = class_chunks(labels, n, seed, num_classes=num_classes)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    chunks = np.array_split(np.arange(num_classes), n)
    for p, chunk in zip(parts, chunks, strict=True):
        assert np.isin(labels[p], chunk).all()  # only its own classes ...
        assert len(p) == np.isin(labels, chunk).sum()  # ... and all of their samples
    owned = [set(labels[p].tolist()) for p in parts]
    assert all(not (a & b) for i, a in enumerate(owned) for b in owned[i + 1 :])


def test_class_chunks_examples_of_the_paper():
    labels = balanced(100, 2, 0)
    assert {len(set(labels[p])) for p in run({"name": "class_chunks"}, labels, 10)} == {10}
    labels = balanced(10, 16, 0)  # EuroSAT-like: one class per client
    assert [sorted(set(labels[p])) for p in run({"name": "class_chunks"}, labels, 10)] == [
        [c] for c in range(10)
    ]
    labels = balanced(47, 2, 0)  # DTD: 47 classes -> 5 or 4 per client, the larger chunks first
    sizes = [len(set(labels[p])) for p in run({"name": "class_chunks"}, labels, 10)]
    assert sizes == [5] * 7 + [4] * 3


def test_class_chunks_needs_enough_classes():
    with pytest.raises(DataError, match="11 clients need at least as many classes, got 10"):
        run({"name": "class_chunks"}, balanced(10, 5, 0), 11)


@SETTINGS
@given(problem=uneven(), shots=st.integers(1, 5))
def test_few_shot_takes_k_per_class_nested_and_deterministic(problem, shots):
    labels, num_classes, _, seed = problem
    labels = np.concatenate([labels, np.repeat(np.arange(num_classes), 5)])  # every class has >= 5
    idx = few_shot_indices(labels, shots, num_classes, seed)
    assert np.all(np.diff(idx) > 0) and idx.dtype == np.int64
    assert np.bincount(labels[idx], minlength=num_classes).tolist() == [shots] * num_classes
    assert np.array_equal(idx, few_shot_indices(labels, shots, num_classes, seed))
    assert np.isin(few_shot_indices(labels, 1, num_classes, seed), idx).all()  # nested in K


def test_few_shot_names_the_short_class():
    with pytest.raises(DataError, match="class 1 has only 3 training samples"):
        few_shot_indices(np.array([0] * 5 + [1] * 3), 4, 2, 0)


def test_build_federated_with_shots_partitions_the_few_shot_set():
    ds = digits(None)
    fed = build_federated(ds, 10, {"name": "iid_divmod"}, 0, shots=16)
    idx = torch.cat(fed.train_idx)
    assert idx.numel() == 160 and idx.unique().numel() == 160
    assert torch.bincount(ds.y_train[idx], minlength=10).tolist() == [16] * 10
    assert fed.client_sizes.tolist() == [10] * 4 + [20] * 6
    other = build_federated(ds, 10, {"name": "class_chunks"}, 0, shots=16)
    assert torch.equal(torch.cat(other.train_idx).sort().values, idx.sort().values)  # same shots per seed
    assert not torch.equal(
        build_federated(ds, 10, {"name": "iid_divmod"}, 1, shots=16).train_idx[0], fed.train_idx[0]
    )


def test_dirichlet_01_on_the_160_shots():
    """Dir(0.1) on the 16-shot set of 10 classes over 10 clients with min_size 1 (every client non-empty):
    every shot used once, strongly label-skewed."""
    ds = digits(None)
    spec = {"name": "dirichlet", "alpha": 0.1, "min_size": 1}
    for seed in range(3):
        counts = build_federated(ds, 10, spec, seed, shots=16).class_counts()
        assert counts.sum() == 160 and (counts.sum(1) >= 1).all()
        assert (counts > 0).sum(1).float().mean() < 5  # far from 10 classes per client (measured ~3.4)


def test_config_key_data_shots():
    from fedskew.experiment.config import build_config
    from fedskew.experiment.runner import build_data

    data = {"dataset": "digits", "num_clients": 10, "shots": 16, "partition": {"name": "class_chunks"}}
    fed = build_data(build_config({"seed": 0, "data": data}))
    assert fed.client_sizes.tolist() == [16] * 10
    assert ((fed.class_counts() > 0).sum(1) == 1).all()


def test_val_shots_are_outside_the_shots_and_follow_each_clients_mix():
    ds = digits(None)
    fed = build_federated(ds, 10, {"name": "class_chunks"}, 0, shots=16, val_shots=4)
    train, val = torch.cat(fed.train_idx), torch.cat(fed.val_idx)
    assert train.numel() == 160 and val.numel() == 40
    assert not np.isin(val.numpy(), train.numpy()).any()  # validation never holds a training shot
    for t, v in zip(fed.train_idx, fed.val_idx, strict=True):  # one digit per client, 4 validation images
        assert ds.y_train[v].tolist() == [int(ds.y_train[t[0]])] * 4
    dirichlet = {"name": "dirichlet", "alpha": 0.1, "min_size": 1}
    fed = build_federated(ds, 10, dirichlet, 0, shots=16, val_shots=4)
    for t, v in zip(fed.train_idx, fed.val_idx, strict=True):
        assert set(ds.y_train[v].tolist()) <= set(ds.y_train[t].tolist())
    assert torch.equal(torch.cat(fed.train_idx).sort().values, train.sort().values)  # same shots


@pytest.mark.parametrize("kw", [{"val_shots": 4}, {"shots": 16, "val_shots": 4, "val_fraction": 0.2}])
def test_val_shots_needs_shots_and_no_val_fraction(kw):
    with pytest.raises(ConfigError, match="data.val_shots' needs data.shots"):
        build_federated(digits(None), 10, {"name": "iid_divmod"}, 0, **kw)
