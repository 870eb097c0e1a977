"""Local mini-batch SGD with momentum and weight decay: ``torch.optim.SGD``'s update, element for element.

The one update rule of the engine (the sequential loop and the vectorized trainer both step through
:func:`sgd_directions` and :func:`apply_step`), for every parameter ``p`` that received a gradient ``g``::

    g ← g + weight_decay · p;   b ← g (first step) or momentum · b + g;   p ← p − lr · b

It is written over ``torch._foreach_*`` kernels rather than taken from ``torch.optim`` because the first
``torch.optim`` optimizer a process builds imports ``torch._dynamo`` (1–4 s on a CPU). Every fresh process
that trains pays it: each Flower ClientApp (Flower starts one process per message), each sweep worker.
On a CPU the result equals ``torch.optim.SGD``'s bit for bit (tests/test_engine_sgd.py). The vectorized
trainer runs the same rule on parameters stacked over clients (``[K, ...]``); a per-client learning rate
(FedEnt's η) is a ``[K]`` tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def sgd_directions(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    buffers: list[Tensor | None],
    momentum: float,
    weight_decay: float,
) -> list[Tensor]:
    """The step directions ``b`` of the rule above; ``buffers`` (one per parameter, ``None`` before the
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
