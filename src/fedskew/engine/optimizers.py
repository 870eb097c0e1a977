"""The local optimizers (``client.optimizer``): one update rule per name, for both execution paths.

Each registered optimizer (:data:`OPTIMIZERS`) has two forms over the same arithmetic: a stateful optimizer
over a model's parameters (the sequential loop, :func:`fedskew.engine.client.run_phases`, in-process, in
worker processes and in Flower ClientApps alike) and a stateful step over parameters stacked over clients
(``[K, ...]``, the vectorized trainer, :mod:`fedskew.engine.vectorized`), where only a batch's ``members``
step. Both are built fresh at the start of every phase of every round: federated clients re-create their
optimizer each round, so no optimizer state crosses rounds.

* ``sgd`` (the default): :mod:`fedskew.engine.sgd`, ``torch.optim.SGD``'s update bit for bit.
* ``adamw``: ``torch.optim.AdamW``'s update (Loshchilov & Hutter 2019, Algorithm 2 with decoupled weight
  decay; Kingma & Ba 2015, Algorithm 1 for the moments and bias correction), for every parameter ``p`` with
  a gradient ``g``, step count ``s`` (per parameter, counting its steps with a gradient)::

      p ← p − lr·wd·p;   m ← β₁ m + (1 − β₁) g;   v ← β₂ v + (1 − β₂) g²
      p ← p − lr / (1 − β₁^s) · m / (√v / √(1 − β₂^s) + ε)

  A deviation from every method's published local SGD, for adapter fine-tuning (Tip-Adapter-F trains its
  cache keys with AdamW). Stacked over clients the step count is per client (a client not in a batch's
  members does not step); it equals the per-parameter count because a vectorizable loss gives every
  trainable parameter a gradient at every step.

Written over ``torch._foreach_*`` kernels, not ``torch.optim``, for the reason :mod:`fedskew.engine.sgd`
gives (importing ``torch.optim`` costs every fresh process 1–4 s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from fedskew import numerics
from fedskew.engine.sgd import SGD, apply_step, sgd_directions
from fedskew.errors import ConfigError
from fedskew.settings import ClientSection


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


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


def _per_client(v: Tensor, like: Tensor) -> Tensor:
    """A ``[G]`` tensor viewed to broadcast over ``like`` (``[G, ...]``), in its dtype."""
    return v.to(like.dtype).view(-1, *[1] * (like.dim() - 1))


def adamw_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    count: int | Tensor,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step (the rule above) in place, under the caller's ``torch.no_grad()``: ``count`` is the
    step count after this step, an int shared by the tensors, or a ``[G]`` tensor (one per stacked client);
    ``lr`` a float, or a ``[G]`` tensor."""
    b1, b2 = betas
    params, exp_avgs, exp_avg_sqs = list(params), list(exp_avgs), list(exp_avg_sqs)
    if not params:
        return
    torch._foreach_lerp_(exp_avgs, list(grads), 1 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, list(grads), list(grads), value=1 - b2)
    if isinstance(count, Tensor) or isinstance(lr, Tensor):
        # on the parameters' device and dtype (no float64 on MPS, no host sync): 1 − β^s = −expm1(s·ln β),
        # accurate where 1 − β^s in float32 would lose digits (β₂ = 0.999, s = 1)
        dev, dtype = params[0].device, params[0].dtype
        counts = torch.as_tensor(count, dtype=dtype, device=dev)
        rates = torch.as_tensor(lr, dtype=dtype, device=dev)
        step_size = rates / -torch.expm1(counts * _log(b1))
        bc2_sqrt = numerics.sqrt(-torch.expm1(counts * _log(b2)))
        for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True):
            if weight_decay:
                p.mul_(_per_client(1 - rates * weight_decay, p))
            denom = (numerics.sqrt(v) / _per_client(bc2_sqrt, p)).add_(eps)
            p.sub_(_per_client(step_size, p) * m / denom)
        return
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    denoms = numerics.foreach_sqrt(exp_avg_sqs)  # correctly rounded on every CPU
    torch._foreach_div_(denoms, (1 - b2**count) ** 0.5)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-lr / (1 - b1**count))


class AdamW:
    """Stateful AdamW over a fixed list of parameters, as ``torch.optim.AdamW``: a parameter without a
    gradient is left untouched and its step count does not advance."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), betas, float(eps), float(weight_decay)
        self.moments: list[tuple[Tensor, Tensor] | None] = [None] * len(self.params)
        self.counts = [0] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        by_count: dict[int, list[int]] = {}
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.moments[i] is None:
                self.moments[i] = (torch.zeros_like(p), torch.zeros_like(p))
            self.counts[i] += 1
            by_count.setdefault(self.counts[i], []).append(i)
        for count, live in by_count.items():
            moments: list[tuple[Tensor, Tensor]] = [self.moments[i] for i in live]  # type: ignore[misc]
            adamw_update(
                [self.params[i] for i in live],
                [self.params[i].grad for i in live],  # type: ignore[misc]
                [m for m, _ in moments],
                [v for _, v in moments],
                count,
                self.lr,
                self.betas,
                self.eps,
                self.weight_decay,
            )


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
