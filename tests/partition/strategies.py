"""Shared hypothesis strategies and helpers of the partition tests."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from fedskew.data.partition import apply_partition

SETTINGS = settings(max_examples=30, deadline=None)

#: schemes with parameters that are feasible for every draw of ``problems`` below
FEASIBLE = [
    {"name": "iid"},
    {"name": "iid", "unbalanced_sigma": 1.0},
    {"name": "iid_divmod"},
    {"name": "quantity", "min_size": 1},
    {"name": "quantity", "distribution": "powerlaw", "exponent": 2.0, "min_size": 2},
    {"name": "quantity", "distribution": "dirichlet", "beta": 0.3, "min_size": 1},
    {"name": "dirichlet", "alpha": 0.3, "min_size": 0},
    {"name": "dirichlet", "alpha": 0.1, "min_size": 1, "mode": "per_client"},
    {"name": "shards"},
    {"name": "classes_per_client", "k": 2},
    {"name": "nway_kshot", "n": 3, "stdev": 1, "k": 2},
    {"name": "longtail", "rho": 10.0},
    {"name": "longtail", "rho": 5.0, "then": {"name": "dirichlet", "alpha": 0.5, "min_size": 0}},
    {"name": "domain"},
    {"name": "domain", "label_skew": {"name": "dirichlet", "alpha": 0.5, "min_size": 0}, "max_per_class": 3},
]


def balanced(num_classes: int, per_class: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(num_classes * per_class) % num_classes)


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, int, int, int, np.ndarray]:
    """(labels, num_classes, num_clients, seed, domains) with at least 3N samples per class."""
    num_classes = draw(st.integers(4, 10))
    num_clients = draw(st.integers(1, 12))
    per_class = draw(st.integers(3 * num_clients, 3 * num_clients + 40))
    seed = draw(st.integers(0, 2**31 - 1))
    labels = balanced(num_classes, per_class, seed)
    n_dom = draw(st.integers(1, min(3, num_clients)))
    domains = np.random.default_rng(seed + 1).permutation(np.arange(len(labels)) % n_dom)
    return labels, num_classes, num_clients, seed, domains


def run(spec: dict, labels: np.ndarray, n_clients: int, seed: int = 0, **kw) -> list[np.ndarray]:
    num_classes = kw.pop("num_classes", int(labels.max()) + 1)
    return apply_partition(spec, labels, n_clients, seed, num_classes=num_classes, **kw)
