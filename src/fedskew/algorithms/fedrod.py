"""FedRoD (Chen, Chao 2022, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR), §4 (the two-loss, two-predictor framework) with the linear personalized head.

One body f and two heads on its features z = f(x): the generic head g, trained with the body on a balanced
risk and averaged by the server with it (FedAvg), and a personalized head p that never leaves the client.
The client's loss on a batch is::

    ℓ = BSM(g(z), y) + CE(g(z).detach() + p(z.detach()), y),
    BSM(s, y) = CE(s + γ · log N_{i,·}, y)      (balanced softmax, Ren et al. 2020; N_{i,c}: class counts)

so the body and g learn only from the balanced risk and p only from the personal cross-entropy on top of
the (fixed) generic logits — the two optimizers of PFLlib's ``clientrod.py`` in one SGD step (same learning
rate, per-parameter updates). Prediction: generic g(z) for the global protocol, g(z) + p(z) for the
personalized one (``"generic"`` is reported beside it).

Choices (docs/decisions.md, "FedRoD"): p is a linear layer ``rod_head`` on the embedding, added to every model
by :meth:`prepare_model` and initialised at zero, so a client's personalized prediction starts at the generic
one; the paper's hypernetwork variant of p is not implemented. ``generic_loss="ce"`` trains g with plain
cross-entropy (a comparison without the balanced risk). A class the client lacks gets
log N = −∞, i.e. no probability under BSM, as in Ren et al.'s code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew import numerics
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
    State,
    clone_state,
    embedding_dim,
    model_arrays,
    server_arrays,
)
from fedskew.algorithms.helpers import personal_module
from fedskew.models.base import FedModel

#: the personalized head's module name (its state entries start with ``PERSONAL + "."``)
PERSONAL = "rod_head"


def balanced_softmax_loss(logits: Tensor, y: Tensor, log_prior: Tensor) -> Tensor:
    """BSM: cross-entropy of ``logits + log_prior`` (the client's γ·log class counts)."""
    return F.cross_entropy(logits + log_prior, y)


@ALGORITHMS.register("fedrod")
class FedRoD(Algorithm):
    """FedRoD (Chen & Chao 2022): a generic head on a balanced risk (FedAvg) plus a local additive head."""

    personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        generic_loss: Literal["bsm", "ce"] = Field(
            "bsm", description="generic head's loss: balanced softmax (§4, FedRoD(BSM)) or plain CE"
        )
        gamma: float = Field(
            1.0, ge=0, description="exponent γ of the class counts in BSM (1: Ren et al. 2020, PFLlib)"
        )

    p: Params

    @staticmethod
    def is_personal(name: str) -> bool:
        return name.startswith(PERSONAL + ".")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Every model gets the zero-initialised linear personalized head p: R^d → R^C."""
        return personal_module(model, PERSONAL, self._zero_head)

    def _zero_head(self, model: nn.Module) -> nn.Module:
        dim, device = embedding_dim(model, self.name), next(model.parameters()).device
        head = nn.Linear(dim, self.ctx.num_classes).to(device)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return head

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        sd = clone_state(model.state_dict())
        return {"weights": {k: v for k, v in sd.items() if not self.is_personal(k)}}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        return Payload(arrays=server_arrays(server["weights"]))  # body and generic head

    # ---------------------------------------------------------------- client
    def init_client(self, cid: int) -> State:
        return {"personal": {k: v for k, v in self.ctx.initial_state(cid).items() if self.is_personal(k)}}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        personal = state["personal"] if state else {}
        return {**payload.model_state(), **personal}

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        counts = step.client.class_counts.to(step.client.y.device, torch.float32)
        return {"log_prior": self.p.gamma * numerics.log(counts)}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        model = cast(FedModel, step.model)
        z = model.features(batch.x)
        generic = model.head(z)
        if self.p.generic_loss == "bsm":
            loss = balanced_softmax_loss(generic, batch.y, step.scratch["log_prior"])
        else:
            loss = F.cross_entropy(generic, batch.y)
        personal = generic.detach() + getattr(model, PERSONAL)(z.detach())
        return loss + F.cross_entropy(personal, batch.y)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        sd = step.model.state_dict()
        upload = Payload(arrays=model_arrays(sd, lambda k: not self.is_personal(k)))
        personal = {k: v.detach().clone() for k, v in sd.items() if self.is_personal(k)}
        return LocalOutput(upload, {**step.state, "personal": personal})

    # ---------------------------------------------------------------- evaluation
    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        """Global protocol: g(z); personalized: g(z) + p(z) (primary) and g(z) as ``generic``."""
        fed_model = cast(FedModel, model)
        z = fed_model.features(x)
        generic = fed_model.head(z)
        if state is None:
            return {"logits": generic}
        return {"logits": generic + getattr(model, PERSONAL)(z), "generic": generic}
