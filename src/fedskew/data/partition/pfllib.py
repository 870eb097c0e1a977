"""PFLlib's label-skew partitions and its per-client train/test split of a merged pool, draw for draw.

PFLlib (Zhang et al., TsingZ0/PFLlib, ``dataset/utils/dataset_utils.py`` at commit d832e76: ``separate_data``,
``split_data``; read for issue 52) builds its benchmark clients in three steps, all on NumPy's global legacy
stream seeded once (``np.random.seed(1)`` in ``dataset/generate_FashionMNIST.py``):

1. the dataset's train and test images are merged into one pool (70,000 on Fashion-MNIST);
2. ``pat`` (pathological) or ``dir`` (Dirichlet) deals the pool to the clients;
3. each client's own samples are split by scikit-learn's ``train_test_split(train_size=0.75, shuffle=True)``:
   ``floor(0.75·n)`` training samples, the other ``n − floor(0.75·n)`` its test set.

This module reproduces the three steps with ``np.random.RandomState(seed)``, one stream through partition
and split as in PFLlib, so ``seed=1`` gives the clients PFLlib's generator writes (checked against its code
on the Fashion-MNIST labels: docs/decisions.md, "PFLlib protocol"). The legacy stream is frozen by NumPy's
NEP 19, so the draws do not change with NumPy versions. The registered schemes return sorted parts like
every partitioner; :func:`merged_client_split` keeps PFLlib's within-client order for the split.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition.core import (
    RESERVED,
    apply_partition,
    check_labels,
    check_parts,
    child_seed,
    need,
)
from fedskew.errors import ConfigError, DataError
from fedskew.registry import check_options

#: sub-seed of the per-client split when the partition is not one of PFLlib's (own stream, as elsewhere)
_SPLIT_TAG = 105


def _least(least_samples: int, n: int, num_clients: int) -> int:
    """PFLlib's ``least_samples = int(min(batch_size / (1 − train_ratio), n / N / 2))``: 40 for its batch 10
    and 75 % train share, capped at half a client's even share."""
    need(least_samples >= 0, "pfllib", f"least_samples must be >= 0, got {least_samples}")
    return int(min(least_samples, n / num_clients / 2))


def _pat_order(
    y: np.ndarray,
    num_clients: int,
    num_classes: int,
    rs: np.random.RandomState,
    *,
    k: int,
    balance: bool,
    least: int,
) -> list[np.ndarray]:
    """PFLlib ``pat``: classes in label order go to the first ``ceil(N·k/C)`` clients (by id) that still
    have room for a class; each takes a contiguous block of the class in dataset order. Unbalanced block
    sizes are ``randint(max(m/10, least/C), m)`` with ``m`` the even share (the last holder gets the rest)."""
    room = np.full(num_clients, k)
    owned: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    width = int(np.ceil(num_clients / num_classes * k))
    for c in range(num_classes):  # per class, not per sample
        chosen = np.flatnonzero(room > 0)[:width]
        if chosen.size == 0:
            break  # every client is full: the remaining classes stay unused, as in PFLlib
        idx = np.flatnonzero(y == c)
        share = len(idx) / len(chosen)
        if balance:
            sizes = [int(share)] * (len(chosen) - 1)
        else:  # PFLlib passes float bounds, which the legacy randint truncates: the same draws as int()
            lo, hi = int(max(share / 10, least / num_classes)), int(share)
            why = f"class {c}: {len(idx)} samples for {len(chosen)} clients leave no block size in "
            need(lo < hi, "pfllib_pat", why + f"[{lo}, {hi}); use balance: true")
            sizes = rs.randint(lo, hi, len(chosen) - 1).tolist()
        sizes.append(len(idx) - sum(sizes))
        for client, lo, hi in zip(chosen, np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
            owned[client].append(idx[lo:hi])
            room[client] -= 1
    return [np.concatenate(o) if o else np.zeros(0, np.int64) for o in owned]


def _dir_order(
    y: np.ndarray,
    num_clients: int,
    num_classes: int,
    rs: np.random.RandomState,
    *,
    alpha: float,
    least: int,
    max_retries: int,
) -> list[np.ndarray]:
    """PFLlib ``dir`` (after Yurochkin et al. 2019): per class, shuffle it, draw ``Dir(α·1_N)``, zero the
    clients that already hold ``>= n/N`` samples, cut; redraw everything until every client has ``least``."""
    n, best = len(y), 0
    for _ in range(max(max_retries, 1)):
        batch: list[list[int]] = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            idx = np.flatnonzero(y == c)
            rs.shuffle(idx)
            p = rs.dirichlet(np.repeat(alpha, num_clients))
            p = p * np.array([len(b) < n / num_clients for b in batch])
            need(bool(np.isfinite(p).all() and p.sum() > 0), "pfllib_dir", f"degenerate Dir({alpha}) draw")
            cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(int)[:-1]
            batch = [b + part.tolist() for b, part in zip(batch, np.split(idx, cuts), strict=True)]
        smallest = min(len(b) for b in batch)
        if smallest >= least:
            return [np.asarray(b, dtype=np.int64) for b in batch]
        best = max(best, smallest)
    raise DataError(
        f"partition 'pfllib_dir': no draw gave every client >= least_samples={least} in {max_retries} tries "
        f"(best smallest client: {best}); lower least_samples or num_clients, or raise alpha={alpha}"
    )


def _pat_rule(
    y: np.ndarray,
    n: int,
    c: int,
    rs: np.random.RandomState,
    *,
    classes_per_client: int,
    balance: bool,
    least_samples: int,
) -> list[np.ndarray]:
    k = classes_per_client
    need(1 <= k <= c, "pfllib_pat", f"classes_per_client must be in [1, {c}], got {k}")
    return _pat_order(y, n, c, rs, k=k, balance=balance, least=_least(least_samples, len(y), n))


def _dir_rule(
    y: np.ndarray,
    n: int,
    c: int,
    rs: np.random.RandomState,
    *,
    alpha: float,
    least_samples: int,
    max_retries: int,
) -> list[np.ndarray]:
    if not alpha > 0:
        raise ConfigError(f"partition 'pfllib_dir': alpha must be > 0, got {alpha}")
    least = _least(least_samples, len(y), n)
    return _dir_order(y, n, c, rs, alpha=alpha, least=least, max_retries=max_retries)


#: PFLlib's schemes by registered name: ``rule(labels, num_clients, num_classes, rs, **options)``
_RULES: dict[str, Callable[..., list[np.ndarray]]] = {"pfllib_pat": _pat_rule, "pfllib_dir": _dir_rule}


def _ordered(
    name: str, labels: np.ndarray, num_clients: int, seed: int, num_classes: int, **opts: Any
) -> tuple[list[np.ndarray], np.random.RandomState]:
    """PFLlib's per-client index lists in its order, and the stream left for the split. ``partition_seed``
    (an option) replaces the run's seed: PFLlib draws its clients once (seed 1) for every trial."""
    y = check_labels(labels, num_clients, num_classes, name)
    fixed = opts.pop("partition_seed", None)
    seed = seed if fixed is None else fixed
    if not 0 <= int(seed) < 2**32:
        raise ConfigError(
            f"partition '{name}': the seed (run seed or partition_seed) must be in [0, 2**32) for NumPy's "
            f"legacy stream, got {seed}"
        )
    rs = np.random.RandomState(int(seed))
    return _RULES[name](y, num_clients, num_classes, rs, **opts), rs


@PARTITIONERS.register("pfllib_pat")
def pfllib_pat(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    classes_per_client: int = 2,
    balance: bool = False,
    least_samples: int = 40,
    partition_seed: int | None = None,
) -> list[np.ndarray]:
    """PFLlib's pathological split (``pat``): ``classes_per_client`` classes per client, assigned in order.

    Not random in its classes: with 20 clients, 10 classes and 2 per client, clients 4j..4j+3 hold classes
    2j and 2j+1 (``classes_per_client`` from ``classes_per_client`` differs: least-held classes, random
    ties). ``balance=False`` (PFLlib's Fashion-MNIST benchmark) draws unequal block sizes; every sample of a
    held class is used. ``least_samples``: PFLlib's ``batch_size / (1 − train_ratio)`` = 10 / 0.25 (capped
    at ``n / 2N``). ``partition_seed``: draw with this seed instead of the run's (PFLlib: 1, one partition
    for all its trials).
    """
    opts: dict[str, Any] = {"classes_per_client": classes_per_client, "balance": balance}
    opts.update(least_samples=least_samples, partition_seed=partition_seed)
    parts, _ = _ordered("pfllib_pat", labels, num_clients, seed, num_classes, **opts)
    return [np.sort(p) for p in parts]


@PARTITIONERS.register("pfllib_dir")
def pfllib_dir(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    alpha: float = 0.1,
    least_samples: int = 40,
    max_retries: int = 1000,
    partition_seed: int | None = None,
) -> list[np.ndarray]:
    """PFLlib's practical split (``dir``): NIID-Bench's per-class Dirichlet with its balance mask, redrawn
    until every client holds ``least_samples`` (PFLlib loops without bound; ``max_retries`` stops it).

    The same law as ``{name: dirichlet, alpha: 0.1, min_size: 40}`` but PFLlib's draws: with seed 1 the
    clients of PFLlib's generator. Every sample is used. ``partition_seed`` as in :func:`pfllib_pat`.
    """
    opts: dict[str, Any] = {"alpha": alpha, "least_samples": least_samples, "max_retries": max_retries}
    opts["partition_seed"] = partition_seed
    parts, _ = _ordered("pfllib_dir", labels, num_clients, seed, num_classes, **opts)
    return [np.sort(p) for p in parts]


def share_split(
    parts: list[np.ndarray], train_share: float, rs: np.random.RandomState
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """scikit-learn's ``train_test_split(train_size=s, shuffle=True)`` of each client in turn: a
    permutation of its ``n`` samples (in the given order), the first ``n − floor(s·n)`` its test set.
    Returns sorted ``(train, test)`` per client; a client left without training samples is an error."""
    if not 0.0 < train_share < 1.0:
        raise ConfigError(f"config key 'data.split.train_share' must be in (0, 1), got {train_share}")
    train, test = [], []
    for i, p in enumerate(parts):  # per client: the permutations come one after another from one stream
        n = len(p)
        n_train = int(np.floor(train_share * n))
        if n_train == 0:
            raise DataError(
                f"data.split: client {i} has {n} samples, so train_share={train_share} leaves it no training "
                "sample; use fewer clients or a partition option such as min_size / least_samples"
            )
        perm = rs.permutation(n)
        test.append(np.sort(p[perm[: n - n_train]]))
        train.append(np.sort(p[perm[n - n_train :]]))
    return train, test


def merged_client_split(
    spec: Mapping[str, Any],
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    train_share: float,
    domains: np.ndarray | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Partition a merged train+test pool with ``spec`` and split every client ``train_share`` / rest.

    PFLlib's schemes continue their stream into the split (PFLlib's draws, in its within-client order); any
    other scheme is partitioned as usual and split on its own sub-seed. Returns ``(train, test)`` index
    arrays per client into ``labels``: disjoint, sorted, together exactly the partitioned samples.
    """
    name = str(dict(spec).get("name"))
    if name not in _RULES:
        parts = apply_partition(spec, labels, num_clients, seed, num_classes=num_classes, domains=domains)
        return share_split(parts, train_share, np.random.RandomState(child_seed(seed, _SPLIT_TAG)))
    opts = {k: v for k, v in spec.items() if k != "name"}
    fn = PARTITIONERS.get(name)
    subject = f"config key 'data.partition.{{key}}': unknown option of partition '{name}'"
    check_options(fn, opts, subject, 3, RESERVED)
    defaults = {
        p.name: p.default
        for p in list(inspect.signature(fn).parameters.values())[3:]
        if p.name not in RESERVED
    }
    parts, rs = _ordered(name, labels, num_clients, seed, num_classes, **{**defaults, **opts})
    check_parts([np.sort(p) for p in parts], len(labels), num_clients, name)
    return share_split(parts, train_share, rs)
