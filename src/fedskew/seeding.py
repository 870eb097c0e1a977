"""Seed derivation shared by every layer (the engine's streams, algorithms' own randomness)."""

from __future__ import annotations

import numpy as np


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integers (e.g. ``(seed, round, cid)``), independent of execution order."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, dtype=np.uint64)[0] >> 1)
