"""Local training: every client trains its own model, nothing is communicated.

The no-collaboration baseline of FedProto (Tan et al. 2022, Table 1 "Local", 0 communicated parameters) and
MP-FedCL. Each client's personal weights live in its client state, initialised from the common initial
model, and persist across the rounds in which it is sampled. Only the ``personalized`` evaluation protocol
makes sense: there is no global model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import Tensor

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    LocalOutput,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    clone_state,
)
from fedskew.algorithms.helpers import no_global_model


@ALGORITHMS.register("local")
class Local(Algorithm):
    """Local: each client trains a persistent personal model; no communication (0 bytes)."""

    mean_aggregation = False  # nothing is uploaded

    personalized_eval: ClassVar[bool] = True
    requires_personalized_eval: ClassVar[bool] = True
    heterogeneous_models: ClassVar[bool] = True

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        return Payload()  # nothing is sent

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        return ServerUpdate(server)  # nothing was received; ``server["weights"]`` stays the initial model

    def init_client(self, cid: int) -> State:
        # The run's initial model in this client's architecture (the common one when homogeneous).
        return {"weights": self.ctx.initial_state(cid)}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None:
            raise no_global_model("algorithm 'local'")
        return state["weights"]

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        # cloned: ``step.model`` is an engine-owned instance reused by the next client
        return LocalOutput(Payload(), {**step.state, "weights": clone_state(step.model.state_dict())})
