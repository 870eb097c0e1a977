"""q-FedAvg (Li, Sanjabi, Beirami, Smith 2020, "Fair Resource Allocation in Federated Learning", ICLR),
Algorithm 2, solving the q-FFL objective ``min_w Σ_k p_k F_k^{q+1}(w) / (q + 1)`` (Eq. 2).

Client k receives w^t, evaluates its training loss ``F_k(w^t)`` (the whole local training set, before any
step), runs E epochs of local SGD at step size η to w̄_k and sends, with the Lipschitz estimate L = 1/η
(§4.2; the authors' code uses ``1/learning_rate``):

    ΔW_k = L (w^t − w̄_k),    Δ_k = F_k^q(w^t) ΔW_k,    h_k = q F_k^{q−1}(w^t) ‖ΔW_k‖² + L F_k^q(w^t).

The server takes ``w^{t+1} = w^t − Σ_{k∈S_t} Δ_k / Σ_{k∈S_t} h_k`` (a ratio of sums, not a mean of uploads:
``mean_aggregation`` is False). ‖·‖² runs over the trainable parameters; buffers (BatchNorm statistics) are
the sample-weighted mean of the clients' buffers. With q = 0 the rule is FedAvg with uniform weights:
h_k = L, so w^{t+1} = (1/|S|) Σ w̄_k.

Deviations and open points (docs/decisions.md): Algorithm 2 samples device k with probability p_k = n_k/n
(the code's ``sampling=2``); fedskew's sampler is uniform without replacement, which matches the q-FFL
objective with uniform p_k (exactly the code's default ``pk``). F_k is evaluated in eval mode (running
BatchNorm statistics, no dropout). A client without training data has no F_k: it uploads Δ_k = 0, h_k = 0
and adds nothing to either sum; when Σ h_k = 0 the parameters stay at w^t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    MODEL_PREFIX,
    Algorithm,
    ClientView,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    param_names,
    sample_weights,
    weighted_average,
)
from fedskew.algorithms.helpers import eval_mode
from fedskew.algorithms.layouts import ArraySpec, UploadLayout, template
from fedskew.search_space import tunable

#: upload prefix of Δ_k (one array per trainable parameter)
DELTA_PREFIX = "delta."
#: ``derived`` key of F_k(w^t), the client's training loss at the received model
LOSS_KEY = "qffl_loss"


@torch.no_grad()
def dataset_loss(model: nn.Module, client: ClientView, batch_size: int) -> Tensor:
    """Mean cross-entropy of ``model`` (eval mode, restored after) over the client's training data, in
    batches; a float64 0-d tensor, 0 for a client without data. Weights and buffers are left alone."""
    total = torch.zeros((), dtype=torch.float64, device=client.y.device)
    n = client.num_samples
    if n == 0:
        return total
    with eval_mode(model):
        for start in range(0, n, batch_size):
            logits = model(client.x[start : start + batch_size])
            total += F.cross_entropy(logits, client.y[start : start + batch_size], reduction="sum").double()
    return total / n


@ALGORITHMS.register("qfedavg")
class QFedAvg(Algorithm):
    """q-FedAvg (Li et al. 2020): clients with larger losses get larger weight, via Δ_k and h_k."""

    mean_aggregation = False  # q-weighted Lipschitz steps

    class Params(HyperParams):
        q: float = tunable(
            1.0,
            low=1e-3,
            high=5.0,
            log=True,
            ge=0.0,
            description="fairness exponent q; 0 gives FedAvg with uniform weights (source: Li et al. 2020 "
            "§5 tune q per dataset: q = 1 on Synthetic and Sent140, 5 on Vehicle, 0.001 on Shakespeare; "
            "search: the range of those values, log)",
        )
        loss_offset: float = Field(
            0.0,
            ge=0.0,
            description="ε added to F_k before the powers (source: paper: none; the authors' code "
            "fair_flearn qffedavg.py uses F_k + 1e-10, which keeps F_k^{q−1} finite for q < 1)",
        )

    p: Params

    def start_local(self, step: LocalStep) -> LocalPlan:
        plan = super().start_local(step)
        loss = dataset_loss(step.model, step.client, self.ctx.client.batch_size)
        return LocalPlan(plan.phases, {**plan.derived, LOSS_KEY: loss})

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        w = step.payload.model_state()
        params = {n: p.detach() for n, p in step.model.named_parameters()}
        state = step.model.state_dict()
        arrays = {MODEL_PREFIX + k: v.detach().clone() for k, v in state.items() if k not in params}
        if step.client.num_samples == 0:  # no F_k: this client adds nothing to Σ Δ_k nor Σ h_k
            arrays.update({DELTA_PREFIX + n: torch.zeros_like(p) for n, p in params.items()})
            return LocalOutput(Payload(arrays=arrays, config={"h": 0.0}), step.state)
        lipschitz = 1.0 / result.lr  # L = 1/η
        loss, q = float(step.derived[LOSS_KEY]) + self.p.loss_offset, self.p.q
        if loss == 0.0 and q < 1.0:  # F_k^{q−1} is undefined at 0 (a float underflow): the code's floor
            loss = 1e-10
        delta_w = {n: lipschitz * (w[n] - y) for n, y in params.items()}  # ΔW_k = L (w^t − w̄_k)
        sq_norm = sum(float(d.double().pow(2).sum()) for d in delta_w.values())
        h = lipschitz * loss**q + (q * loss ** (q - 1) * sq_norm if q != 0 else 0.0)
        arrays.update({DELTA_PREFIX + n: loss**q * d for n, d in delta_w.items()})  # Δ_k = F_k^q ΔW_k
        return LocalOutput(Payload(arrays=arrays, config={"h": h}), step.state)

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The buffers as trained, the parameters as Δ_k (``delta.``), and h_k."""
        params = set(param_names(template(self.ctx, info.cid)))
        specs = {
            (DELTA_PREFIX if k in params else MODEL_PREFIX) + k: ArraySpec.like(v)
            for k, v in broadcast.model_state().items()
        }
        return UploadLayout(specs, frozenset({"h"}))

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        w = server["weights"]
        h_sum = sum(u.payload.config["h"] for u in uploads)
        new = weighted_average([u.payload.model_state() for u in uploads], sample_weights(uploads))
        ones = torch.ones(len(uploads))
        total = weighted_average([u.payload.prefixed(DELTA_PREFIX) for u in uploads], ones)  # Σ_k Δ_k
        for name, d in total.items():
            new[name] = w[name] - d / h_sum if h_sum > 0 else w[name]  # w − Σ Δ_k / Σ h_k
        return ServerUpdate({**server, "weights": {k: new[k] for k in w}}, {"qffl_h_sum": h_sum})
