"""The local optimizer loop: the engine trains, the algorithm supplies the loss.

Data lives in tensors on the training device; a client is an index view. Mini-batches are drawn from a
per-(seed, round, client) generator, so results do not depend on the order clients are run in.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedskew.algorithms.base import (
    Algorithm,
    Batch,
    ClientConfig,
    ClientView,
    LocalResult,
    Payload,
    Phase,
    State,
)


class NonFiniteLoss(RuntimeError):
    """Local training produced a NaN/Inf loss: the client's update is rejected."""


def run_phases(
    model: nn.Module,
    algorithm: Algorithm,
    payload: Payload,
    state: State,
    client: ClientView,
    phases: list[Phase],
    cfg: ClientConfig,
    generator: torch.Generator,
    scratch: dict,
    lr_scale: float = 1.0,
) -> LocalResult:
    """Run every phase's epochs of mini-batch SGD on ``model`` over the client's tensors, each phase's
    learning rate multiplied by ``lr_scale`` (the round's ``client.lr_decay`` factor)."""
    n = client.num_samples
    bs = max(1, min(cfg.batch_size, n))
    model.train()
    named = list(model.named_parameters())
    steps, last_loss, lr = 0, float("nan"), cfg.lr
    try:
        for p_i, phase in enumerate(phases):
            train = [p for name, p in named if phase.trainable is None or phase.trainable(name)]
            for name, p in named:
                p.requires_grad_(phase.trainable is None or phase.trainable(name))
            momentum = cfg.momentum if phase.momentum is None else phase.momentum
            lr = phase.lr * lr_scale
            opt = torch.optim.SGD(train, lr=lr, momentum=momentum, weight_decay=cfg.weight_decay)
            for epoch in range(phase.epochs):
                last = p_i == len(phases) - 1 and epoch == phase.epochs - 1
                perm = torch.randperm(n, generator=generator).to(client.x.device)
                total, count = torch.zeros((), device=client.x.device), 0
                for start in range(0, n, bs):
                    idx = perm[start : start + bs]
                    if idx.numel() == 1 and n > 1:
                        continue  # a trailing batch of one breaks BatchNorm and adds noise only
                    batch = Batch(client.x[idx], client.y[idx], epoch=epoch, last_epoch=last)
                    loss = algorithm.local_loss(model, batch, payload, state, scratch)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    total += loss.detach() * idx.numel()
                    count += idx.numel()
                    steps += 1
                last_loss = float(total) / max(count, 1)
                if not math.isfinite(last_loss):
                    raise NonFiniteLoss(f"client {client.cid}: non-finite training loss in epoch {epoch}")
    finally:
        for _, p in named:
            p.requires_grad_(True)
    return LocalResult(steps=steps, loss=last_loss, lr=lr)
