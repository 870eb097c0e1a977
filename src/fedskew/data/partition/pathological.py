"""Pathological label skew: FedAvg shards, exactly k classes per client, FedProto's n-way k-shot tasks."""

from __future__ import annotations

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition.core import assign_counts, check_labels, choose, make_rng, need, to_parts
from fedskew.errors import ConfigError, DataError


@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """McMahan et al. 2017 (FedAvg) shards: sort by label, cut into N·s equal shards, s random shards each.

    With MNIST, 100 clients and s = 2 this is the paper's 200 shards of 300 images. Shard sizes differ by at
    most one when N·s does not divide n; every sample is used.
    """
    y = check_labels(labels, num_clients, num_classes, "shards")
    need(shards_per_client >= 1, "shards", f"shards_per_client must be >= 1, got {shards_per_client}")
    total = num_clients * shards_per_client
    need(total <= len(y), "shards", f"{total} shards (N x shards_per_client) exceed the {len(y)} samples")
    rng = make_rng(seed)
    order = np.lexsort((rng.random(len(y)), y))  # by label; ties (same class) in random order
    shard_sizes = np.full(total, len(y) // total) + (np.arange(total) < len(y) % total)
    shard_owner = rng.permutation(total) // shards_per_client
    owner = np.empty(len(y), dtype=np.int64)
    owner[order] = np.repeat(shard_owner, shard_sizes)
    return to_parts(owner, num_clients)


@PARTITIONERS.register("classes_per_client")
def classes_per_client(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    k: int = 2,
) -> list[np.ndarray]:
    """Each client holds exactly ``k`` classes (the "#C = k" skew of NIID-Bench / FedProx / pFedMe).

    Clients pick their classes in turn among the classes held by the fewest clients so far (random ties), so
    each class is held by ⌊Nk/C⌋ or ⌈Nk/C⌉ clients and every class is used when N·k ≥ C. A class's samples
    are split equally (±1) among its holders.
    """
    y = check_labels(labels, num_clients, num_classes, "classes_per_client")
    class_sizes = np.bincount(y, minlength=num_classes)
    present = np.flatnonzero(class_sizes)
    need(
        1 <= k <= len(present),
        "classes_per_client",
        f"k={k} classes per client, but the labels have {len(present)} classes (need 1 <= k <= classes)",
    )
    rng = make_rng(seed)
    holders = np.zeros(len(present))
    mask = np.zeros((num_clients, num_classes), dtype=bool)
    for i in range(num_clients):  # per client (not per sample): least-held classes first
        pick = np.argpartition(holders + rng.random(len(present)), k - 1)[:k]
        holders[pick] += 1
        mask[i, present[pick]] = True
    held = mask.sum(0)
    short = np.flatnonzero(mask.any(0) & (class_sizes < held))
    if short.size:
        c = int(short[0])
        raise DataError(
            f"partition 'classes_per_client': class {c} has {class_sizes[c]} samples for {held[c]} clients "
            "that must hold it; lower k or num_clients"
        )
    # equal split of each class among its holders; the +1 remainders go to random holders
    rank = np.argsort(np.argsort(np.where(mask, rng.random(mask.shape), np.inf), axis=0), axis=0)
    base, extra = np.divmod(class_sizes, np.maximum(held, 1))
    counts = mask * (base + (rank < extra))
    return to_parts(assign_counts(y, counts.astype(np.int64), rng), num_clients)


def _shots_uniform(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    return rng.integers(k - s + 1, k + s + 1, n) if s > 0 else np.full(n, k)


def _shots_mnist_code(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    if s < 2:
        raise ConfigError(
            f"partition 'nway_kshot': shot_noise 'mnist_code' draws k from [k-s+1, k+s-2], empty for "
            f"stdev={s}; use stdev >= 2 or shot_noise 'uniform'"
        )
    return rng.integers(k - s + 1, k + s - 1, n)


def _shots_gaussian(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    return np.maximum(np.rint(rng.normal(k, s, n)), 1).astype(np.int64)


def _shots_none(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    return np.full(n, k)


_SHOT_NOISE = {
    "uniform": _shots_uniform,
    "mnist_code": _shots_mnist_code,
    "gaussian": _shots_gaussian,
    "none": _shots_none,
}


@PARTITIONERS.register("nway_kshot")
def nway_kshot(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    n: int = 3,
    stdev: int = 2,
    k: int = 100,
    shot_noise: str = "uniform",
    max_retries: int = 100,
) -> list[np.ndarray]:
    """FedProto's n-way k-shot tasks (Tan et al. 2022, Experiments, "Local tasks"; the authors' sampler).

    Client i holds ``n_i ~ U{max(2, n−stdev), …, min(C−1, n+stdev)}`` classes (uniform integers, as the
    FedProto code; the lower bound 2 and upper bound C−1 are the code's clips), drawn uniformly without
    replacement, and ``k_i`` samples of each. ``shot_noise``: ``uniform`` ``k_i ~ U{k−stdev+1, …, k+stdev}``
    (default; FedProto's CIFAR-10/FEMNIST code; docs/methods/fedproto.md, "FedProto: noise on n and k"),
    ``mnist_code`` ``U{k−stdev+1, …, k+stdev−2}`` (FedProto's MNIST code path, empty for stdev < 2),
    ``gaussian`` ``round(N(k, stdev²))`` or ``none`` (exactly k). Samples are drawn without replacement
    across clients; the rest stay unused. If a draw asks for more samples of a class than exist, the draw is
    repeated (``max_retries``).
    """
    y = check_labels(labels, num_clients, num_classes, "nway_kshot")
    lo, hi = max(2, n - stdev), min(num_classes - 1, n + stdev)
    need(
        lo <= hi,
        "nway_kshot",
        f"n={n} ± stdev={stdev} ways gives no valid class count in [2, num_classes-1={num_classes - 1}]",
    )
    need(k >= 1 and stdev >= 0, "nway_kshot", f"need k >= 1 and stdev >= 0, got k={k}, stdev={stdev}")
    draw_shots = choose(_SHOT_NOISE, shot_noise, "shot_noise", "nway_kshot")
    supply = np.bincount(y, minlength=num_classes)
    rng = make_rng(seed)
    worst = (0, 0, 0)
    for _ in range(max(max_retries, 1)):
        ways = rng.integers(lo, hi + 1, num_clients)
        shots = draw_shots(rng, num_clients, k, stdev)
        rank = np.argsort(rng.random((num_clients, num_classes)), axis=1).argsort(axis=1)
        counts = (rank < ways[:, None]) * shots[:, None]
        demand = counts.sum(0)
        if np.all(demand <= supply):
            return to_parts(assign_counts(y, counts.astype(np.int64), rng), num_clients)
        c = int(np.argmax(demand - supply))
        worst = max(worst, (int(demand[c] - supply[c]), c, int(demand[c])))
    raise DataError(
        f"partition 'nway_kshot': each of {max_retries} draws asked for more samples of a class than exist "
        f"(e.g. {worst[2]} of class {worst[1]}, which has {supply[worst[1]]}); lower k, n or num_clients"
    )
