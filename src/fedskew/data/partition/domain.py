"""Feature (domain) skew: one domain per client, optionally label skew inside each domain."""

from __future__ import annotations

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition.core import apply_partition, check_labels, child_seed, make_rng, need, to_parts
from fedskew.errors import DataError


def _cap_per_class(
    parts: list[np.ndarray], labels: np.ndarray, num_classes: int, cap: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Keep at most ``cap`` random samples of each class in each client."""
    owner = np.full(len(labels), -1, dtype=np.int64)
    for i, p in enumerate(parts):
        owner[p] = i
    used = np.flatnonzero(owner >= 0)
    group = owner[used] * num_classes + labels[used]
    order = np.lexsort((rng.random(len(used)), group))
    sizes = np.bincount(group, minlength=len(parts) * num_classes)
    rank = np.arange(len(used)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    owner[used[order[rank >= cap]]] = -1
    return to_parts(owner, len(parts))


@PARTITIONERS.register("domain")
def domain(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    label_skew: dict | None = None,
    max_per_class: int | None = None,
) -> list[np.ndarray]:
    """Feature skew: one domain per client (FedBN / FedPCL / MP-FedCL); optional label skew inside domains.

    Client i belongs to domain ``i mod D`` (so with N = D client i holds domain i, MP-FedCL's order). A
    domain's samples are split over its clients IID, or by ``label_skew`` (a scheme spec such as
    ``{"name": "dirichlet", "alpha": 0.5}``) applied inside each domain. ``max_per_class`` keeps at most that
    many samples per class per client (MP-FedCL's Digit-5: 10 per class).
    """
    y = check_labels(labels, num_clients, num_classes, "domain")
    need(
        domains is not None, "domain", "needs per-sample domain tags, but the dataset has none (domain_train)"
    )
    dom = np.asarray(domains, dtype=np.int64)
    need(dom.shape == y.shape, "domain", f"domains has shape {dom.shape}, labels {y.shape}")
    ids = np.unique(dom)
    need(
        num_clients >= len(ids),
        "domain",
        f"{num_clients} clients for {len(ids)} domains (need clients >= domains)",
    )
    client_domain = np.arange(num_clients) % len(ids)
    parts: list[np.ndarray] = [np.zeros(0, np.int64)] * num_clients
    for j, d in enumerate(ids):  # per domain: a handful of iterations
        idx = np.flatnonzero(dom == d)
        clients = np.flatnonzero(client_domain == j)
        try:
            sub = apply_partition(
                label_skew or {"name": "iid"},
                y[idx],
                len(clients),
                child_seed(seed, j),
                num_classes=num_classes,
                where="data.partition.label_skew",
            )
        except DataError as err:
            raise DataError(f"partition 'domain', domain {int(d)}: {err}") from None
        for cid, p in zip(clients, sub, strict=True):
            parts[cid] = idx[p]
    if max_per_class is not None:
        parts = _cap_per_class(parts, y, num_classes, int(max_per_class), make_rng(seed))
    return parts
