"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith 2020, "Federated Optimization in Heterogeneous
Networks", MLSys).

Each client approximately minimises ``h_k(w; w^t) = F_k(w) + μ/2 ‖w − w^t‖²`` (Eq. 2) starting from the
received global model ``w^t``; aggregation is FedAvg's. The proximal gradient is ``μ (w − w^t)``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    HyperParams,
    LocalStep,
)
from fedskew.search_space import tunable


def proximal_term(model: nn.Module, anchor: Mapping[str, Tensor]) -> Tensor:
    """``Σ_params ‖w − anchor‖²`` over the model's trainable parameters (buffers excluded)."""
    terms = [(p - anchor[n]).pow(2).sum() for n, p in model.named_parameters()]
    return sum(terms[1:], terms[0])


@ALGORITHMS.register("fedprox")
class FedProx(Algorithm):
    """FedProx (Li et al. 2020): FedAvg plus a proximal term μ/2‖w − w_global‖² in the local loss."""

    loss_reads = frozenset({"payload", "state", "derived"})
    partial_work = True  # Li et al. 2020 §3: variable local work per device, γ-inexact solutions (Def. 2)

    class Params(HyperParams):
        mu: float = tunable(
            0.01,
            low=1e-3,
            high=1.0,
            log=True,
            ge=0.0,
            description="proximal weight μ (source: Li et al. 2020 Eq. 2, tuned over {0.001, 0.01, 0.1, 1}; "
            "0.01 as in FedEnt §6.1.3; MP-FedCL and FedSKC give no μ and use it too; search: that grid's "
            "range, log)",
        )

    p: Params

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        loss = super().local_loss(step, batch)
        if self.p.mu == 0.0:
            return loss
        # the anchor w^t is the received model: a dict of views, no copy (vmap stacks the payload)
        return loss + 0.5 * self.p.mu * proximal_term(step.model, step.payload.model_state())
