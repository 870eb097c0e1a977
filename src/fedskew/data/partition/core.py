"""Shared machinery of the partitioners: seeding, validation, count-matrix assignment, dispatch.

Label-based schemes first decide a count matrix ``counts[client, class]`` and then hand out the samples of
each class, shuffled, with :func:`assign_counts`; so no scheme loops over samples in Python. Owner arrays
(``owner[i]`` = client of sample i, -1 = unused) become per-client index lists with :func:`to_parts`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.errors import ConfigError, DataError, did_you_mean
from fedskew.registry import check_options, option_names

#: partitioner arguments that the caller fills in (never set from a config)
RESERVED = frozenset({"num_classes", "domains"})


def make_rng(seed: int) -> np.random.Generator:
    if int(seed) < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed}")
    return np.random.default_rng(int(seed))


def child_seed(seed: int, tag: int) -> int:
    """An independent integer seed derived from ``(seed, tag)``: sub-steps never share a stream."""
    return int(np.random.SeedSequence([int(seed), int(tag)]).generate_state(1, np.uint32)[0])


def check_labels(labels: np.ndarray, num_clients: int, num_classes: int, scheme: str) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise DataError(f"partition '{scheme}': labels must be 1-D, got shape {y.shape}")
    y = y.astype(np.int64, copy=False)
    if num_clients < 1:
        raise DataError(f"partition '{scheme}': num_clients must be >= 1, got {num_clients}")
    if num_classes < 1:
        raise DataError(f"partition '{scheme}': num_classes must be >= 1, got {num_classes}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(
            f"partition '{scheme}': labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]"
        )
    return y


def need(cond: bool, scheme: str, why: str) -> None:
    if not cond:
        raise DataError(f"partition '{scheme}': {why}")


def to_parts(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """``owner[i]`` = client of sample i (-1 = unused) -> sorted index arrays, one per client."""
    order = np.argsort(owner, kind="stable")  # stable: indices stay ascending inside each client
    counts = np.bincount(owner[owner >= 0], minlength=num_clients)
    order = order[len(owner) - int(counts.sum()) :].astype(np.int64)
    return [a.copy() for a in np.split(order, np.cumsum(counts)[:-1])]


def class_blocks(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Indices grouped by class, shuffled inside each class; plus each class's start and size."""
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    sizes = np.bincount(labels, minlength=num_classes)
    return order, np.cumsum(sizes) - sizes, sizes


def assign_counts(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Owner array giving client i ``counts[i, c]`` random samples of class c, without replacement.

    ``counts.sum(0)`` must not exceed the class sizes; leftover samples get owner -1.
    """
    num_clients, num_classes = counts.shape
    order, start, _ = class_blocks(labels, num_classes, rng)
    per_class = counts.T.ravel()  # class-major: (c0: clients...), (c1: clients...), ...
    take = counts.sum(0)
    owners = np.repeat(np.tile(np.arange(num_clients), num_classes), per_class)
    offset = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
    owner = np.full(len(labels), -1, dtype=np.int64)
    owner[order[np.repeat(start, take) + offset]] = owners
    return owner


def largest_remainder(weights: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Integer rows proportional to ``weights`` (rows ``[R, K]``) that sum exactly to ``totals`` ``[R]``."""
    w = np.asarray(weights, dtype=np.float64)
    s = w.sum(-1, keepdims=True)
    w = np.divide(w, s, out=np.zeros_like(w), where=s > 0)
    raw = w * np.asarray(totals, dtype=np.float64)[..., None]
    base = np.floor(raw).astype(np.int64)
    missing = np.asarray(totals, dtype=np.int64) - base.sum(-1)
    rank = np.argsort(np.argsort(base - raw, axis=-1, kind="stable"), axis=-1, kind="stable")
    return base + (rank < missing[..., None])


def sizes_with_min(weights: np.ndarray, total: int, min_size: int) -> np.ndarray:
    """Client sizes ``>= min_size`` summing to ``total``, the surplus split in proportion to ``weights``."""
    n = len(weights)
    return min_size + largest_remainder(weights[None], np.array([total - n * min_size]))[0]


def split_sizes(owner_sizes: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Owner array for a uniformly random split of ``n`` samples into the given sizes."""
    owner = np.full(n, -1, dtype=np.int64)
    owner[rng.permutation(n)[: int(owner_sizes.sum())]] = np.repeat(np.arange(len(owner_sizes)), owner_sizes)
    return owner


def choose(table: Mapping[str, Any], name: str, option: str, scheme: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(
            f"partition '{scheme}': unknown {option} '{name}'{did_you_mean(name, table)}; "
            f"valid: {', '.join(table)}"
        ) from None


# ----------------------------------------------------------------------------------------------- dispatch
def partition_options(fn: Callable[..., Any]) -> list[str]:
    """The keyword options a partitioner accepts from a config (its signature minus reserved names)."""
    return option_names(fn, 3, RESERVED)


def check_parts(parts: Sequence[np.ndarray], n: int, num_clients: int, scheme: str) -> list[np.ndarray]:
    """Validate a partitioner's output: ``num_clients`` disjoint sorted in-range int64 arrays."""
    if len(parts) != num_clients:
        raise DataError(f"partition '{scheme}' returned {len(parts)} clients, expected {num_clients}")
    out = [np.asarray(p, dtype=np.int64) for p in parts]
    flat = np.concatenate(out) if out else np.zeros(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= n):
        raise DataError(f"partition '{scheme}' returned indices outside [0, {n})")
    if flat.size != np.unique(flat).size:
        raise DataError(f"partition '{scheme}' returned overlapping clients")
    return [p if p.size < 2 or bool(np.all(p[1:] > p[:-1])) else np.sort(p) for p in out]


def apply_partition(
    spec: Mapping[str, Any],
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    where: str = "data.partition",
) -> list[np.ndarray]:
    """Run the scheme ``spec = {"name": ..., **options}``, rejecting unknown options (with did-you-mean).

    ``where`` is the config path used in error messages (nested specs pass e.g. ``data.partition.then``).
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(f"config key '{where}' must be a mapping like {{name: dirichlet, alpha: 0.5}}")
    options = dict(spec)
    name = options.pop("name", None)
    if name is None:
        raise ConfigError(f"config key '{where}.name' is required; valid: {', '.join(PARTITIONERS.names())}")
    fn = PARTITIONERS.get(str(name))
    subject = f"config key '{where}.{{key}}': unknown option of partition '{name}'"
    check_options(fn, options, subject, 3, RESERVED)
    parts = fn(labels, num_clients, seed, num_classes=num_classes, domains=domains, **options)
    return check_parts(parts, len(labels), num_clients, str(name))
