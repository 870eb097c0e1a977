"""Local mini-batch SGD with momentum and weight decay: ``torch.optim.SGD``'s update, element for element.

The update (no dampening, no Nesterov), for every parameter ``p`` that received a gradient ``g``::

    g ← g + weight_decay · p;   b ← g (first step) or momentum · b + g;   p ← p − lr · b

It is written over ``torch._foreach_*`` kernels rather than taken from ``torch.optim`` because the first
``torch.optim`` optimizer a process builds imports ``torch._dynamo`` (1–4 s on a CPU). Every fresh process
that trains pays it: each Flower ClientApp (Flower starts one process per message), each sweep worker.
On a CPU the result equals ``torch.optim.SGD``'s bit for bit (tests/test_engine_sgd.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


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
        if self.weight_decay:
            grads = list(torch._foreach_add(grads, params, alpha=self.weight_decay))
        if self.momentum:
            grads = self._momentum(live, grads)
        torch._foreach_add_(params, grads, alpha=-self.lr)

    def _momentum(self, live: list[int], grads: list[Tensor]) -> list[Tensor]:
        """Update the momentum buffers of the parameters ``live`` (a first step copies the gradient)."""
        held = [k for k, i in enumerate(live) if self.buffers[i] is not None]
        if held:
            bufs: list[Tensor] = [self.buffers[live[k]] for k in held]  # type: ignore[misc]
            torch._foreach_mul_(bufs, self.momentum)
            torch._foreach_add_(bufs, [grads[k] for k in held])
        for k, i in enumerate(live):
            if self.buffers[i] is None:
                # torch.optim.SGD copies the first gradient; adopting it is the same value without the copy,
                # because zero_grad() drops ``p.grad`` and the next backward allocates a new gradient.
                self.buffers[i] = grads[k].detach()
        return [self.buffers[i] for i in live]  # type: ignore[misc]
