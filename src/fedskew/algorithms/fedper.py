"""FedPer (Arivazhagan et al. 2019, "Federated Learning with Personalization Layers").

The model is split into *base* layers, trained by every client and averaged by the server as in FedAvg, and
*personalization* layers that never leave the client. A client trains base and personal layers together on
cross-entropy; it is evaluated with the received base and its own personal layers.

``personal`` chooses the split:

* ``head``: the classifier (the model's ``classifier.*`` parameters), FedPer's usual setting;
* ``linear``: every fully connected layer, the convolutional layers shared — the split of the FedProto
  authors' helper (``fc*`` personal) that matches their Table 1 count of 20 × 5,280 communicated parameters on
  MNIST (docs/methods/baselines.md, "FedPer: which layers are personal").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Context,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    State,
    clone_state,
    model_arrays,
    server_arrays,
)
from fedskew.errors import ConfigError

PERSONAL_SPLITS = ("head", "linear")


def personal_names(model: nn.Module, split: str) -> set[str]:
    """State-dict names of the personal layers of ``model`` under ``split`` (see the module docstring)."""
    names = set(model.state_dict())
    if split == "head":
        return {n for n in names if model.is_head(n)}  # type: ignore[operator]
    if split == "linear":
        out: set[str] = set()
        for prefix, module in model.named_modules():
            if isinstance(module, nn.Linear):
                out |= {f"{prefix}.{k}" if prefix else k for k in module.state_dict()}
        return out
    raise ConfigError(f"personal split '{split}' unknown; allowed: {', '.join(PERSONAL_SPLITS)}")


@ALGORITHMS.register("fedper")
class FedPer(Algorithm):
    """FedPer (Arivazhagan et al. 2019): FedAvg on the base layers, personal layers kept by each client."""

    vectorizable = False

    personalized_eval: ClassVar[bool] = True
    requires_personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        personal: Literal["head", "linear"] = Field(
            "head",
            description="personal layers: the classifier, or every linear layer (FedProto's Table 1 split)",
        )

    p: Params

    #: what the personal layers are, for error messages
    personal_what: ClassVar[str] = "head"

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        # The split, from the global architecture (the same on every process of the run).
        model = ctx.model_template(None)
        self.personal = frozenset(self.personal_layers(model))
        if len(self.personal) == len(model.state_dict()):
            raise ConfigError(f"{self.name}: every layer of this model would be personal; nothing is shared")

    def personal_layers(self, model: nn.Module) -> set[str]:
        """State-dict names of the layers that never leave the client."""
        names = personal_names(model, self.p.personal)
        if not names:
            raise ConfigError(
                f"{self.name}: personal={self.p.personal} leaves no personal layer in this model"
            )
        return names

    def is_personal(self, name: str) -> bool:
        return name in self.personal

    def is_shared(self, name: str) -> bool:
        return name not in self.personal

    def init_server(self, model: nn.Module) -> State:
        return {"weights": {k: v for k, v in clone_state(model.state_dict()).items() if self.is_shared(k)}}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        return Payload(arrays=server_arrays(server["weights"]))  # base layers only

    def init_client(self, cid: int) -> State:
        return {"personal": {k: v for k, v in self.ctx.initial_state(cid).items() if self.is_personal(k)}}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None:
            raise ConfigError(
                f"{self.name} has no global {self.personal_what} to evaluate; set eval.protocol=personalized"
            )
        return {**payload.model_state(), **state["personal"]}

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        sd = step.model.state_dict()
        personal = {k: v.detach().clone() for k, v in sd.items() if self.is_personal(k)}
        upload = Payload(arrays=model_arrays(sd, self.is_shared))
        return LocalOutput(upload, {**step.state, "personal": personal})
