"""FedRep (Collins, Hassani, Mokhtari, Shakkottai 2021, "Exploiting Shared Representations for Personalized
Federated Learning", ICML), Algorithm 1.

Like FedPer the representation (body) is shared and averaged, the head is personal; but local training
alternates: first ``head_epochs`` passes on the head with the received representation frozen, then
``body_epochs`` passes on the representation with the new head frozen. Only the representation is uploaded.
Defaults follow the paper's experiments (10 head epochs, 1 representation epoch, §5 and its code's
``local_ep``/``local_rep_ep``); ``body_epochs`` unset uses ``client.epochs``.
"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import (
    ALGORITHMS,
    HyperParams,
    LocalPlan,
    LocalStep,
    Phase,
)
from fedskew.algorithms.fedper import FedPer
from fedskew.search_space import tunable


@ALGORITHMS.register("fedrep")
class FedRep(FedPer):
    """FedRep (Collins et al. 2021): personal head trained first on a frozen shared body, then the body."""

    class Params(FedPer.Params):
        head_epochs: int = tunable(
            10,
            low=1,
            high=20,
            integer=True,
            ge=0,
            description="local epochs on the head, body frozen (§5: 10; search: fedskew, [1, 20])",
        )
        body_epochs: int | None = Field(
            None, ge=0, description="local epochs on the body, head frozen (§5: 1; None: client.epochs)"
        )

    p: Params

    def start_local(self, step: LocalStep) -> LocalPlan:
        body = self.ctx.client.epochs if self.p.body_epochs is None else self.p.body_epochs
        lr = self.ctx.client.lr
        phases = [
            Phase(epochs=self.p.head_epochs, lr=lr, trainable=self.is_personal),
            Phase(epochs=body, lr=lr, trainable=self.is_shared),
        ]
        return LocalPlan(phases)


__all__ = ["FedRep", "HyperParams"]
