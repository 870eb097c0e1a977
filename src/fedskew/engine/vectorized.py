"""Vectorized local training (``engine.mode=vectorized``): the round's clients trained at once.

Every sampled client's parameters are stacked (``[K, ...]`` per tensor) and one ``torch.func.vmap`` of
``grad`` of the algorithm's own :meth:`~fedskew.algorithms.base.Algorithm.local_loss` (through the public
``torch.func.functional_call``) computes all clients' gradients in one call, followed by the engine's
update rule (``client.optimizer``, :mod:`fedskew.engine.optimizers`) on the stacked parameters. The
schedule (epochs, learning rates, momentum, last-epoch flag), the batching, the loss totals and the
non-finite rule are the sequential loop's (:mod:`fedskew.engine.schedule`). Each client keeps its own
mini-batch order, drawn from the same per-(seed, round, client) generator as the sequential loop, so
ragged client sizes are handled by step masks: at step t only the clients that still have a batch take
part, grouped by batch size (the last batch of an epoch is shorter). Chunks of clients are sized to
``engine.memory_mb``. Hooks that are not per-batch losses (``start_local``, ``finish_local``: prototypes,
control variates, ...) run per client around the vectorized loop, with the client's own weights loaded
into the shared model. What an algorithm keeps across batches lives in the tensors of its
``init_scratch``, stacked over clients like the parameters and updated in place under ``vmap`` (FedProto's
last-epoch prototype sums): batched, not per client.

Where it pays: small models and small batches, where a step is dominated by per-call overhead (FedProto's
21.8k-parameter CNN at batch 8: vmap over 20 clients was 1.44x the loop, measured on the project's 2-core
CPU machine, docs/performance.md); on large convolutions batched convolutions become grouped convolutions
and are slower (0.70x), so ``engine.mode=auto`` does not pick it there.

An algorithm opts in with ``vectorizable = True``: its ``local_loss`` must be a pure function of the model,
the batch, the payload, the client state, the derived values and the ``init_scratch`` tensors (no
per-client modules loaded in ``start_local``, no data-dependent Python branching). Only what the loss
reads (``loss_reads``) is stacked, so FedProto's payloads (each client's own classes) may differ in shape.
Clients may run different learning rates (FedEnt's per-client η): the step takes one per client. Under
vmap the loss sees the round (``step.info.round``) but not the client (``step.client``, ``step.info.cid``).
Models with BatchNorm running statistics cannot update them under ``vmap``. :func:`unsupported_reason` says
why a run falls back. Dropout works (``randomness="different"``), but its random stream differs from the
sequential loop's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from fedskew.algorithms.base import (
    Algorithm,
    Batch,
    ContractError,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    Scratch,
)
from fedskew.algorithms.batching import epoch_batches
from fedskew.engine.client import PreparedClient, finish_client, prepare_client
from fedskew.engine.device import chunk_budget_mb, precision_context
from fedskew.engine.optimizers import OPTIMIZERS, StackedOptimizer, stacked_optimizer
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.schedule import EpochLoss, EpochSpec, local_schedule
from fedskew.engine.types import ClientOutcome, RoundJob, tree_to
from fedskew.seeding import seed_torch


class NotVectorizable(RuntimeError):
    """The round's clients cannot be trained together (the message says why); the caller falls back."""


def unsupported_reason(alg: Algorithm, model: nn.Module) -> str | None:
    """``None`` if ``alg`` and ``model`` can be trained vectorized, else why not."""
    if not alg.vectorizable:
        return f"{alg.name}'s local loss keeps per-client modules or state outside the batch"
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            return "BatchNorm running statistics cannot be updated under vmap"
    return None


def activation_floats(model: nn.Module, x: Tensor) -> int:
    """Floats of every module output for one sample (forward hooks): the activation memory estimate."""
    total = 0

    def hook(_m: nn.Module, _inp: Any, out: Any) -> None:
        nonlocal total
        if isinstance(out, Tensor):
            total += out.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(x[:1])
    finally:
        for h in handles:
            h.remove()
    return total


def chunk_size(model: nn.Module, x: Tensor, batch_size: int, memory_mb: float, state_slots: int = 1) -> int:
    """Clients per vmap call under ``memory_mb``: per client, parameters, gradients, a copy and the
    optimizer's ``state_slots`` (SGD: momentum, 1; AdamW: 2) floats per parameter, plus forward and backward
    activations of one batch (x3)."""
    params = sum(p.numel() for p in model.parameters())
    per_client = 4 * ((3 + state_slots) * params + 3 * batch_size * activation_floats(model, x))
    return max(1, int(memory_mb * 2**20 // max(per_client, 1)))


class _NoClient:
    """What ``step.client`` is under vmap: the loss sees a batch, not a client."""

    def __getattr__(self, name: str) -> Any:
        raise ContractError(
            f"local_loss read step.client.{name} under engine.mode=vectorized: a vectorizable loss reads "
            "the batch, the payload, the state, derived values and scratch only"
        )


class _LossModule(nn.Module):
    """The model wrapped with the algorithm's loss, so ``functional_call`` substitutes the stacked
    parameters for every call the loss makes into the model (``features``, heads, ...)."""

    def __init__(self, model: nn.Module, algorithm: Algorithm) -> None:
        super().__init__()
        self.model = model
        self.algorithm = algorithm

    def forward(self, step: LocalStep, batch: Batch) -> Tensor:
        return self.algorithm.local_loss(step.replace(model=self.model), batch)


@dataclass
class _Stacked:
    """A pytree per client, stacked: ``tensors`` ([K, ...] leaves) and what rebuilds one client's tree."""

    tensors: list[Tensor]
    leaves: list[Any]
    spec: Any
    tensor_pos: list[int]

    @classmethod
    def of(cls, trees: list[Any], what: str) -> _Stacked:
        """Stack the tensor leaves of identically shaped pytrees; other leaves must be equal."""
        flat = [tree_flatten(t) for t in trees]
        spec = flat[0][1]
        if any(f[1] != spec for f in flat[1:]):
            raise NotVectorizable(f"clients' {what} differ in structure")
        leaves0 = flat[0][0]
        tensor_pos = [i for i, v in enumerate(leaves0) if isinstance(v, Tensor)]
        for i, v in enumerate(leaves0):
            if i in tensor_pos:
                if any(not isinstance(f[0][i], Tensor) or f[0][i].shape != v.shape for f in flat):
                    raise NotVectorizable(f"clients' {what} tensors differ in shape")
            elif any(f[0][i] != v for f in flat):
                raise NotVectorizable(f"clients' {what} differ in a non-tensor value")
        stacked = [torch.stack([f[0][i] for f in flat]) for i in tensor_pos]
        return cls(stacked, list(leaves0), spec, tensor_pos)

    def rebuild(self, tensors: list[Tensor]) -> Any:
        out = list(self.leaves)
        for i, t in zip(self.tensor_pos, tensors, strict=True):
            out[i] = t
        return tree_unflatten(out, self.spec)


def train_vectorized(
    rt: ClientRuntime, job: RoundJob, cids: list[int], memory_mb: float
) -> list[ClientOutcome]:
    """Train ``cids`` (one architecture) of ``job`` in chunks under ``memory_mb``; outcomes in ``cids``
    order."""
    model = rt.models.model_for(cids[0])
    budget = chunk_budget_mb(rt.device, memory_mb)  # a CPU budget, or a share of the GPU's free memory
    slots = OPTIMIZERS[rt.client.optimizer].state_slots
    size = chunk_size(model, rt.data.x[:1], rt.client.batch_size, budget, slots)
    out: list[ClientOutcome] = []
    for start in range(0, len(cids), size):
        out += _Chunk(rt, model, job, cids[start : start + size]).train()
    return out


@dataclass
class _Client:
    """A prepared client, its schedule and its batches of the current epoch."""

    prep: PreparedClient
    schedule: list[EpochSpec]
    steps: int = 0
    samples: int = 0
    loss: float = float("nan")
    finite: bool = True
    batches: list[Tensor] = field(default_factory=list)


class _Chunk:
    """One vmap group: clients of one architecture with the same schedule structure."""

    def __init__(self, rt: ClientRuntime, model: nn.Module, job: RoundJob, cids: list[int]) -> None:
        self.rt, self.model, self.job, alg = rt, model, job, rt.algorithm
        self.names = [n for n, _ in model.named_parameters()]
        self.clients: list[_Client] = []
        starts: list[dict[str, Tensor]] = []
        for cid in cids:
            payload = alg.broadcast(job.server, RoundInfo(job.round, cid, rt.seed))
            prep = prepare_client(rt, model, cid, job.round, payload, tree_to(job.states[cid], rt.device))
            schedule = local_schedule(prep.phases, rt.client, prep.lr_scale, self.names)
            self.clients.append(_Client(prep, schedule))
            starts.append({n: p.detach().clone() for n, p in model.named_parameters()})
        structures = {tuple(spec.structure for spec in c.schedule) for c in self.clients}
        if len(structures) > 1:
            raise NotVectorizable("clients run different local phases")
        reads = alg.loss_reads
        configs = {tuple(sorted(c.prep.payload.config.items())) for c in self.clients}
        if "payload" in reads and len(configs) > 1:
            raise NotVectorizable("clients' payload config values differ")
        self.config = dict(self.clients[0].prep.payload.config) if "payload" in reads else {}
        self.params = {n: torch.stack([s[n] for s in starts]) for n in self.names}
        steps = [c.prep.step for c in self.clients]
        arrays = [s.payload.arrays if "payload" in reads else {} for s in steps]
        self.payloads = _Stacked.of(arrays, "payloads")
        self.states = _Stacked.of([s.state if "state" in reads else {} for s in steps], "states")
        self.derived = _Stacked.of([dict(s.derived) if "derived" in reads else {} for s in steps], "derived")
        scratch = _Stacked.of([dict(s.scratch) for s in steps], "init_scratch tensors")
        self.scratch: dict[str, Tensor] = scratch.rebuild(scratch.tensors)
        self.info = RoundInfo(job.round, None, rt.seed)
        wrapper = _LossModule(model, alg)
        self.step_fn: Callable[..., tuple[dict[str, Tensor], Tensor]] = vmap(
            grad(self._loss_fn(wrapper), has_aux=True),
            in_dims=(0, 0, 0, 0, 0, 0, 0, 0, None, None),
            randomness="different",
        )

    def _loss_fn(self, wrapper: _LossModule) -> Callable[..., tuple[Tensor, Tensor]]:
        # The closure holds what it reads, never ``self``: a chunk holding its own step function through
        # ``self`` would be a reference cycle, and every round's stacked parameters would wait for Python's
        # cyclic collector (measured: +330 MB of RSS a round on W3, and slower rounds as it grew).
        rt, payloads, states, derived, info = self.rt, self.payloads, self.states, self.derived, self.info
        config = self.config

        def loss_fn(
            train: dict[str, Tensor],
            frozen: dict[str, Tensor],
            x: Tensor,
            y: Tensor,
            pay: list[Tensor],
            st: list[Tensor],
            der: list[Tensor],
            scratch: dict[str, Tensor],
            epoch: int,
            last: bool,
        ) -> tuple[Tensor, Tensor]:
            step = LocalStep(
                model=wrapper.model,
                payload=Payload(arrays=payloads.rebuild(pay), config=dict(config)),
                state=states.rebuild(st),
                client=_NO_CLIENT,  # type: ignore[arg-type]
                info=info,
                derived=derived.rebuild(der),
                scratch=Scratch(scratch),  # tensors: updated in place
            )
            weights = {"model." + n: v for n, v in {**train, **frozen}.items()}
            with precision_context(rt.device, rt.precision):
                loss = functional_call(wrapper, weights, (step, Batch(x, y, epoch=epoch, last_epoch=last)))
            return loss, loss.detach()

        return loss_fn

    def train(self) -> list[ClientOutcome]:
        """Every epoch of the common schedule, each client on its own batches; then ``finish_local``."""
        self.model.train()
        opt: StackedOptimizer | None = None
        for e, spec in enumerate(self.clients[0].schedule):
            if opt is None or spec.epoch == 0:  # a new phase: a fresh optimizer state
                opt = stacked_optimizer(self.rt.client, self.params, spec.trainable, spec.momentum)
            lrs = [c.schedule[e].lr for c in self.clients]
            lr: float | Tensor = lrs[0] if len(set(lrs)) == 1 else torch.tensor(lrs, device=self.rt.device)
            self._epoch(spec, lr, opt)
        return [self._finish(k, c) for k, c in enumerate(self.clients)]

    def _epoch(self, spec: EpochSpec, lr: float | Tensor, opt: StackedOptimizer) -> None:
        cfg = self.rt.client
        for c in self.clients:
            view = c.prep.step.client
            c.batches = epoch_batches(view.num_samples, cfg.batch_size, c.prep.generator, self.rt.device)
        totals = EpochLoss(len(self.clients), self.rt.device)
        for t in range(max(len(c.batches) for c in self.clients)):
            groups: dict[int, list[int]] = {}
            for k, c in enumerate(self.clients):
                if t < len(c.batches):
                    groups.setdefault(int(c.batches[t].numel()), []).append(k)
            for members in groups.values():
                self._step(spec, members, t, lr, opt, totals)
        for c, mean, ok in zip(self.clients, totals.means(), totals.finite(), strict=True):
            c.loss, c.finite = mean, c.finite and ok

    def _step(
        self,
        spec: EpochSpec,
        members: list[int],
        t: int,
        lr: float | Tensor,
        opt: StackedOptimizer,
        totals: EpochLoss,
    ) -> None:
        """One optimizer step of the clients ``members`` (same batch size) on their batch ``t``."""
        everyone = len(members) == len(self.clients)
        sel = None if everyone else torch.tensor(members, device=self.rt.device)

        def take(v: Tensor) -> Tensor:
            return v if sel is None else v.index_select(0, sel)

        idx = torch.stack([self.clients[k].batches[t] for k in members])  # [G, B]
        views = [self.clients[k].prep.step.client for k in members]
        x = torch.stack([v.x[i] for v, i in zip(views, idx, strict=True)])
        y = torch.stack([v.y[i] for v, i in zip(views, idx, strict=True)])
        trainable = list(spec.trainable)
        train = {n: take(self.params[n]) for n in trainable}
        frozen = {n: take(self.params[n]) for n in self.names if n not in train}
        scratch = {n: take(v) for n, v in self.scratch.items()}
        stacks = [[take(v) for v in s.tensors] for s in (self.payloads, self.states, self.derived)]
        grads, losses = self.step_fn(train, frozen, x, y, *stacks, scratch, spec.epoch, spec.last)
        params = [train[n] for n in trainable]
        with torch.no_grad():
            rates = lr if not isinstance(lr, Tensor) else take(lr)
            opt.step(params, [grads[n] for n in trainable], rates, sel)
            if sel is not None:  # otherwise ``train`` holds the stacked tensors themselves
                for n, p in zip(trainable, params, strict=True):
                    self.params[n].index_copy_(0, sel, p)
                for n, v in scratch.items():  # the loss updated copies of the members' scratch
                    self.scratch[n].index_copy_(0, sel, v)
        totals.add(losses, idx.shape[1], members)
        for k in members:
            self.clients[k].steps += 1
            self.clients[k].samples += idx.shape[1]

    def _finish(self, k: int, c: _Client) -> ClientOutcome:
        prep = c.prep
        if not c.finite:
            return ClientOutcome.received(prep.cid, prep.payload)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.params[n][k])
        seed_torch(prep.seed, self.rt.device)  # the global stream as the client's own, after the batched loop
        prep.step = prep.step.replace(scratch=Scratch({n: v[k] for n, v in self.scratch.items()}))
        lr = prep.phases[-1].lr * prep.lr_scale if prep.phases else self.rt.client.lr
        result = LocalResult(steps=c.steps, loss=c.loss, lr=lr, samples=c.samples)
        return finish_client(self.rt, self.model, prep, result, check=not self.job.folded)


_NO_CLIENT = _NoClient()

