"""One client's local training: the single pipeline every execution path runs.

:func:`train_client` goes from a client's payload and state to a :class:`ClientOutcome`: load the weights
the algorithm names, plan (``start_local``), make the scratch tensors (``init_scratch``), run the engine's
optimizer over the algorithm's loss, and finish (``finish_local``). It commits nothing: the caller owns
the round. The sequential executor, the worker processes and a Flower ClientApp call it as is; the
vectorized trainer runs the same hooks around a batched optimizer loop, sharing :func:`prepare_client`,
:func:`finish_client` and the batching rule :func:`epoch_batches`.

Randomness is derived from ``(seed, round, client)``, so results do not depend on the order clients are
run in, nor on the process that runs them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedskew.algorithms.base import (
    Algorithm,
    Batch,
    ClientView,
    ContractError,
    LocalPlan,
    LocalResult,
    Payload,
    RoundInfo,
    Scratch,
    State,
    Upload,
    load_state,
)
from fedskew.engine.device import precision_context
from fedskew.engine.policy import client_raised, finite_upload
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.sgd import SGD
from fedskew.engine.types import ClientOutcome, tree_to
from fedskew.seeding import derive_seed, seed_torch
from fedskew.settings import ClientSection

log = logging.getLogger("fedskew.engine")


class NonFiniteLoss(RuntimeError):
    """Local training produced a NaN/Inf loss: the client's update is rejected."""


def epoch_batches(n: int, batch_size: int, generator: torch.Generator, device: torch.device) -> list[Tensor]:
    """The mini-batches of one epoch: a permutation drawn from the client's generator, cut into batches of
    ``batch_size``; a trailing batch of one sample is dropped (it breaks BatchNorm and adds noise only)."""
    bs = max(1, min(batch_size, n))
    perm = torch.randperm(n, generator=generator).to(device)
    return [perm[s : s + bs] for s in range(0, n, bs) if not (min(bs, n - s) == 1 and n > 1)]


@dataclass
class PreparedClient:
    """A client ready to train: its hooks' inputs and outputs so far, and its batch generator."""

    cid: int
    info: RoundInfo
    payload: Payload
    view: ClientView
    plan: LocalPlan
    scratch: Scratch
    generator: torch.Generator
    seed: int
    lr_scale: float


def prepare_client(
    rt: ClientRuntime, model: nn.Module, cid: int, round_idx: int, payload: Payload, state: State
) -> PreparedClient:
    """Seed the client's streams, load its weights into ``model`` and run ``start_local`` and
    ``init_scratch``. ``state`` is on the training device."""
    alg = rt.algorithm
    info = RoundInfo(round=round_idx, cid=cid, seed=rt.seed)
    seed = derive_seed(rt.seed, round_idx, cid)
    seed_torch(seed, rt.device)  # dropout and any in-loss sampling: order-independent
    view = rt.data.view(cid)
    load_state(model, alg.model_weights(payload, state))
    plan = alg.start_local(model, payload, state, view, info)
    scratch = Scratch(alg.init_scratch(model, payload, plan.state, view, info))
    gen = torch.Generator().manual_seed(seed)
    decay = rt.client.lr_decay ** (round_idx - 1)
    return PreparedClient(cid, info, payload, view, plan, scratch, gen, seed, decay)


def finish_client(
    rt: ClientRuntime, model: nn.Module, client: PreparedClient, result: LocalResult
) -> ClientOutcome:
    """Run ``finish_local`` and turn its output into an outcome; a non-finite upload is rejected."""
    out = ClientOutcome.received(client.cid, client.payload)
    done = rt.algorithm.finish_local(
        model, client.payload, client.plan.state, client.view, client.scratch, result, client.info
    )
    if not finite_upload(done.upload, client.info.round, client.cid):
        return out
    out.upload = Upload(cid=client.cid, num_samples=client.view.num_samples, payload=done.upload)
    out.state = tree_to(done.state, "cpu")
    out.loss = result.loss
    return out


def train_client(
    rt: ClientRuntime, cid: int, round_idx: int, payload: Payload, state: State
) -> ClientOutcome:
    """Local training of client ``cid`` in round ``round_idx`` from ``payload`` and its (CPU) ``state``. A
    client that raises fails the round with a :class:`ClientError` naming it, or under
    ``on_client_error=drop`` is dropped (a rejected outcome, logged): :mod:`fedskew.engine.policy`. A
    ContractError is always raised."""
    try:
        model = rt.models.model_for(cid)
        client = prepare_client(rt, model, cid, round_idx, payload, tree_to(state, rt.device))
        try:
            result = run_phases(model, rt.algorithm, client, rt.client, rt.precision)
        except NonFiniteLoss as err:
            log.warning("round %d: rejected update: %s", round_idx, err)
            return ClientOutcome.received(cid, payload)
        return finish_client(rt, model, client, result)
    except ContractError:  # the algorithm breaks the contract for every client: never a client's fault
        raise
    except Exception as err:  # the policy fails the round (fedskew.engine.policy) or drops the client
        what = f"round {round_idx}: client {cid} raised {type(err).__name__}: {err}"
        client_raised(rt.on_client_error, what)
        return ClientOutcome.received(cid, payload)


def run_phases(
    model: nn.Module,
    algorithm: Algorithm,
    client: PreparedClient,
    cfg: ClientSection,
    precision: str = "fp32",
) -> LocalResult:
    """Every phase's epochs of mini-batch SGD on ``model`` over the client's tensors, each phase's learning
    rate multiplied by the round's ``client.lr_decay`` factor; the loss under ``engine.precision``."""
    view, phases, state = client.view, client.plan.phases, client.plan.state
    model.train()
    named = list(model.named_parameters())
    steps, last_loss, lr = 0, float("nan"), cfg.lr
    try:
        for p_i, phase in enumerate(phases):
            train = [p for name, p in named if phase.trainable is None or phase.trainable(name)]
            for name, p in named:
                p.requires_grad_(phase.trainable is None or phase.trainable(name))
            momentum = cfg.momentum if phase.momentum is None else phase.momentum
            lr = phase.lr * client.lr_scale
            opt = SGD(train, lr=lr, momentum=momentum, weight_decay=cfg.weight_decay)
            for epoch in range(phase.epochs):
                last = p_i == len(phases) - 1 and epoch == phase.epochs - 1
                total, count = torch.zeros((), device=view.x.device), 0
                for idx in epoch_batches(view.num_samples, cfg.batch_size, client.generator, view.x.device):
                    batch = Batch(view.x[idx], view.y[idx], epoch=epoch, last_epoch=last)
                    with precision_context(view.x.device, precision):
                        loss = algorithm.local_loss(model, batch, client.payload, state, client.scratch)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    total += loss.detach() * idx.numel()
                    count += idx.numel()
                    steps += 1
                last_loss = float(total) / max(count, 1)
                if not math.isfinite(last_loss):
                    raise NonFiniteLoss(f"client {view.cid}: non-finite training loss in epoch {epoch}")
    finally:
        for _, p in named:
            p.requires_grad_(True)
    return LocalResult(steps=steps, loss=last_loss, lr=lr)
