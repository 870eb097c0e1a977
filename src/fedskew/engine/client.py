"""One client's local training: the single pipeline every execution path runs.

:func:`train_client` goes from a client's payload and state to a :class:`ClientOutcome`: load the weights
the algorithm names, plan (``start_local``), load the plan's ``start_weights`` if it has any, make the
scratch tensors (``init_scratch``), run the engine's optimizer (``client.optimizer``) over the algorithm's
loss, and finish (``finish_local``). It commits nothing: the caller owns the round. The sequential
executor, the worker processes and a Flower ClientApp call it as is; the vectorized trainer runs the same
hooks around a batched optimizer loop, sharing :func:`prepare_client` (so it stacks the parameters a
client starts from, its ``start_weights`` included, and trains at its round's learning-rate factor),
:func:`finish_client`, the schedule (:mod:`fedskew.engine.schedule`) and the update rule
(:mod:`fedskew.engine.optimizers`).

Randomness is derived from ``(seed, round, client)``, so results do not depend on the order clients are
run in, nor on the process that runs them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedskew.algorithms.base import (
    Algorithm,
    Batch,
    ClientView,
    ContractError,
    LocalResult,
    LocalStep,
    Payload,
    Phase,
    RoundInfo,
    Scratch,
    State,
    Upload,
    load_state,
)
from fedskew.algorithms.batching import epoch_batches
from fedskew.engine.device import precision_context
from fedskew.engine.optimizers import LocalOptimizer, local_optimizer
from fedskew.engine.policy import client_raised, finite_upload
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.schedule import EpochLoss, NonFiniteLoss, local_schedule
from fedskew.engine.types import ClientOutcome, tree_to
from fedskew.seeding import derive_seed, seed_torch
from fedskew.settings import ClientSection

__all__ = ["NonFiniteLoss", "epoch_batches", "train_client"]

log = logging.getLogger("fedskew.engine")


@dataclass
class PreparedClient:
    """A client ready to train: the hooks' step so far, its phases and its batch generator."""

    step: LocalStep
    phases: list[Phase]
    generator: torch.Generator
    seed: int
    lr_scale: float
    num_samples: int  # the client's training samples, the count its upload reports (plan.train_indices aside)

    @property
    def cid(self) -> int:
        return self.step.client.cid

    @property
    def info(self) -> RoundInfo:
        return self.step.info

    @property
    def payload(self) -> Payload:
        return self.step.payload


def prepare_client(
    rt: ClientRuntime, model: nn.Module, cid: int, round_idx: int, payload: Payload, state: State
) -> PreparedClient:
    """Seed the client's streams, load its weights into ``model``, run ``start_local``, load the plan's
    ``start_weights`` (if any), keep the plan's ``train_indices`` of the client's samples (if any) and run
    ``init_scratch``. ``state`` is on the training device."""
    alg = rt.algorithm
    info = RoundInfo(round=round_idx, cid=cid, seed=rt.seed)
    seed = derive_seed(rt.seed, round_idx, cid)
    seed_torch(seed, rt.device)  # dropout and any in-loss sampling: order-independent
    load_state(model, alg.model_weights(payload, state))
    step = LocalStep(model=model, payload=payload, state=state, client=rt.data.view(cid), info=info)
    plan = alg.start_local(step)
    if plan.start_weights is not None:  # a data-dependent start (FedALA, FedFomo): the same model object
        load_start_weights(model, plan.start_weights, alg.name)
    n = step.client.num_samples
    if plan.train_indices is not None:  # samples held out of training (FedFomo's validation split)
        step = step.replace(client=training_subset(step.client, plan.train_indices, alg.name))
    step = step.replace(derived=plan.derived)
    step = step.replace(scratch=Scratch(alg.init_scratch(step)))
    gen = torch.Generator().manual_seed(seed)
    scale = rt.client.round_lr_scale(round_idx, rt.rounds)  # lr_decay x the lr_schedule's shape
    return PreparedClient(step, plan.phases, gen, seed, scale, n)


def training_subset(client: ClientView, idx: Tensor, algorithm: str) -> ClientView:
    """The samples ``idx`` of ``client`` that a plan trains on; indices that are not distinct 1-d integers
    within the client's samples break the contract. Indexed as int64: torch reads a uint8 index tensor as a
    mask, which would pick other samples than the ones named."""
    n = client.num_samples
    ok = isinstance(idx, Tensor) and idx.dim() == 1 and not idx.is_floating_point() and not idx.is_complex()
    if not ok or idx.dtype == torch.bool or (idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n)):
        raise ContractError(f"{algorithm}.start_local returned train_indices that are not sample indices")
    if torch.unique(idx).numel() != idx.numel():
        raise ContractError(f"{algorithm}.start_local returned repeated train_indices")
    return client.subset(idx.to(client.y.device, torch.long))


def load_start_weights(model: nn.Module, weights: Mapping[str, Tensor], algorithm: str) -> None:
    """Copy a plan's ``start_weights`` into ``model`` (the engine keeps no reference to them); a key the
    model's state does not have breaks the contract."""
    unknown = sorted(set(weights) - set(model.state_dict()))
    if unknown:
        raise ContractError(f"{algorithm}.start_local returned start_weights the model lacks: {unknown[:3]}")
    load_state(model, weights)


def finish_client(
    rt: ClientRuntime, model: nn.Module, client: PreparedClient, result: LocalResult, check: bool = True
) -> ClientOutcome:
    """Run ``finish_local`` (``model`` holds the trained weights) and turn its output into an outcome; a
    non-finite upload is rejected (``check=False``: a folded round checks its mean instead)."""
    out = ClientOutcome.received(client.cid, client.payload)
    done = rt.algorithm.finish_local(client.step.replace(model=model), result)
    if check and not finite_upload(done.upload, client.info.round, client.cid):
        return out
    discloses = rt.algorithm.discloses_client_statistics  # local DP: no sample count, no loss leave
    n = client.num_samples if discloses else 1
    out.accept(Upload(cid=client.cid, num_samples=n, payload=done.upload))
    out.state = tree_to(done.state, "cpu")
    out.loss = result.loss if discloses else math.nan
    out.steps, out.passes = result.steps, result.samples
    return out


def train_client(
    rt: ClientRuntime,
    cid: int,
    round_idx: int,
    payload: Payload,
    state: State,
    check: bool = True,
    max_steps: int | None = None,
) -> ClientOutcome:
    """Local training of client ``cid`` in round ``round_idx`` from ``payload`` and its (CPU) ``state``. A
    client that raises fails the round with a :class:`ClientError` naming it, or under
    ``on_client_error=drop`` is dropped (a rejected outcome, logged): :mod:`fedskew.engine.policy`. A
    ContractError is always raised. ``check=False``: the upload's finiteness is left to the folded mean.
    ``max_steps``: stop local training after that many steps (the virtual clock's partial work)."""
    try:
        model = rt.models.model_for(cid)
        client = prepare_client(rt, model, cid, round_idx, payload, tree_to(state, rt.device))
        try:
            result = run_phases(model, rt.algorithm, client, rt.client, rt.precision, max_steps)
        except NonFiniteLoss as err:
            log.warning("round %d: rejected update: %s", round_idx, err)
            return ClientOutcome.received(cid, payload)
        return finish_client(rt, model, client, result, check)
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
    max_steps: int | None = None,
) -> LocalResult:
    """The client's schedule (:func:`~fedskew.engine.schedule.local_schedule`) of mini-batch steps of
    ``client.optimizer`` (:mod:`fedskew.engine.optimizers`) on ``model`` over the client's tensors; the loss
    under ``engine.precision``. Raises :class:`NonFiniteLoss` after an epoch whose loss is NaN/Inf.
    ``max_steps``: the schedule is cut after that many steps (partial work: FedProx's inexact solution,
    FedNova's heterogeneous tau_i); the loss reported is the cut epoch's."""
    step, view = client.step.replace(model=model), client.step.client
    model.train()
    named = list(model.named_parameters())
    schedule = local_schedule(client.phases, cfg, client.lr_scale, [n for n, _ in named])
    steps, samples, last_loss = 0, 0, float("nan")
    opt: LocalOptimizer | None = None
    try:
        for spec in schedule:
            if opt is None or spec.epoch == 0:  # a new phase: its parameters, a fresh optimizer state
                chosen = set(spec.trainable)
                for name, p in named:
                    p.requires_grad_(name in chosen)
                opt = local_optimizer(cfg, [p for n, p in named if n in chosen], spec.lr, spec.momentum)
            totals = EpochLoss(1, view.x.device)
            for idx in epoch_batches(view.num_samples, cfg.batch_size, client.generator, view.x.device):
                batch = Batch(view.x[idx], view.y[idx], epoch=spec.epoch, last_epoch=spec.last)
                with precision_context(view.x.device, precision):
                    loss = algorithm.local_loss(step, batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
                totals.add(loss, idx.numel())
                steps, samples = steps + 1, samples + idx.numel()
                if steps == max_steps:
                    break
            last_loss = totals.means()[0]
            if not totals.finite()[0]:
                raise NonFiniteLoss(f"client {view.cid}: non-finite training loss in epoch {spec.epoch}")
            if steps == max_steps:
                break
    finally:
        for _, p in named:
            p.requires_grad_(True)
    lr = client.phases[-1].lr * client.lr_scale if client.phases else cfg.lr  # the last phase's
    return LocalResult(steps=steps, loss=last_loss, lr=lr, samples=samples)
