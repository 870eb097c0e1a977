"""FedNova (Wang, Liu, Liang, Joshi, Poor 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS).

The paper's generalised update rule (§ "A general analysis framework") writes client i's change after τ_i
local steps at learning rate η as ``x − y_i = η G_i a_i`` (G_i stacks the τ_i stochastic gradients, a_i
weighs them) and its normalised gradient ``d_i = G_i a_i / ‖a_i‖₁``. FedNova (§ "Proposed method: FedNova")
averages the normalised gradients and rescales them by an effective number of steps:

    x ← x − τ_eff Σ_{i∈S} p_i η d_i = x + τ_eff Σ_{i∈S} p_i (y_i − x) / ‖a_i‖₁,
    τ_eff = Σ_{i∈S} p_i ‖a_i‖₁,          p_i = n_i / Σ_{j∈S} n_j,

with ‖a_i‖₁ for the local solvers the paper lists as special cases:

* vanilla SGD: ‖a_i‖₁ = τ_i;
* SGD with momentum ρ (``b ← ρ b + g``, ``y ← y − η b``, the engine's rule): a_i's entries are
  (1 − ρ^{τ_i−k})/(1 − ρ), so ‖a_i‖₁ = [τ_i − ρ (1 − ρ^{τ_i}) / (1 − ρ)] / (1 − ρ);
* proximal SGD (FedProx, gradient g + μ(y − x)): ‖a_i‖₁ = [1 − (1 − ημ)^{τ_i}] / (ημ).

With both momentum and a proximal term (no closed form in the paper) ‖a_i‖₁ is the sum of the exact
weights of the engine's update, from the scalar recursion ``b ← ρ b + 1 − ημ u``, ``u ← u + b`` (u = (x − y)
/ η under unit gradients), which reduces to the two closed forms above. Weight decay is part of the
gradient and leaves a_i alone (as in both public implementations).

The client uploads ``(y_i − x)/‖a_i‖₁`` (its normalised update, ``−η d_i``) and ‖a_i‖₁ as a config value;
the server's new model depends on the uploads only through the sample-weighted mean of the normalised
updates and of ‖a_i‖₁ (``mean_aggregation``). Buffers (BatchNorm statistics) are the plain sample-weighted
mean. Options: ``tau_eff: steps`` (Σ p_i τ_i, the authors' code with a proximal term), ``buffers:
normalized`` (NIID-Bench normalises every floating state entry).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor

from fedskew.algorithms.base import (
    ALGORITHMS,
    MODEL_PREFIX,
    Algorithm,
    Batch,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    MeanInfo,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    param_names,
)
from fedskew.algorithms.fedprox import proximal_term
from fedskew.algorithms.layouts import ArraySpec, UploadLayout, template

#: upload prefix of the normalised update ``(y_i − x) / ‖a_i‖₁`` (no reference is broadcast for it)
NORMALIZED_PREFIX = "normalized."


def normalizer(steps: int, momentum: float = 0.0, eta_mu: float = 0.0) -> float:
    """‖a_i‖₁ after ``steps`` local steps of SGD with ``momentum`` ρ and a proximal term of strength
    ``eta_mu`` = ημ (Wang et al. 2020's special cases; both at once: the exact recursion of the rule)."""
    rho, tau = float(momentum), int(steps)
    if eta_mu == 0.0:
        if rho == 0.0:
            return float(tau)
        return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)
    if rho == 0.0:
        return (1.0 - (1.0 - eta_mu) ** tau) / eta_mu
    b = u = 0.0
    for _ in range(tau):  # unit gradients: b ← ρ b + 1 − ημ u, u ← u + b
        b = rho * b + 1.0 - eta_mu * u
        u = u + b
    return u


@ALGORITHMS.register("fednova")
class FedNova(Algorithm):
    """FedNova (Wang et al. 2020): normalised averaging of local updates, rescaled by τ_eff."""

    reads_client_scalars = True  # τ_eff from each client's ‖a_i‖₁ (Eq. 6): refused under DP
    loss_reads = frozenset({"payload"})  # the proximal anchor (mu > 0)
    partial_work = True  # Wang et al. 2020: τ_i differ across clients; normalised by ‖a_i‖₁ (Eq. 6)

    class Params(HyperParams):
        mu: float = Field(
            0.0,
            ge=0.0,
            description="proximal weight μ of the local solver (FedProx, gradient g + μ(y − x)); 0: plain "
            "local SGD (source: Wang et al. 2020, FedProx as a special case, ‖a_i‖₁ = [1 − (1 − ημ)^τ]/(ημ))",
        )
        tau_eff: Literal["normalizer", "steps"] = Field(
            "normalizer",
            description="τ_eff = Σ p_i ‖a_i‖₁ (source: Wang et al. 2020, FedNova); 'steps': Σ p_i τ_i, what "
            "the authors' code (JYWa/FedNova, FedNova.average) uses when μ > 0",
        )
        buffers: Literal["mean", "normalized"] = Field(
            "mean",
            description="floating buffers (BatchNorm statistics): the sample-weighted mean (the paper has no "
            "buffers); 'normalized': normalised and rescaled like parameters (NIID-Bench, "
            "train_net_fednova / its server update)",
        )

    p: Params

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        loss = super().local_loss(step, batch)
        if self.p.mu == 0.0:
            return loss
        return loss + 0.5 * self.p.mu * proximal_term(step.model, step.payload.model_state())

    def _normalizes(self, name: str, value: Tensor, params: set[str]) -> bool:
        """Whether state entry ``name`` travels normalised (parameters; floating buffers on option)."""
        return name in params or (self.p.buffers == "normalized" and value.is_floating_point())

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        x = step.payload.model_state()
        params = {n for n, _ in step.model.named_parameters()}
        a = normalizer(result.steps, self.ctx.client.momentum, result.lr * self.p.mu)
        arrays: dict[str, Tensor] = {}
        for name, y in step.model.state_dict().items():
            y = y.detach()
            if not self._normalizes(name, y, params):
                arrays[MODEL_PREFIX + name] = y.clone()
            elif a > 0:
                arrays[NORMALIZED_PREFIX + name] = (y - x[name]) / a  # −η d_i
            else:  # no step taken: the client did not move
                arrays[NORMALIZED_PREFIX + name] = (y - x[name]).zero_()
        config = {"a": a, "steps": float(result.steps)} if self.p.tau_eff == "steps" else {"a": a}
        return LocalOutput(Payload(arrays=arrays, config=config), step.state)

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The model entries it was sent, those it normalises under ``normalized.``; ‖a_i‖₁ (and τ_i)."""
        params = set(param_names(template(self.ctx, info.cid)))
        specs = {
            (NORMALIZED_PREFIX if self._normalizes(k, v, params) else MODEL_PREFIX) + k: ArraySpec.like(v)
            for k, v in broadcast.model_state().items()
        }
        return UploadLayout(specs, frozenset({"a", "steps"} if self.p.tau_eff == "steps" else {"a"}))

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        """x + τ_eff Σ p_i (y_i − x)/‖a_i‖₁ with p_i = n_i / n (the mean's weights) and τ_eff from the
        scalars the clients reported; buffers: the mean."""
        x = server["weights"]
        key = "a" if self.p.tau_eff == "normalizer" else "steps"
        reported = zip(info.weights.tolist(), info.uploads, strict=True)
        tau_eff = sum(float(w) * u.payload.config[key] for w, u in reported)
        step = mean.prefixed(NORMALIZED_PREFIX)  # Σ p_i (y_i − x)/‖a_i‖₁
        new = mean.model_state()
        for name, d in step.items():
            new[name] = x[name] + tau_eff * d
        metrics = {"tau_eff": tau_eff}
        return ServerUpdate({**server, "weights": {k: new[k] for k in x}}, metrics)
