"""Quantity skew (iid, quantity): sizes and class mixes."""

from __future__ import annotations

import numpy as np

from tests.partition.strategies import balanced, run


def test_iid_balanced_sizes_and_class_mix():
    labels = balanced(10, 500, 3)
    parts = run({"name": "iid"}, labels, 7)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 5000
    hist = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
    assert np.abs(hist - 0.1).max() < 0.04


def test_quantity_sizes_skewed_with_min_size():
    labels = balanced(10, 300, 4)
    parts = run({"name": "quantity", "sigma": 2.0, "min_size": 25}, labels, 20)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == 3000 and sizes.min() >= 25
    assert sizes.max() > 4 * np.median(sizes)  # heavy tail
