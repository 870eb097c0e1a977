"""Composition: the long-tail profile, alone and followed by another scheme."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests.partition.strategies import SETTINGS, balanced, problems, run


@SETTINGS
@given(problem=problems(), rho=st.sampled_from([1.0, 2.0, 10.0, 100.0]))
def test_longtail_profile(problem, rho):
    labels, num_classes, num_clients, seed, _ = problem
    parts = run({"name": "longtail", "rho": rho}, labels, num_clients, seed)
    kept = np.bincount(labels[np.concatenate(parts)], minlength=num_classes)
    n_max = np.bincount(labels).min()
    c = np.arange(num_classes)
    assert np.array_equal(kept, (n_max * (1.0 / rho) ** (c / (num_classes - 1))).astype(np.int64))


def test_longtail_hand_checked_profile():
    labels = balanced(3, 100, 0)
    parts = run({"name": "longtail", "rho": 4.0}, labels, 2)
    assert np.bincount(labels[np.concatenate(parts)]).tolist() == [100, 50, 25]  # 100·4^(-c/2)


def test_longtail_then_dirichlet_keeps_profile_and_skews():
    labels = balanced(10, 600, 1)
    spec = {"name": "longtail", "rho": 10.0, "then": {"name": "dirichlet", "alpha": 0.1, "min_size": 5}}
    parts = run(spec, labels, 10)
    kept = np.bincount(labels[np.concatenate(parts)], minlength=10)
    assert kept[0] == 600 and kept[-1] == 60
    assert np.mean([len(np.unique(labels[p])) for p in parts]) < 8  # label skew inside the long tail
