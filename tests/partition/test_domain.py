"""Feature (domain) skew: one domain per client, label skew inside domains, per-class cap."""

from __future__ import annotations

import numpy as np
import pytest

from fedskew.errors import DataError
from tests.partition.strategies import balanced, run


def test_domain_one_domain_per_client_and_cap():
    labels = balanced(5, 60, 9)
    domains = np.random.default_rng(9).permutation(np.arange(300) % 3)
    parts = run({"name": "domain", "max_per_class": 4}, labels, 6, domains=domains)
    for i, p in enumerate(parts):
        assert np.unique(domains[p]).tolist() == [i % 3]  # client i holds domain i mod D
        assert np.bincount(labels[p]).max() <= 4
    parts = run(
        {"name": "domain", "label_skew": {"name": "classes_per_client", "k": 1}}, labels, 3, domains=domains
    )
    assert all(len(np.unique(labels[p])) == 1 for p in parts)


def test_domain_needs_enough_clients():
    labels = balanced(5, 60, 11)
    with pytest.raises(DataError, match="2 clients for 3 domains"):
        run({"name": "domain"}, labels, 2, domains=np.arange(300) % 3)
