"""Vectorized local training (``engine.mode=vectorized``): the round's clients trained at once.

Every sampled client's parameters are stacked (``[K, ...]`` per tensor) and one ``torch.func.vmap`` of
``grad`` of the algorithm's own :meth:`~fedskew.algorithms.base.Algorithm.local_loss` computes all clients'
gradients in one call, followed by a functional SGD step (momentum, weight decay: ``torch.optim.SGD``'s
rule). Each client keeps its own mini-batch order, drawn from the same per-(seed, round, client) generator
as the sequential loop, so ragged client sizes are handled by step masks: at step t only the clients that
still have a batch take part, grouped by batch size (the last batch of an epoch is shorter). Chunks of
clients are sized to ``engine.memory_mb``. Hooks that are not per-batch losses (``start_local``,
``finish_local``: prototypes, control variates, ...) run per client around the vectorized loop, with the
client's own weights loaded into the shared model. What an algorithm keeps across batches lives in the
tensors of its ``init_scratch``, stacked over clients like the parameters and updated in place under
``vmap`` (FedProto's last-epoch prototype sums): batched, not per client.

Where it pays: small models and small batches, where a step is dominated by per-call overhead (FedProto's
21.8k-parameter CNN at batch 8: vmap over 20 clients was 1.44x the loop, measured on the project's 2-core
CPU machine, docs/performance.md); on large convolutions batched convolutions become grouped convolutions
and are slower (0.70x), so ``engine.mode=auto`` does not pick it there.

An algorithm opts in with ``vectorizable = True``: its ``local_loss`` must be a pure function of the model,
the batch, the payload, the client state and the ``init_scratch`` tensors (no per-client modules loaded in
``start_local``, no data-dependent Python branching). Only what the loss reads (``loss_reads``: payload,
state) is stacked, so FedProto's payloads (each client's own classes) may differ in shape. Clients may run
different learning rates (FedEnt's per-client η): the functional SGD step takes one per client.
 Models with BatchNorm running
statistics cannot update them under ``vmap``. :func:`unsupported_reason` says why a run falls back. Dropout
works (``randomness="different"``), but its random stream differs from the sequential loop's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from fedskew.algorithms.base import Algorithm, Batch, LocalResult, Payload, Phase, RoundInfo, Scratch
from fedskew.engine.client import PreparedClient, epoch_batches, finish_client, prepare_client
from fedskew.engine.device import chunk_budget_mb, precision_context
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.types import ClientOutcome, RoundJob, tree_to
from fedskew.seeding import seed_torch


class NotVectorizable(RuntimeError):
    """The round's clients cannot be trained together (the message says why); the caller falls back."""


def unsupported_reason(alg: Algorithm, model: nn.Module) -> str | None:
    """``None`` if ``alg`` and ``model`` can be trained vectorized, else why not."""
    if not getattr(alg, "vectorizable", False):
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


def chunk_size(model: nn.Module, x: Tensor, batch_size: int, memory_mb: float) -> int:
    """Clients per vmap call under ``memory_mb``: per client, parameters, gradients, momentum and a copy
    (4 floats per parameter) plus forward and backward activations of one batch (x3)."""
    params = sum(p.numel() for p in model.parameters())
    per_client = 4 * (4 * params + 3 * batch_size * activation_floats(model, x))
    return max(1, int(memory_mb * 2**20 // max(per_client, 1)))


@dataclass
class _Client:
    """A prepared client and its running totals in the batched loop."""

    prep: PreparedClient
    steps: int = 0
    loss: float = float("nan")
    lr: float = 0.0
    total: float = 0.0
    count: int = 0
    finite: bool = True
    batches: list[Tensor] = field(default_factory=list)

    @property
    def phases(self) -> list[Phase]:
        return self.prep.plan.phases


def _phase_key(phase: Phase, names: list[str]) -> tuple:
    """What must be equal across the clients of a vmap call (the learning rate may differ)."""
    trainable = tuple(n for n in names if phase.trainable is None or phase.trainable(n))
    return (phase.epochs, phase.momentum, trainable)


def _stack_trees(trees: list[Any], what: str) -> tuple[list[Tensor], list[Any], Any, list[int]]:
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
    return stacked, list(leaves0), spec, tensor_pos


def _rebuild(leaves: list[Any], spec: Any, tensor_pos: list[int], tensors: list[Tensor]) -> Any:
    out = list(leaves)
    for i, t in zip(tensor_pos, tensors, strict=True):
        out[i] = t
    return tree_unflatten(out, spec)


def train_vectorized(
    rt: ClientRuntime, job: RoundJob, cids: list[int], memory_mb: float
) -> list[ClientOutcome]:
    """Train ``cids`` (one architecture) of ``job`` in chunks under ``memory_mb``; outcomes in ``cids``
    order."""
    model = rt.models.model_for(cids[0])
    budget = chunk_budget_mb(rt.device, memory_mb)  # a CPU budget, or a share of the GPU's free memory
    size = chunk_size(model, rt.data.x, rt.client.batch_size, budget)
    out: list[ClientOutcome] = []
    for start in range(0, len(cids), size):
        out += _train_chunk(rt, model, job, cids[start : start + size])
    return out


def _train_chunk(rt: ClientRuntime, model: nn.Module, job: RoundJob, cids: list[int]) -> list[ClientOutcome]:
    alg, cfg = rt.algorithm, rt.client
    names = [n for n, _ in model.named_parameters()]
    clients: list[_Client] = []
    starts: list[dict[str, Tensor]] = []
    for cid in cids:
        payload = alg.broadcast(job.server, RoundInfo(job.round, cid, rt.seed))
        state = tree_to(job.states[cid], rt.device)
        clients.append(_Client(prepare_client(rt, model, cid, job.round, payload, state)))
        starts.append({n: p.detach().clone() for n, p in model.named_parameters()})
    keys = {tuple(_phase_key(p, names) for p in c.phases) for c in clients}
    if len(keys) > 1:
        raise NotVectorizable("clients run different local phases")
    reads_payload = "payload" in alg.loss_reads
    if reads_payload and len({tuple(sorted(c.prep.payload.config.items())) for c in clients}) > 1:
        raise NotVectorizable("clients' payload config values differ")
    buffers = {n: b for n, b in model.named_buffers()}
    params = {n: torch.stack([s[n] for s in starts]) for n in names}
    payloads = [c.prep.payload.arrays if reads_payload else {} for c in clients]
    pay_t, pay_leaves, pay_spec, pay_pos = _stack_trees(payloads, "payloads")
    states = [c.prep.plan.state if "state" in alg.loss_reads else {} for c in clients]
    st_t, st_leaves, st_spec, st_pos = _stack_trees(states, "states")
    sc_t, sc_leaves, sc_spec, sc_pos = _stack_trees(
        [dict(c.prep.scratch) for c in clients], "init_scratch tensors"
    )
    scratch_t: dict[str, Tensor] = _rebuild(sc_leaves, sc_spec, sc_pos, sc_t)
    config = dict(clients[0].prep.payload.config) if reads_payload else {}

    def loss_fn(
        train: dict[str, Tensor],
        frozen: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        pay: list[Tensor],
        st: list[Tensor],
        scratch: dict[str, Tensor],
        epoch: int,
        last: bool,
    ) -> tuple[Tensor, Tensor]:
        payload = Payload(arrays=_rebuild(pay_leaves, pay_spec, pay_pos, pay), config=dict(config))
        state = _rebuild(st_leaves, st_spec, st_pos, st)
        batch = Batch(x, y, epoch=epoch, last_epoch=last)
        autocast = precision_context(rt.device, rt.precision)
        with _reparametrize_module(model, {**train, **frozen, **buffers}), autocast:
            loss = alg.local_loss(model, batch, payload, state, Scratch(scratch))  # tensors: updated in place
        return loss, loss.detach()

    step_fn: Callable[..., tuple[dict[str, Tensor], Tensor]] = vmap(
        grad(loss_fn, has_aux=True), in_dims=(0, 0, 0, 0, 0, 0, 0, None, None), randomness="different"
    )
    model.train()
    phases = clients[0].phases
    for p_i, phase in enumerate(phases):
        trainable = list(_phase_key(phase, names)[2])
        momentum = cfg.momentum if phase.momentum is None else phase.momentum
        client_lrs = [c.phases[p_i].lr * c.prep.lr_scale for c in clients]
        lr = torch.tensor(client_lrs, dtype=params[names[0]].dtype, device=params[names[0]].device)
        bufs = {n: torch.zeros_like(params[n]) for n in trainable}
        for epoch in range(phase.epochs):
            last = p_i == len(phases) - 1 and epoch == phase.epochs - 1
            for c in clients:
                view = c.prep.view
                c.batches = epoch_batches(view.num_samples, cfg.batch_size, c.prep.generator, rt.device)
            for c, c_lr in zip(clients, client_lrs, strict=True):
                c.total, c.count, c.lr = 0.0, 0, c_lr
            for t in range(max(len(c.batches) for c in clients)):
                groups: dict[int, list[int]] = {}
                for k, c in enumerate(clients):
                    if t < len(c.batches):
                        groups.setdefault(int(c.batches[t].numel()), []).append(k)
                for members in groups.values():
                    _step(
                        params,
                        bufs,
                        trainable,
                        names,
                        members,
                        clients,
                        t,
                        step_fn,
                        pay_t,
                        st_t,
                        scratch_t,
                        epoch,
                        last,
                        lr,
                        momentum,
                        cfg.weight_decay,
                    )
            for c in clients:
                c.loss = c.total / max(c.count, 1)
                c.finite = c.finite and math.isfinite(c.loss)
    outcomes = []
    for k, c in enumerate(clients):
        prep = c.prep
        if not c.finite:
            outcomes.append(ClientOutcome.received(prep.cid, prep.payload))
            continue
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n][k])
        seed_torch(prep.seed, rt.device)  # the global stream as the client's own, after the batched loop
        prep.scratch = Scratch({n: v[k] for n, v in scratch_t.items()})
        outcomes.append(finish_client(rt, model, prep, LocalResult(steps=c.steps, loss=c.loss, lr=c.lr)))
    return outcomes


def _step(
    params: dict[str, Tensor],
    bufs: dict[str, Tensor],
    trainable: list[str],
    names: list[str],
    members: list[int],
    clients: list[_Client],
    t: int,
    step_fn: Callable[..., tuple[dict[str, Tensor], Tensor]],
    pay_t: list[Tensor],
    st_t: list[Tensor],
    scratch_t: dict[str, Tensor],
    epoch: int,
    last: bool,
    lr: Tensor,
    momentum: float,
    weight_decay: float,
) -> None:
    """One SGD step of the clients ``members`` (same batch size) on their batch ``t``."""
    everyone = len(members) == len(clients)
    sel = None if everyone else torch.tensor(members, device=next(iter(params.values())).device)

    def take(v: Tensor) -> Tensor:
        return v if sel is None else v.index_select(0, sel)

    idx = torch.stack([clients[k].batches[t] for k in members])  # [G, B]
    view_x = [clients[k].prep.view for k in members]
    x = torch.stack([v.x[i] for v, i in zip(view_x, idx, strict=True)])
    y = torch.stack([v.y[i] for v, i in zip(view_x, idx, strict=True)])
    train = {n: take(params[n]) for n in trainable}
    frozen = {n: take(params[n]) for n in names if n not in train}
    scratch = {n: take(v) for n, v in scratch_t.items()}
    grads, losses = step_fn(
        train, frozen, x, y, [take(v) for v in pay_t], [take(v) for v in st_t], scratch, epoch, last
    )
    with torch.no_grad():
        if sel is not None:  # the loss updated copies of the members' scratch: write them back
            for n, v in scratch.items():
                scratch_t[n].index_copy_(0, sel, v)
        for n in trainable:
            g = grads[n] + weight_decay * train[n] if weight_decay else grads[n]
            buf = momentum * take(bufs[n]) + g if momentum else g
            lr_n = take(lr).view(-1, *[1] * (buf.dim() - 1))  # one learning rate per client
            new = train[n] - lr_n * buf
            if sel is None:
                params[n].copy_(new)
                if momentum:
                    bufs[n].copy_(buf)
            else:
                params[n].index_copy_(0, sel, new)
                if momentum:
                    bufs[n].index_copy_(0, sel, buf)
    batch = idx.shape[1]
    for k, loss in zip(members, losses.tolist(), strict=True):
        c = clients[k]
        c.total += loss * batch
        c.count += batch
        c.steps += 1
