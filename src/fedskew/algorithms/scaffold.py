"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh 2020, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML), Algorithm 1 with option II.

Client i receives (x, c), sets y_i ← x and takes K steps ``y_i ← y_i − η_l (g_i(y_i) − c_i + c)``; we write
the correction as the loss term ``⟨c − c_i, y⟩`` whose gradient is ``c − c_i``, so the engine's optimizer
performs exactly that step. Then (option II)

    c_i⁺ = c_i − c + (x − y_i) / (K η_l),      upload Δy_i = y_i − x,  Δc_i = c_i⁺ − c_i,

and the server updates ``x ← x + η_g (1/|S|) Σ Δy_i`` and ``c ← c + (|S|/N) (1/|S|) Σ Δc_i``.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    model_arrays,
    weighted_average,
)

#: payload prefix of control variates (server ``c`` downstream, ``Δc_i`` upstream)
CONTROL_PREFIX = "control."
#: scratch prefix of the per-parameter correction ``c − c_i``
CORRECTION_PREFIX = "correction."


def _controls(payload: Payload) -> dict[str, Tensor]:
    n = len(CONTROL_PREFIX)
    return {k[n:]: v for k, v in payload.arrays.items() if k.startswith(CONTROL_PREFIX)}


@ALGORITHMS.register("scaffold")
class Scaffold(Algorithm):
    """SCAFFOLD (Karimireddy et al. 2020, option II): control variates correct client drift."""

    mean_aggregation = True

    vectorizable = True
    loss_reads = frozenset()  # the loss reads only the correction made in init_scratch

    class Params(HyperParams):
        server_lr: float = Field(
            1.0, gt=0.0, description="global step size η_g (source: Karimireddy et al. 2020 §7, η_g = 1)"
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
        c = _controls(step.payload)
        return {CORRECTION_PREFIX + n: c[n] - ci for n, ci in step.state["c"].items()}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        loss = super().local_loss(step, batch)
        terms = [(step.scratch[CORRECTION_PREFIX + n] * p).sum() for n, p in step.model.named_parameters()]
        return loss + sum(terms[1:], terms[0])

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        x, c = step.payload.model_state(), _controls(step.payload)
        y = dict(step.model.named_parameters())
        c_old = step.state["c"]
        if result.steps > 0:
            denom = result.steps * result.lr  # K η_l with K the local steps actually taken
            c_new = {n: ci - c[n] + (x[n] - y[n].detach()) / denom for n, ci in c_old.items()}
        else:  # no step taken: x − y_i = 0 and K = 0, keep c_i
            c_new = dict(c_old)
        upload = Payload(arrays=model_arrays(step.model.state_dict()))
        # y_i travels as the model state (the same size as Δy_i; the server subtracts x), Δc_i beside it
        upload.arrays.update({CONTROL_PREFIX + n: c_new[n] - c_old[n] for n in c_old})
        return LocalOutput(upload, {**step.state, "c": c_new})

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        x = server["weights"]
        n = len(uploads)
        uniform = torch.full((n,), 1.0 / n)  # the paper averages uniformly over the sampled set S
        mean_y = weighted_average([u.payload.model_state() for u in uploads], uniform)
        mean_dc = weighted_average([_controls(u.payload) for u in uploads], uniform)
        new = dict(mean_y)  # buffers: the plain mean over participants
        controls = {}
        for name, c in server["c"].items():
            new[name] = x[name] + self.p.server_lr * (mean_y[name] - x[name])  # x + η_g mean Δy
            controls[name] = c + (n / self.ctx.num_clients) * mean_dc[name]
        return ServerUpdate({**server, "weights": new, "c": controls})
