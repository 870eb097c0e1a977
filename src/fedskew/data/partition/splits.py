"""Per-client evaluation splits: test sets matching each client's training mix, validation hold-outs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedskew.data.partition.core import assign_counts, class_blocks, largest_remainder, make_rng, to_parts
from fedskew.errors import ConfigError


def validation_split(
    parts: Sequence[np.ndarray], val_fraction: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Carve ``round(val_fraction · n_i)`` random samples (keeping >= 1 for training) out of each client.

    Returns ``(train, val)`` per client, both sorted. Validation is for best-round selection; test never is.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    if val_fraction == 0.0:
        return parts, [np.zeros(0, np.int64) for _ in parts]
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    n_val = np.minimum(np.rint(val_fraction * sizes).astype(np.int64), np.maximum(sizes - 1, 0))
    owner = np.repeat(np.arange(len(parts)), sizes)
    order = np.lexsort((make_rng(seed).random(len(owner)), owner))
    rank = np.arange(len(owner)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    is_val = np.zeros(len(owner), dtype=bool)
    is_val[order[rank < n_val[owner[order]]]] = True
    flags = np.split(is_val, np.cumsum(sizes)[:-1])
    pairs = list(zip(parts, flags, strict=True))
    return [p[~f] for p, f in pairs], [p[f] for p, f in pairs]


def _trim_to_pool(target: np.ndarray, exact: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Undo rounding-up where a class's total demand exceeds its pool: the clients rounded up the most
    give back one sample each (rounding adds less than one per client, so one pass suffices)."""
    excess = np.maximum(target.sum(0) - pool, 0)
    if not excess.any():
        return target
    surplus = np.where(target > 0, target - exact, -np.inf)
    rank = np.argsort(np.argsort(-surplus, axis=0, kind="stable"), axis=0, kind="stable")
    return target - ((rank < excess[None]) & (target > 0))


def _keys(
    train: list[np.ndarray],
    y_test: np.ndarray,
    C: int,
    train_domains: Sequence[np.ndarray] | None,
    test_domains: np.ndarray | None,
) -> tuple[int, list[np.ndarray], np.ndarray]:
    """Matching keys: the class, or ``domain * C + class`` when both splits carry domain tags."""
    if (train_domains is None) != (test_domains is None):
        raise ConfigError(
            "client_test_split: give both train_domains_per_client and test_domains, or neither"
        )
    if test_domains is None or train_domains is None:
        return 1, train, y_test
    d_test = np.asarray(test_domains, dtype=np.int64)
    d_train = [np.asarray(d, dtype=np.int64) for d in train_domains]
    D = int(max([int(d_test.max(initial=-1))] + [int(d.max(initial=-1)) for d in d_train]) + 1)
    return D, [d * C + t for d, t in zip(d_train, train, strict=True)], d_test * C + y_test


def _fixed_rule(name: str, value: Any) -> Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, Any]]:
    """The target rule of ``per_class`` / ``size`` / ``fraction``: ``(hist, sizes) -> (target, fraction)``."""

    def per_class(hist: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, Any]:
        return (hist > 0) * int(value), None

    def size(hist: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, Any]:
        return largest_remainder(hist, np.where(sizes > 0, int(value), 0)), None

    def fraction(hist: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, Any]:
        if not value > 0:
            raise ConfigError(f"data.test.fraction must be > 0, got {value}")
        return largest_remainder(hist, np.rint(value * sizes).astype(np.int64)), float(value)

    return {"per_class": per_class, "size": size, "fraction": fraction}[name]


def _largest_disjoint(hist: np.ndarray, pool: np.ndarray) -> tuple[np.ndarray, float]:
    """Proportional targets at ``f* = min(1, min_k pool_k / demand_k)``, trimmed to fit every pool."""
    sizes = hist.sum(1)
    demand = hist.sum(0)
    ratio = np.divide(pool, demand, out=np.full(len(pool), np.inf), where=demand > 0)
    f = float(min(1.0, ratio.min(initial=np.inf)))
    return _trim_to_pool(largest_remainder(hist, np.rint(f * sizes).astype(np.int64)), f * hist, pool), f


def _targets(hist: np.ndarray, pool: np.ndarray, rules: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """``[N, K]`` test counts per client and key, and the ``rule`` / ``fraction`` info entries."""
    chosen = [(k, v) for k, v in rules.items() if v is not None]
    if not chosen:
        target, f = _largest_disjoint(hist, pool)
        return target, {"fraction": f, "rule": "proportional, largest disjoint"}
    name, value = chosen[0]
    target, f = _fixed_rule(name, value)(hist, hist.sum(1))
    return target, {"fraction": f, "rule": f"{name}={value}"}


def _shared_draws(
    parts: list[np.ndarray],
    test_keys: np.ndarray,
    target: np.ndarray,
    shared: np.ndarray,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Add independent per-client draws for the keys whose pool cannot serve every client disjointly."""
    if not shared.size:
        return parts
    blocks, start, block_size = class_blocks(test_keys, target.shape[1], rng)
    extra: list[list[np.ndarray]] = [[] for _ in parts]
    for key in shared:  # independent draws: per (class, client), never per sample
        members = blocks[start[key] : start[key] + block_size[key]]
        for i in np.flatnonzero(target[:, key]):
            take = min(int(target[i, key]), len(members))
            extra[i].append(rng.choice(members, take, replace=False))
    return [np.sort(np.concatenate([p, *e])) if e else p for p, e in zip(parts, extra, strict=True)]


#: the ``info`` of ``whole=True``: every client shares the whole test set
_WHOLE_INFO: dict[str, Any] = {"fraction": None, "rule": "whole", "disjoint": False}


def client_test_split(
    train_labels_per_client: Sequence[np.ndarray],
    test_labels: np.ndarray,
    seed: int,
    *,
    per_class: int | None = None,
    fraction: float | None = None,
    size: int | None = None,
    disjoint: bool = True,
    whole: bool = False,
    num_classes: int | None = None,
    train_domains_per_client: Sequence[np.ndarray] | None = None,
    test_domains: np.ndarray | None = None,
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Per-client test sets from the global test set, matching each client's training label distribution.

    Personalized evaluation as in FedProto (its authors' code: each client's own classes) and MP-FedCL
    (each client is tested on its own test set, as in FedPCL). Client i's target count
    for class c (or, with domains, for each (domain, class) pair it trains on) is:

    * ``per_class=m``: m for every class the client holds (FedProto: 40 on MNIST, 15 on CIFAR-10/FEMNIST);
    * ``size=s``: s samples in proportion to its training histogram (largest-remainder rounding);
    * ``fraction=f``: ``round(f · n_i)`` samples in proportion to its training histogram;
    * default: ``round(f* · n_i)`` samples in proportion to its training histogram with
      ``f* = min(1, min_c pool_c / Σ_i n_ic)``: the largest proportional test sets that the pool can serve
      disjointly (where rounding up would overdraw a class, the clients rounded up the most give one back);
    * ``whole=True``: every client is tested on the whole test set (a personal-model method scored on the
      balanced global test set, as FedSKC's Table I does for FedProto).

    Test sets are disjoint across clients (``disjoint=True``) for every class whose pool covers the total
    demand; for a class that it does not, each client draws its own sample (without replacement, at most the
    whole pool) independently of the others, so clients may share test samples of that class. Returns
    ``(indices per client, info)`` with ``info = {"disjoint": bool, "shared_classes": [...], "fraction": f,
    "rule": ...}``; ``shared_classes`` lists the classes (or ``(domain, class)`` pairs) sampled independently.
    """
    y_test = np.asarray(test_labels, dtype=np.int64)
    train = [np.asarray(t, dtype=np.int64) for t in train_labels_per_client]
    N = len(train)
    C = int(num_classes or max([int(y_test.max(initial=-1))] + [int(t.max(initial=-1)) for t in train]) + 1)
    C = max(C, 1)
    D, train_keys, test_keys = _keys(train, y_test, C, train_domains_per_client, test_domains)
    if sum(x is not None for x in (per_class, fraction, size)) + bool(whole) > 1:
        raise ConfigError("data.test: set at most one of per_class, fraction, size, whole")
    if whole:
        everything = np.arange(len(y_test), dtype=np.int64)
        return [everything.copy() for _ in train], {**_WHOLE_INFO, "shared_classes": []}
    K = D * C
    owner_train = np.repeat(np.arange(N), [len(t) for t in train])
    flat_keys = np.concatenate(train_keys) if train_keys else np.zeros(0, np.int64)
    hist = np.bincount(owner_train * K + flat_keys, minlength=N * K).reshape(N, K)
    pool = np.bincount(test_keys, minlength=K)
    target, info = _targets(hist, pool, {"per_class": per_class, "size": size, "fraction": fraction})
    rng = make_rng(seed)
    over = target.sum(0) > pool if disjoint else target.sum(0) > 0
    parts = to_parts(assign_counts(test_keys, np.where(over[None], 0, target), rng), N)
    shared = np.flatnonzero(over)
    parts = _shared_draws(parts, test_keys, target, shared, rng)
    info["disjoint"] = bool(shared.size == 0)
    info["shared_classes"] = [int(k) if D == 1 else (int(k // C), int(k % C)) for k in shared]
    return parts, info
