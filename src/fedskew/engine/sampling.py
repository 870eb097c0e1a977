"""Seeds and client sampling shared by every algorithm, so comparisons are paired."""

from __future__ import annotations

import numpy as np

from fedskew.algorithms.security.randomness import poisson_sample, secret_sample
from fedskew.seeding import derive_seed
from fedskew.settings import PrivacySection

__all__ = [
    "client_schedule",
    "clients_per_round",
    "derive_seed",
    "sampling_keys",
    "sampling_row",
    "sampling_schedule",
]

#: a round's sampled clients, round by round (rows of one length, or of any length under Poisson sampling)
Schedule = np.ndarray | list[np.ndarray]


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
    keys = sampling_keys(num_clients, rounds, seed)
    return np.sort(np.argpartition(keys, m - 1, axis=1)[:, :m], axis=1).astype(np.int64)


def sampling_keys(num_clients: int, rounds: int, seed: int) -> np.ndarray:
    """``[rounds, N]`` uniform keys, one row per round: a round samples the clients with the ``m`` smallest
    keys (:func:`sampling_schedule`; on the virtual clock, among the online ones: fedskew.engine.clock)."""
    return np.random.default_rng(derive_seed(seed, 0x5A3B1E)).random((rounds, num_clients))


def sampling_row(num_clients: int, row: int, seed: int) -> np.ndarray:
    """Row ``row`` (0-based) of :func:`sampling_keys` without the rows before it: the generator (PCG64, one
    64-bit draw per double) is advanced past them, so a run of many rounds holds one row at a time."""
    bits = np.random.PCG64(derive_seed(seed, 0x5A3B1E))  # default_rng's bit generator
    bits.advance(row * num_clients)
    return np.random.Generator(bits).random(num_clients)


def client_schedule(
    num_clients: int, fraction: float, rounds: int, seed: int, privacy: PrivacySection
) -> Schedule:
    """The run's sample of clients, round by round. Without DP (or with ``privacy.randomness:
    reproducible``) it follows from the seed (:func:`sampling_schedule`: every method sees the same
    clients, so comparisons are paired). A DP run with secret randomness draws it from the OS's
    cryptographic source, never stored: amplification by sampling assumes nobody knows the sample
    (docs/decisions.md, "DP: secret randomness"). ``privacy.sampling: poisson`` includes each client
    independently with ``q = m / N``."""
    m = clients_per_round(num_clients, fraction)
    dp = privacy.mechanism != "none"
    secret = dp and privacy.randomness == "secret"
    if dp and privacy.sampling == "poisson":
        rng = None if secret else np.random.default_rng(derive_seed(seed, 0x5A3B1E, 1))
        return poisson_sample(num_clients, m / num_clients, rounds, rng)
    if secret and m < num_clients:
        return secret_sample(num_clients, m, rounds)
    return sampling_schedule(num_clients, fraction, rounds, seed)
