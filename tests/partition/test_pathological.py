"""Pathological label skew: shards, classes_per_client, nway_kshot."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedskew.errors import DataError
from tests.partition.strategies import SETTINGS, balanced, problems, run


@SETTINGS
@given(problem=problems(), k=st.integers(1, 4))
def test_classes_per_client_exact_k_and_all_classes_covered(problem, k):
    labels, num_classes, num_clients, seed, _ = problem
    parts = run({"name": "classes_per_client", "k": k}, labels, num_clients, seed)
    held = [np.unique(labels[p]) for p in parts]
    assert all(len(h) == k for h in held)
    holders = np.bincount(np.concatenate(held), minlength=num_classes)
    assert holders.max() - holders.min() <= 1  # balanced: each class held by floor or ceil of N*k/C
    if num_clients * k >= num_classes:
        assert np.all(holders > 0)
    # a class is split equally (+-1) among its holders
    for c in range(num_classes):
        got = [int((labels[p] == c).sum()) for p in parts if (labels[p] == c).any()]
        assert not got or max(got) - min(got) <= 1


@SETTINGS
@given(
    problem=problems(),
    n=st.integers(2, 4),
    stdev=st.integers(0, 2),
    noise=st.sampled_from(["uniform", "none"]),
)
def test_nway_kshot_ranges(problem, n, stdev, noise):
    labels, num_classes, num_clients, seed, _ = problem
    k = 3
    spec = {"name": "nway_kshot", "n": n, "stdev": stdev, "k": k, "shot_noise": noise}
    lo, hi = max(2, n - stdev), min(num_classes - 1, n + stdev)
    if lo > hi:  # FedProto clips n_i to [2, C-1]
        with pytest.raises(DataError, match="no valid class count"):
            run(spec, labels, num_clients, seed)
        return
    try:
        parts = run(spec, labels, num_clients, seed)
    except DataError as err:
        assert "more samples of a class" in str(err)
        return
    for p in parts:
        classes, counts = np.unique(labels[p], return_counts=True)
        assert lo <= len(classes) <= hi
        assert len(set(counts.tolist())) == 1  # k_i samples of every class of client i
        if noise == "none" or stdev == 0:
            assert counts[0] == k
        else:
            assert k - stdev + 1 <= counts[0] <= k + stdev


def test_shards_mcmahan_layout():
    # 10 classes x 30 samples, 5 clients x 2 shards: 10 shards of 30 = one whole class each
    labels = balanced(10, 30, 2)
    parts = run({"name": "shards", "shards_per_client": 2}, labels, 5)
    for p in parts:
        classes, counts = np.unique(labels[p], return_counts=True)
        assert len(classes) == 2 and counts.tolist() == [30, 30]
    assert sum(len(p) for p in parts) == 300
