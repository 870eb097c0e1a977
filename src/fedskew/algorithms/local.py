"""Local training: every client trains its own model, nothing is communicated.

The no-collaboration baseline of FedProto (Tan et al. 2022, Table 1 "Local", 0 communicated parameters) and
MP-FedCL. Each client's personal weights live in its client state, initialised from the common initial
model, and persist across the rounds in which it is sampled. Only the ``personalized`` evaluation protocol
makes sense: there is no global model.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    ClientView,
    LocalResult,
    Payload,
    Phase,
    State,
    load_state,
)
from fedskew.errors import ConfigError


@ALGORITHMS.register("local")
class Local(Algorithm):
    """Local: each client trains a persistent personal model; no communication (0 bytes)."""

    name = "local"
    vectorizable = True
    loss_reads = frozenset()  # plain cross-entropy
    personalized_eval: ClassVar[bool] = True
    requires_personalized_eval: ClassVar[bool] = True

    def broadcast(self, server: State, cid: int | None) -> Payload:
        return Payload()  # nothing is sent

    def aggregate(self, server: State, uploads: list, round_idx: int) -> State:
        return server  # nothing was received; ``server["weights"]`` stays the initial model

    def init_client(self, cid: int, server: State) -> State:
        # The run's initial model in this client's architecture (the common one when homogeneous).
        return {"weights": self.ctx.initial_state(cid)}

    def load_model(self, model: nn.Module, payload: Payload, state: State | None) -> None:
        if state is None:
            raise ConfigError(
                "algorithm 'local' has no global model to evaluate; set eval.protocol=personalized"
            )
        load_state(model, state["weights"])

    def start_local(
        self, model: nn.Module, payload: Payload, state: State, client: ClientView
    ) -> list[Phase]:
        self.load_model(model, payload, state)
        return [Phase(epochs=self.ctx.client.epochs, lr=self.ctx.client.lr)]

    def finish_local(
        self,
        model: nn.Module,
        payload: Payload,
        state: State,
        client: ClientView,
        scratch: dict,
        result: LocalResult,
    ) -> Payload:
        # clone: ``model`` is an engine-owned instance reused by the next client
        state["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return Payload()
