"""The local optimizers (``client.optimizer``): one update rule per name, for both execution paths.

Each registered optimizer (:data:`OPTIMIZERS`) has two forms over the same arithmetic: a stateful optimizer
over a model's parameters (the sequential loop, :func:`fedskew.engine.client.run_phases`, in-process, in
worker processes and in Flower ClientApps alike) and a stateful step over parameters stacked over clients
(``[K, ...]``, the vectorized trainer, :mod:`fedskew.engine.vectorized`), where only a batch's ``members``
step. Both are built fresh at the start of every phase of every round: federated clients re-create their
optimizer each round, so no optimizer state crosses rounds.

* ``sgd`` (the default): :mod:`fedskew.update_rules`, ``torch.optim.SGD``'s update bit for bit.
* ``adamw``: ``torch.optim.AdamW``'s update (Loshchilov & Hutter 2019, Algorithm 2 with decoupled weight
  decay; Kingma & Ba 2015, Algorithm 1 for the moments and bias correction), for every parameter ``p`` with
  a gradient ``g``, step count ``s`` (per parameter, counting its steps with a gradient)::

      p ← p − lr·wd·p;   m ← β₁ m + (1 − β₁) g;   v ← β₂ v + (1 − β₂) g²
      p ← p − lr / (1 − β₁^s) · m / (√v / √(1 − β₂^s) + ε)

  A deviation from every method's published local SGD, for adapter fine-tuning (Tip-Adapter-F trains its
  cache keys with AdamW). Stacked over clients the step count is per client (a client not in a batch's
  members does not step); it equals the per-parameter count because a vectorizable loss gives every
  trainable parameter a gradient at every step.

The update rules themselves live in the leaf module :mod:`fedskew.update_rules` (algorithms that run their own
small loops on copies import them from there), written over ``torch._foreach_*`` kernels, not ``torch.optim``
(importing ``torch.optim`` costs every fresh process 1–4 s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from fedskew.errors import ConfigError
from fedskew.settings import ClientSection
from fedskew.update_rules import SGD, AdamW, adamw_update, apply_step, sgd_directions

__all__ = ["OPTIMIZERS", "AdamW", "adamw_update", "local_optimizer", "stacked_optimizer"]


class LocalOptimizer(Protocol):
    """A stateful optimizer over one model's parameters (the sequential loop)."""

    def zero_grad(self) -> None: ...

    def step(self) -> None: ...


class StackedOptimizer(Protocol):
    """One phase's optimizer state over parameters stacked over K clients (the vectorized trainer)."""

    def step(self, params: list[Tensor], grads: list[Tensor], lr: float | Tensor, sel: Tensor | None) -> None:
        """Step the clients ``sel`` (``None``: all K) in place: ``params`` and ``grads`` are theirs (``[G,
        ...]``, in the phase's trainable order), ``lr`` a float or one rate per member."""


def _take(v: Tensor, sel: Tensor | None) -> Tensor:
    return v if sel is None else v.index_select(0, sel)


class StackedSGD:
    """:mod:`fedskew.engine.sgd` on stacked parameters: one momentum buffer per trainable tensor, from zeros
    (``m·0 + g = g``, the first step's)."""

    def __init__(
        self, params: Mapping[str, Tensor], names: Sequence[str], momentum: float, cfg: ClientSection
    ) -> None:
        self.names, self.momentum, self.weight_decay = list(names), momentum, cfg.weight_decay
        self.buffers = {n: torch.zeros_like(params[n]) for n in self.names} if momentum else {}

    def step(self, params: list[Tensor], grads: list[Tensor], lr: float | Tensor, sel: Tensor | None) -> None:
        bufs: list[Tensor | None] = [_take(self.buffers[n], sel) for n in self.names] if self.momentum else []
        directions = sgd_directions(params, grads, bufs, self.momentum, self.weight_decay)
        apply_step(params, directions, lr)
        if sel is not None:  # otherwise the buffers are the stacked tensors themselves
            for n, b in zip(self.buffers, bufs, strict=True):
                self.buffers[n].index_copy_(0, sel, b)  # type: ignore[arg-type]


class StackedAdamW:
    """AdamW on stacked parameters: moments per trainable tensor, one step count per client."""

    def __init__(
        self, params: Mapping[str, Tensor], names: Sequence[str], momentum: float, cfg: ClientSection
    ) -> None:
        _no_momentum(momentum)
        self.names, self.cfg = list(names), cfg
        self.moments = {n: (torch.zeros_like(params[n]), torch.zeros_like(params[n])) for n in self.names}
        first = params[self.names[0]] if self.names else torch.zeros(0)
        self.counts = torch.zeros(first.shape[:1], dtype=first.dtype, device=first.device)  # exact to 2^24

    def step(self, params: list[Tensor], grads: list[Tensor], lr: float | Tensor, sel: Tensor | None) -> None:
        if sel is None:
            self.counts += 1
        else:
            self.counts.index_add_(0, sel, torch.ones_like(sel, dtype=self.counts.dtype))
        ms = [_take(self.moments[n][0], sel) for n in self.names]
        vs = [_take(self.moments[n][1], sel) for n in self.names]
        c = self.cfg
        adamw_update(params, grads, ms, vs, _take(self.counts, sel), lr, c.betas, c.eps, c.weight_decay)
        if sel is not None:
            for n, m, v in zip(self.names, ms, vs, strict=True):
                self.moments[n][0].index_copy_(0, sel, m)
                self.moments[n][1].index_copy_(0, sel, v)


def _no_momentum(momentum: float) -> None:
    if momentum:
        raise ConfigError(
            f"client.optimizer=adamw: a phase asks for SGD momentum {momentum}; allowed with adamw: 0 (β₁ is "
            "its momentum)"
        )


def _local_sgd(params: list[Tensor], lr: float, momentum: float, cfg: ClientSection) -> LocalOptimizer:
    return SGD(params, lr, momentum, cfg.weight_decay)


def _local_adamw(params: list[Tensor], lr: float, momentum: float, cfg: ClientSection) -> LocalOptimizer:
    _no_momentum(momentum)
    return AdamW(params, lr, cfg.betas, cfg.eps, cfg.weight_decay)


@dataclass(frozen=True)
class OptimizerKind:
    """A registered local optimizer: its sequential and stacked forms and the float tensors of state it
    keeps per parameter (the vectorized trainer's memory estimate)."""

    local: Callable[[list[Tensor], float, float, ClientSection], LocalOptimizer]
    stacked: Callable[[Mapping[str, Tensor], Sequence[str], float, ClientSection], StackedOptimizer]
    state_slots: int


#: ``client.optimizer`` → its rule
OPTIMIZERS: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind(_local_sgd, StackedSGD, 1),
    "adamw": OptimizerKind(_local_adamw, StackedAdamW, 2),
}


def local_optimizer(cfg: ClientSection, params: list[Tensor], lr: float, momentum: float) -> LocalOptimizer:
    """A phase's optimizer over ``params`` (the sequential loop): ``cfg.optimizer`` at rate ``lr``."""
    return OPTIMIZERS[cfg.optimizer].local(params, lr, momentum, cfg)


def stacked_optimizer(
    cfg: ClientSection, params: Mapping[str, Tensor], names: Sequence[str], momentum: float
) -> StackedOptimizer:
    """A phase's optimizer state over the stacked ``params`` it trains (``names``; the vectorized trainer)."""
    return OPTIMIZERS[cfg.optimizer].stacked(params, names, momentum, cfg)
