"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh 2020, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML), Algorithm 1 with option II (default) or option I.

Client i receives (x, c), sets y_i ← x and takes K steps ``y_i ← y_i − η_l (g_i(y_i) − c_i + c)``; we write
the correction as the loss term ``⟨c − c_i, y⟩`` whose gradient is ``c − c_i``, so the engine's optimizer
performs exactly that step. Then (option II)

    c_i⁺ = c_i − c + (x − y_i) / (K η_l),      upload Δy_i = y_i − x,  Δc_i = c_i⁺ − c_i,

and the server updates ``x ← x + η_g (1/|S|) Σ Δy_i`` and ``c ← c + (|S|/N) (1/|S|) Σ Δc_i``.

K is FedNova's ‖a‖₁ under the client's momentum ρ by default (``control_steps: effective``; the local
steps taken without momentum, bit for bit the paper's K): option II assumes plain SGD, and under momentum
the paper's K overestimates c_i about 1/(1 − ρ) times, which the momentum then amplifies (at ρ = 0.9
training diverges). ``control_steps: local`` keeps the paper's literal K (docs/methods/personalized.md,
"SCAFFOLD with momentum").

Option I (``control_update: I``, line 12) sets ``c_i⁺ = g_i(x)``: the gradient of the client's loss at the
server model x, from an additional pass over its training data (the mean cross-entropy over all its samples,
in batches of ``client.batch_size``, plus ``weight_decay · x``: the gradient the local SGD steps use, which
option II's estimate includes too). It is computed on copies (``torch.func.functional_call``) in training
mode (BatchNorm batch statistics, as in the local steps; dropout from a seed derived from the round and
client); a client without training data keeps its c_i.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    MeanInfo,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    model_arrays,
    uniform_weights,
)
from fedskew.algorithms.fednova import normalizer
from fedskew.algorithms.helpers import train_mode

#: payload prefix of control variates (server ``c`` downstream, ``Δc_i`` upstream)
CONTROL_PREFIX = "control."
#: scratch prefix of the per-parameter correction ``c − c_i``
CORRECTION_PREFIX = "correction."
_GRADIENT_KEY = 0x5CA1  # the generator stream seeding dropout in option I's gradient pass
#: K of option II's (x − y_i)/(Kη_l) by ``control_steps``, from (local steps taken, client momentum ρ):
#: FedNova's ‖a‖₁ (exactly the steps taken when ρ = 0), or the steps taken whatever ρ (the paper's K)
STEP_COUNTS: dict[str, Callable[[int, float], float]] = {
    "effective": normalizer,
    "local": lambda steps, momentum: float(steps),
}


def full_gradient(
    model: nn.Module, weights: Mapping[str, Tensor], client: ClientView, batch_size: int, seed: int
) -> dict[str, Tensor]:
    """∇ of the mean cross-entropy over the client's training data at ``weights`` (parameters and
    buffers), in batches, in training mode; neither ``model`` nor ``weights`` changes (BatchNorm updates
    copies of the buffers; dropout draws from ``seed`` inside a forked RNG)."""
    params = {n: weights[n].detach().clone().requires_grad_(True) for n, _ in model.named_parameters()}
    buffers = {n: weights[n].detach().clone() for n, _ in model.named_buffers() if n in weights}
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    n = client.num_samples
    devices = [client.x.device] if client.x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), train_mode(model):
        torch.manual_seed(seed)
        for start in range(0, n, batch_size):
            out = functional_call(model, {**params, **buffers}, (client.x[start : start + batch_size],))
            loss = F.cross_entropy(out, client.y[start : start + batch_size], reduction="sum") / n
            parts = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for name, g in zip(params, parts, strict=True):
                if g is not None:
                    grads[name] += g
    return grads


@ALGORITHMS.register("scaffold")
class Scaffold(Algorithm):
    """SCAFFOLD (Karimireddy et al. 2020, option II or I): control variates correct client drift."""

    class Params(HyperParams):
        server_lr: float = Field(
            1.0, gt=0.0, description="global step size η_g (source: Karimireddy et al. 2020 §7, η_g = 1)"
        )
        control_update: Literal["II", "I"] = Field(
            "II",
            description="control-variate update c_i⁺ (source: Karimireddy et al. 2020 Alg. 1 line 12): "
            "'II' c_i − c + (x − y_i)/(Kη_l), the cheaper one; 'I' g_i(x), the client's full-data gradient "
            "at x (one extra pass over its data)",
        )
        control_steps: Literal["effective", "local"] = Field(
            "effective",
            description="K in option II's (x − y_i)/(Kη_l): 'effective' (default) FedNova's ‖a‖₁ = "
            "Σ_k (1 − ρ^(K−k))/(1 − ρ) under the client's momentum ρ, so that c_i estimates the client "
            "gradient and not 1/(1 − ρ) times it (the displacement NIID-Bench's experiments.py reaches by "
            "correcting outside the momentum); 'local' the local steps taken (the paper's plain-SGD K, "
            "which diverges under momentum 0.9); equal without momentum (docs/methods/personalized.md, "
            "'SCAFFOLD with momentum')",
        )

    p: Params

    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        server["c"] = {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}
        return server

    def init_client(self, cid: int) -> State:
        return {"c": self.ctx.zero_params(cid)}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        payload = super().broadcast(server, info)
        if info.cid is not None:  # the server control variate is sent to training clients (counted in bytes)
            payload.arrays.update({CONTROL_PREFIX + n: c for n, c in server["c"].items()})
        return payload

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """The correction ``c − c_i``, fixed during local training (Algorithm 1 line 10)."""
        c = step.payload.prefixed(CONTROL_PREFIX)
        return {CORRECTION_PREFIX + n: c[n] - ci for n, ci in step.state["c"].items()}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        loss = super().local_loss(step, batch)
        terms = [(step.scratch[CORRECTION_PREFIX + n] * p).sum() for n, p in step.model.named_parameters()]
        return loss + sum(terms[1:], terms[0])

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        x, c = step.payload.model_state(), step.payload.prefixed(CONTROL_PREFIX)
        y = dict(step.model.named_parameters())
        c_old = step.state["c"]
        if self.p.control_update == "I":
            c_new = self._gradient_at_server(step) if step.client.num_samples > 0 else dict(c_old)
        elif result.steps > 0:
            # K from the local steps actually taken (heavy-ball momentum moves y by η‖a‖₁ per unit gradient)
            denom = STEP_COUNTS[self.p.control_steps](result.steps, self.ctx.client.momentum) * result.lr
            c_new = {n: ci - c[n] + (x[n] - y[n].detach()) / denom for n, ci in c_old.items()}
        else:  # no step taken: x − y_i = 0 and K = 0, keep c_i
            c_new = dict(c_old)
        upload = Payload(arrays=model_arrays(step.model.state_dict()))
        # y_i travels as the model state (the same size as Δy_i; the server subtracts x), Δc_i beside it
        upload.arrays.update({CONTROL_PREFIX + n: c_new[n] - c_old[n] for n in c_old})
        return LocalOutput(upload, {**step.state, "c": c_new})

    def _gradient_at_server(self, step: LocalStep) -> dict[str, Tensor]:
        """Option I: c_i⁺ = g_i(x) + weight_decay · x (the gradient the engine's SGD steps follow)."""
        x = step.payload.model_state()
        gen = step.info.generator(_GRADIENT_KEY)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        grads = full_gradient(step.model, x, step.client, self.ctx.client.batch_size, seed)
        wd = self.ctx.client.weight_decay
        return {n: g + wd * x[n] for n, g in grads.items()} if wd else grads

    def mean_weights(self, counts: Sequence[int]) -> Tensor:
        return uniform_weights(counts)  # the paper averages uniformly over the sampled set S

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        x = server["weights"]
        mean_y, mean_dc = mean.model_state(), mean.prefixed(CONTROL_PREFIX)
        new = dict(mean_y)  # buffers: the plain mean over participants
        controls = {}
        for name, c in server["c"].items():
            new[name] = x[name] + self.p.server_lr * (mean_y[name] - x[name])  # x + η_g mean Δy
            controls[name] = c + (info.count / self.ctx.num_clients) * mean_dc[name]
        return ServerUpdate({**server, "weights": new, "c": controls})
