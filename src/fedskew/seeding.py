"""Seed derivation shared by every layer (the engine's streams, algorithms' own randomness)."""

from __future__ import annotations

import numpy as np
import torch


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integers (e.g. ``(seed, round, cid)``), independent of execution order."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, dtype=np.uint64)[0] >> 1)


def seed_torch(seed: int, device: torch.device) -> None:
    """Seed the global torch stream(s) that ``device``'s kernels draw from (dropout, in-loss sampling).

    Same streams as ``torch.manual_seed`` for CPU and CUDA runs, without its per-call cost: that also
    queues a lazy seed for every CUDA device and records a Python traceback for it (~0.1 ms, per client
    per round on a CPU run).
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):  # the generator of the run's device, not of the current one
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)
