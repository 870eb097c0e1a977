"""The engine's mini-batch rule, in the algorithm layer so that a method's auxiliary computations (FedBABU's
and FedAvg-FT's fine-tuning, FedGen's count of local steps) cut an epoch exactly as local training does."""

from __future__ import annotations

import torch
from torch import Tensor


def epoch_batches(n: int, batch_size: int, generator: torch.Generator, device: torch.device) -> list[Tensor]:
    """The mini-batches of one epoch: a permutation drawn from the client's generator, cut into batches of
    ``batch_size``; with ``batch_size > 1`` a trailing batch of one sample is dropped (it breaks BatchNorm
    and adds noise only). A client without samples has no batch (and draws nothing)."""
    if n == 0:
        return []
    bs = max(1, min(batch_size, n))
    perm = torch.randperm(n, generator=generator).to(device)
    return [perm[s : s + bs] for s in range(0, n, bs) if not (bs > 1 and n - s == 1)]


def batches_per_epoch(n: int, batch_size: int) -> int:
    """``len(epoch_batches(n, batch_size, ...))`` without drawing the permutation."""
    if n == 0:
        return 0
    bs = max(1, min(batch_size, n))
    return -(-n // bs) - (1 if bs > 1 and n % bs == 1 else 0)
