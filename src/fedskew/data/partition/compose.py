"""Composition: a global long tail first, then any other scheme on the kept pool (long-tail ∘ any)."""

from __future__ import annotations

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition.core import apply_partition, assign_counts, check_labels, child_seed, make_rng
from fedskew.errors import ConfigError, DataError


@PARTITIONERS.register("longtail")
def longtail(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    rho: float = 100.0,
    n_max: int | None = None,
    then: dict | None = None,
) -> list[np.ndarray]:
    """Global long tail (CIFAR-LT, Cao et al. 2019 LDAM), then any other scheme (``then``, default iid).

    Class c keeps ``n_c = ⌊n_max · ρ^(−c/(C−1))⌋`` random samples (head = class 0, ``ρ = n_max/n_min``);
    ``n_max`` defaults to the smallest class size, so the profile is exact on any dataset. The kept pool is
    then split by ``then`` (e.g. ``{"name": "dirichlet", "alpha": 0.2}``, FedSKC's CIFAR-10-LT setting:
    subsample first, then partition; docs/methods/fedskc.md, "FedSKC: long-tailed partition order"). The test
    set is left balanced.
    """
    y = check_labels(labels, num_clients, num_classes, "longtail")
    if rho < 1:
        raise ConfigError(f"partition 'longtail': rho must be >= 1 (head/tail ratio), got {rho}")
    sizes = np.bincount(y, minlength=num_classes)
    top = int(sizes.min()) if n_max is None else int(n_max)
    c = np.arange(num_classes, dtype=np.float64)
    target = (top * (1.0 / rho) ** (c / max(num_classes - 1, 1))).astype(np.int64)  # LDAM's int() floor
    short = np.flatnonzero(target > sizes)
    if short.size:
        first = int(short[0])
        raise DataError(
            f"partition 'longtail': class {first} needs {target[first]} samples for n_max={top}, rho={rho} "
            f"but has {sizes[first]}; lower n_max"
        )
    rng = make_rng(seed)
    kept = np.flatnonzero(assign_counts(y, target[None], rng) == 0)
    inner = apply_partition(
        then or {"name": "iid"},
        y[kept],
        num_clients,
        child_seed(seed, 1),
        num_classes=num_classes,
        domains=None if domains is None else np.asarray(domains)[kept],
        where="data.partition.then",
    )
    return [kept[p] for p in inner]
