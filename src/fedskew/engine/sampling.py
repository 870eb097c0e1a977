"""Seeds and client sampling shared by every algorithm, so comparisons are paired."""

from __future__ import annotations

import numpy as np

from fedskew.seeding import derive_seed

__all__ = ["clients_per_round", "derive_seed", "sampling_schedule"]


def clients_per_round(num_clients: int, fraction: float) -> int:
    return max(1, min(num_clients, round(fraction * num_clients)))


def sampling_schedule(num_clients: int, fraction: float, rounds: int, seed: int) -> np.ndarray:
    """``[rounds, m]`` client ids, pre-drawn once per seed: the same stream for every algorithm.

    Each row is a uniform sample without replacement (McMahan et al. 2017); with ``fraction=1`` every
    client takes part every round, in id order.
    """
    m = clients_per_round(num_clients, fraction)
    if m == num_clients:
        return np.tile(np.arange(num_clients, dtype=np.int64), (rounds, 1))
    rng = np.random.default_rng(derive_seed(seed, 0x5A3B1E))
    keys = rng.random((rounds, num_clients))
    return np.sort(np.argpartition(keys, m - 1, axis=1)[:, :m], axis=1).astype(np.int64)
