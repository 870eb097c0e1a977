"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough, Saligrama 2021, "Federated Learning Based on Dynamic
Regularization", ICLR), Algorithm 1.

Client k, received server model θ^{t−1}, gradient memory ∇L_k(θ_k^{t−1}) (zero at first use):

    θ_k^t = argmin_θ  L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + α/2 ‖θ − θ^{t−1}‖²
    ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α (θ_k^t − θ^{t−1})

Server, with m the total number of clients and P_t the participants:

    h^t = h^{t−1} − α (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1})
    θ^t = (1/|P_t|) Σ_{k∈P_t} θ_k^t − h^t / α
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    MeanInfo,
    Payload,
    ServerUpdate,
    State,
    model_arrays,
    uniform_weights,
)
from fedskew.algorithms.fedprox import proximal_term
from fedskew.search_space import tunable


@ALGORITHMS.register("feddyn")
class FedDyn(Algorithm):
    """FedDyn (Acar et al. 2021): dynamic linear + quadratic regulariser, server state h."""

    loss_reads = frozenset({"payload", "state", "derived"})

    class Params(HyperParams):
        alpha: float = tunable(
            0.01,
            low=1e-3,
            high=0.1,
            log=True,
            gt=0.0,
            description="regularisation α (source: Acar et al. 2021 §5, searched over {0.1, 0.01, 0.001}; "
            "FedEnt §6.1.3 uses 0.001; search: that grid's range, log)",
        )

    p: Params

    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        server["h"] = {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}
        return server

    def init_client(self, cid: int) -> State:
        return {"grad": self.ctx.zero_params(cid)}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        loss = super().local_loss(step, batch)
        grad = step.state["grad"]
        linear = [(grad[n] * p).sum() for n, p in step.model.named_parameters()]
        prox = proximal_term(step.model, step.payload.model_state())
        return loss - sum(linear[1:], linear[0]) + 0.5 * self.p.alpha * prox

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        prev = step.payload.model_state()
        params = dict(step.model.named_parameters())
        grad = {n: g - self.p.alpha * (params[n].detach() - prev[n]) for n, g in step.state["grad"].items()}
        upload = Payload(arrays=model_arrays(step.model.state_dict()))
        return LocalOutput(upload, {**step.state, "grad": grad})

    def mean_weights(self, counts: Sequence[int]) -> Tensor:
        return uniform_weights(counts)  # the mean over the participants P

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        prev, avg = server["weights"], mean.model_state()
        # α (1/m) Σ_k (θ_k − θ) = α (|P|/m) (mean − θ)
        scale = self.p.alpha * info.count / self.ctx.num_clients
        new = dict(avg)  # buffers: the plain mean over participants
        h_new = {}
        for name, h in server["h"].items():
            h_new[name] = h - scale * (avg[name] - prev[name])
            new[name] = avg[name] - h_new[name] / self.p.alpha
        return ServerUpdate({**server, "weights": new, "h": h_new})
