"""Dirichlet label skew: min_size, every sample used, alpha limits, per_client mode."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fedskew.errors import DataError
from tests.partition.strategies import SETTINGS, balanced, problems, run


@SETTINGS
@given(problem=problems(), alpha=st.sampled_from([0.1, 0.5, 2.0]), min_size=st.integers(1, 3))
def test_dirichlet_min_size_honoured_and_every_sample_used(problem, alpha, min_size):
    labels, _, num_clients, seed, _ = problem
    try:
        parts = run({"name": "dirichlet", "alpha": alpha, "min_size": min_size}, labels, num_clients, seed)
    except DataError as err:  # allowed only as the documented retry failure
        assert "min_size" in str(err)
        return
    assert min(len(p) for p in parts) >= min_size
    assert sum(len(p) for p in parts) == len(labels)  # per_class mode uses every sample


def test_dirichlet_large_alpha_approaches_iid():
    labels = balanced(10, 400, 5)
    for mode in ("per_class", "per_client"):
        parts = run({"name": "dirichlet", "alpha": 1e4, "mode": mode}, labels, 5)
        hist = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
        assert np.abs(hist - 0.1).max() < 0.02, mode


def test_dirichlet_small_alpha_concentrates_classes():
    labels = balanced(10, 400, 6)
    for mode in ("per_class", "per_client"):
        parts = run({"name": "dirichlet", "alpha": 0.05, "mode": mode, "min_size": 1}, labels, 20)
        top = np.mean([np.bincount(labels[p]).max() / len(p) for p in parts])
        assert top > 0.6, mode  # the dominant class holds most of a typical client


def test_dirichlet_per_client_equal_sizes_without_replacement():
    labels = np.random.default_rng(7).integers(0, 10, 1003)
    parts = run({"name": "dirichlet", "alpha": 0.1, "mode": "per_client"}, labels, 10)
    assert [len(p) for p in parts] == [100] * 10  # 3 samples left unused


def test_dirichlet_seeds_differ():
    labels = balanced(10, 100, 8)
    a = run({"name": "dirichlet", "alpha": 0.5}, labels, 5, seed=0)
    b = run({"name": "dirichlet", "alpha": 0.5}, labels, 5, seed=1)
    assert not all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
