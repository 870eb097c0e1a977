"""The optimizer update rules, in one leaf module that the engine and the algorithms both import.

Why a leaf: an algorithm may not import the engine (layers: algorithms → engine), yet several methods run
small optimizer loops of their own on copies (FedAvg-FT / FedBABU's fine-tuning, FedGen's server-side
generator), which used to carry copies of the engine's arithmetic. Every rule lives here once:

* SGD (``torch.optim.SGD``'s update, element for element), for every parameter ``p`` with a gradient ``g``::

      g ← g + weight_decay · p;   b ← g (first step) or momentum · b + g;   p ← p − lr · b

  :func:`sgd_directions` and :func:`apply_step` (the engine's sequential loop and vectorized trainer step
  through them), :class:`SGD` the stateful form. Written over ``torch._foreach_*`` kernels rather than taken
  from ``torch.optim``: the first ``torch.optim`` optimizer a process builds imports ``torch._dynamo`` (1–4 s
  on a CPU), which every fresh process that trains would pay (Flower ClientApps, sweep workers).
* AdamW (``torch.optim.AdamW``: Loshchilov & Hutter 2019, Alg. 2, decoupled weight decay; Kingma & Ba 2015,
  Alg. 1 moments and bias correction), step count ``s``::

      p ← p − lr·wd·p;   m ← β₁ m + (1 − β₁) g;   v ← β₂ v + (1 − β₂) g²
      p ← p − lr / (1 − β₁^s) · m / (√v / √(1 − β₂^s) + ε)

  :func:`adamw_update` and :class:`AdamW`.
* Adam with L2 weight decay added to the gradient (``torch.optim.Adam(weight_decay=...)``):
  :func:`adam_l2_update`, functional (new moment tensors; FedGen keeps its moments in server state, which a
  hook may not change in place).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from fedskew import numerics

__all__ = ["SGD", "AdamW", "adam_l2_update", "adamw_update", "apply_step", "sgd_directions"]


# -------------------------------------------------------------------- SGD
def sgd_directions(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    buffers: list[Tensor | None],
    momentum: float,
    weight_decay: float,
) -> list[Tensor]:
    """The step directions ``b`` of the SGD rule; ``buffers`` (one per parameter, ``None`` before the
    first step) are updated in place or adopted, and the directions returned are those buffers. Callers
    hold ``torch.no_grad()`` (one context per step, not one per helper: a step of a small model is
    microseconds)."""
    grads = list(grads)
    if weight_decay:
        grads = list(torch._foreach_add(grads, list(params), alpha=weight_decay))
    if not momentum:
        return grads
    held = [k for k, b in enumerate(buffers) if b is not None]
    if held:
        bufs: list[Tensor] = [buffers[k] for k in held]  # type: ignore[misc]
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, [grads[k] for k in held])
    for k, b in enumerate(buffers):
        if b is None:
            # torch.optim.SGD copies the first gradient; adopting it is the same value without the copy,
            # because the caller drops ``p.grad`` and the next backward allocates a new gradient.
            buffers[k] = grads[k].detach()
    return [b for b in buffers if b is not None]


def apply_step(params: Sequence[Tensor], directions: Sequence[Tensor], lr: float | Tensor) -> None:
    """``p ← p − lr · b`` in place (under the caller's ``torch.no_grad()``); ``lr`` a float, or a ``[K]``
    tensor: one rate per stacked client."""
    if isinstance(lr, Tensor):
        for p, d in zip(params, directions, strict=True):
            p.sub_(lr.view(-1, *[1] * (d.dim() - 1)) * d)
    else:
        torch._foreach_add_(list(params), list(directions), alpha=-lr)


class SGD:
    """Stateful SGD over a fixed list of parameters; a parameter without a gradient is left untouched (and
    gets no momentum buffer), as in ``torch.optim.SGD``."""

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.buffers: list[Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``): the momentum buffers may be the previous gradients."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        params = [self.params[i] for i in live]
        grads: list[Tensor] = [p.grad for p in params]  # type: ignore[misc]
        bufs = [self.buffers[i] for i in live]
        directions = sgd_directions(params, grads, bufs, self.momentum, self.weight_decay)
        if self.momentum:
            for i, b in zip(live, bufs, strict=True):
                self.buffers[i] = b
        apply_step(params, directions, self.lr)


# -------------------------------------------------------------------- AdamW
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


# -------------------------------------------------------------------- Adam (L2)
def adam_l2_update(
    params: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    moments: tuple[Mapping[str, Tensor], Mapping[str, Tensor]],
    count: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One Adam step with L2 decay added to the gradient (``g ← g + wd·p``, then Kingma & Ba's Alg. 1 at
    step ``count``), ``params`` changed in place under the caller's ``torch.no_grad()``; returns the new
    first and second moments as new tensors (the given ones are left as they were)."""
    (b1, b2), (m_old, v_old) = betas, moments
    m, v = dict(m_old), dict(v_old)
    for name, param in params.items():
        g = grads[name] + weight_decay * param
        m[name] = b1 * m[name] + (1 - b1) * g
        v[name] = b2 * v[name] + (1 - b2) * g * g
        denom = numerics.sqrt(v[name] / (1 - b2**count)) + eps
        param.sub_(lr * (m[name] / (1 - b1**count)) / denom)
    return m, v
