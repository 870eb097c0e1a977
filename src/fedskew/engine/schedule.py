"""The local-training schedule: what every execution path derives from a client's :class:`LocalPlan`.

One place decides, for the sequential loop (:func:`fedskew.engine.client.run_phases`) and the vectorized
trainer (:mod:`fedskew.engine.vectorized`) alike: the epochs of every phase in order, each with its
learning rate (the phase's rate times the round's factor, ``client.lr_decay`` and ``client.lr_schedule``:
:meth:`~fedskew.settings.ClientSection.round_lr_scale`), momentum, trainable parameters and last-epoch
flag; the running loss totals (:class:`EpochLoss`); and the non-finite rule (a client whose epoch loss is
NaN/Inf is rejected). The mini-batches of an epoch are
:func:`fedskew.algorithms.batching.epoch_batches`, which methods' auxiliary computations share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fedskew.algorithms.steps import Phase
from fedskew.settings import ClientSection


class NonFiniteLoss(RuntimeError):
    """Local training produced a NaN/Inf loss: the client's update is rejected."""


@dataclass(frozen=True)
class EpochSpec:
    """One epoch of local training."""

    phase: int  # index of the phase
    epoch: int  # epoch within the phase
    last: bool  # the last epoch of the last phase (``Batch.last_epoch``)
    lr: float  # phase lr x the round's factor (lr_decay, lr_schedule)
    momentum: float
    trainable: tuple[str, ...]  # names of the parameters this epoch trains

    @property
    def structure(self) -> tuple[int, int, bool, float, tuple[str, ...]]:
        """What must be equal for clients trained in one vmap call (the learning rate may differ)."""
        return (self.phase, self.epoch, self.last, self.momentum, self.trainable)


def local_schedule(
    phases: list[Phase], cfg: ClientSection, lr_scale: float, names: list[str]
) -> list[EpochSpec]:
    """Every epoch of ``phases`` in order, for a model whose parameter names are ``names``."""
    out: list[EpochSpec] = []
    for p_i, phase in enumerate(phases):
        trainable = tuple(n for n in names if phase.trainable is None or phase.trainable(n))
        momentum = cfg.momentum if phase.momentum is None else phase.momentum
        for epoch in range(phase.epochs):
            last = p_i == len(phases) - 1 and epoch == phase.epochs - 1
            out.append(EpochSpec(p_i, epoch, last, phase.lr * lr_scale, momentum, trainable))
    return out



class EpochLoss:
    """Running loss totals of one epoch for ``k`` clients (the sequential loop: one), on the device.

    ``add`` takes the batch's mean losses (one per member client) and the batch size, and accumulates
    ``loss x batch`` in the loss's dtype, in batch order, so both paths sum the same values the same way.
    """

    def __init__(self, k: int, device: torch.device) -> None:
        self.total = torch.zeros(k, device=device)
        self.count = [0] * k

    def add(self, losses: Tensor, batch: int, members: list[int] | None = None) -> None:
        """Accumulate the detached ``losses`` ([G], or a scalar for one client) of clients ``members``."""
        if members is None:
            self.total[0] += losses.detach() * batch
            self.count[0] += batch
            return
        contrib = losses.detach().to(self.total.dtype) * batch
        self.total.index_add_(0, torch.tensor(members, device=self.total.device), contrib)
        for k in members:
            self.count[k] += batch

    def means(self) -> list[float]:
        """The epoch's mean loss per client; NaN for a client that had no batch."""
        totals = self.total.tolist()
        return [t / c if c else float("nan") for t, c in zip(totals, self.count, strict=True)]

    def finite(self) -> list[bool]:
        """The non-finite rule: a client's epoch is acceptable unless it trained and its loss is NaN/Inf."""
        return [c == 0 or math.isfinite(m) for m, c in zip(self.means(), self.count, strict=True)]
