"""The randomness a DP guarantee rests on: the noise and the sample of clients.

Differential privacy assumes the adversary does not know the noise, nor (for amplification by sampling)
which clients were sampled. A run's seed is written to its config, its summary and every Flower message, so
randomness derived from it is known to anyone who reads the run's files: two consecutive global models then
give back the exact clipped sum. Under ``privacy.randomness: secret`` (the default) both are drawn here from
the operating system's cryptographic source (``os.urandom``, as Opacus' ``secure_mode`` draws from a CSPRNG)
and never stored: not in a config, a checkpoint, a metrics file or a message.

* Gaussian noise: Box–Muller in float64 on uniforms made of 53 random bits each (``u ∈ (0, 1]``), rounded
  to the update's dtype once.
* The client sample: ``m`` of ``N`` without replacement (``secrets.SystemRandom``), or a Poisson sample
  (each client with probability ``q``, decided by a 53-bit uniform).

``privacy.randomness: reproducible`` keeps the seed-derived streams (``RoundInfo.generator``), for tests and
debugging: such a run is labelled not private and reports no ε (docs/decisions.md, "DP: secret
randomness").
"""

from __future__ import annotations

import math
import os
import secrets

import numpy as np
import torch
from torch import Tensor

_TWO_PI = 2.0 * math.pi


def secret_uniform(n: int) -> np.ndarray:
    """``n`` float64 uniforms in (0, 1] from ``os.urandom`` (53 random bits each)."""
    words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) if n else np.zeros(0, dtype=np.uint64)
    return ((words >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53


def secret_normal(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
    """``n`` independent N(0, 1) draws from the OS's cryptographic source (Box–Muller, float64)."""
    u1, u2 = secret_uniform(n), secret_uniform(n)
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * u2)
    return torch.from_numpy(z).to(device=device, dtype=dtype)


def secret_sample(num_clients: int, per_round: int, rounds: int) -> list[np.ndarray]:
    """Each round's ``per_round`` of ``num_clients`` clients, uniformly without replacement, sorted."""
    draw = secrets.SystemRandom()
    rows = [sorted(draw.sample(range(num_clients), per_round)) for _ in range(rounds)]
    return [np.array(row, dtype=np.int64) for row in rows]


def poisson_sample(
    num_clients: int, q: float, rounds: int, rng: np.random.Generator | None = None
) -> list[np.ndarray]:
    """Each round's Poisson sample: every client independently with probability ``q`` (from the OS's
    cryptographic source, or from ``rng`` for a reproducible run)."""
    n = rounds * num_clients
    u = (secret_uniform(n) if rng is None else rng.random(n)).reshape(rounds, num_clients)
    return [np.flatnonzero(row < q).astype(np.int64) for row in u]
