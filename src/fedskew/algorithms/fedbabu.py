"""FedBABU (Oh, Kim, Yun 2022, "FedBABU: Towards Enhanced Representation for Federated Image Classification",
ICLR), Algorithm 1 (FedBABU: Federated Averaging with Body Aggregation and Body Update).

The model is a body (feature extractor) and a head (the classifier). The head is randomly initialised and
**never trained nor aggregated** during federated training: every client holds the same initial head. A
client trains only the body on cross-entropy for the round's local epochs (its head frozen, learning rate 0
in the authors' code), uploads the body, and the server averages the bodies ``θ_ext ← Σ_k (n_k/n) θ_ext,k``
(FedAvg on the body). For evaluation each client fine-tunes the global model (body and initial head) on its
own training data for τ_f epochs — the whole model by default (the paper's personalization), the head only
with ``finetune: head`` — and is evaluated with the result ("personalized accuracy"); the global model itself
(aggregated body + initial head) is evaluated by the global protocol ("initial accuracy").

Within our contract (docs/methods/personalized.md, "FedAvg-FT / FedBABU: fine-tuning at evaluation"):

* The head's initial weights are a pure function of the run's config (the run's initial model): they never
  travel; :meth:`FedBABU.model_weights` loads them beside the received body (cached per architecture).
* The personalized protocol fine-tunes the model being evaluated (the aggregated body after round t and the
  initial head) on the client's training data, on a copy (:mod:`fedskew.algorithms.finetune`), in
  :meth:`FedBABU.adapt_for_eval` (§3: personalization from the final global model, then test); nothing of
  it is kept. ``eval_finetune: stale`` keeps the former procedure: the client fine-tunes in its round (from
  the model it received, ``finetune_from: global``, or its trained body, ``local``, which only ``stale``
  allows), keeps the result in its state and is scored with it later.
* The server averages bodies with sample weights (the code averages uniformly over the sampled clients).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Context,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    Phase,
    RoundInfo,
    State,
    clone_state,
    model_arrays,
    server_arrays,
)
from fedskew.algorithms.finetune import (
    FINETUNE_KEY,
    FineTuneParams,
    FineTuneWork,
    finetune,
    finetune_plan,
    head_filter,
)
from fedskew.errors import ConfigError


@ALGORITHMS.register("fedbabu")
class FedBABU(FineTuneWork, Algorithm):
    """FedBABU (Oh et al. 2022): body-only federated training under a fixed random head; fine-tuning for
    personalization."""

    personalized_eval: ClassVar[bool] = True
    #: the initial head per architecture (a pure function of the context)
    working_buffers = frozenset({"initial_heads"})

    class Params(FineTuneParams):
        finetune_from: Literal["global", "local"] = Field(
            "global",
            description="what a client fine-tunes: the global model it received (the paper fine-tunes the "
            "global model) or its body after this round's local training (local: eval_finetune=stale only)",
        )

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        model = ctx.model_template(None)
        head_filter(model, self.name)  # a one-line error for a model without a head
        #: state-dict names of the head (parameters and any buffers), from the global architecture
        self.head = frozenset(n for n in model.state_dict() if model.is_head(n))  # type: ignore[operator]
        if len(self.head) == len(model.state_dict()):
            raise ConfigError(f"{self.name}: the model has no body to train")
        self.initial_heads: dict[Hashable, dict[str, Tensor]] = {}
        if self.p.finetune_from == "local" and self.p.eval_finetune == "fresh":  # no trained body at eval
            raise ConfigError(
                f"{self.name}: finetune_from=local needs eval_finetune=stale (with eval_finetune=fresh "
                "allowed: finetune_from=global)"
            )

    def is_head(self, name: str) -> bool:
        return name in self.head

    def is_body(self, name: str) -> bool:
        return name not in self.head

    def initial_head(self, cid: int | None) -> dict[str, Tensor]:
        """The run's initial head in client ``cid``'s architecture (cached; never changed)."""
        key = self.ctx.arch_key(cid)
        if key not in self.initial_heads:
            init = self.ctx.initial_state(cid)
            self.initial_heads[key] = {k: v for k, v in init.items() if self.is_head(k)}
        return self.initial_heads[key]

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        return {"weights": {k: v for k, v in clone_state(model.state_dict()).items() if self.is_body(k)}}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        return Payload(arrays=server_arrays(server["weights"]))  # the body only

    # ---------------------------------------------------------------- client
    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The received body and the fixed initial head."""
        return {**payload.model_state(), **self.initial_head(None)}

    def start_local(self, step: LocalStep) -> LocalPlan:
        """Body update (Algorithm 1): the head is not trained."""
        return LocalPlan([Phase(self.ctx.client.epochs, self.ctx.client.lr, trainable=self.is_body)])

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload the trained body; under ``eval_finetune: stale`` keep the fine-tuned model (from the
        received global model, or from the trained body under ``finetune_from: local``) in
        ``state["personal"]``."""
        sd = step.model.state_dict()
        upload = Payload(arrays=model_arrays(sd, self.is_body))
        if self.p.eval_finetune == "fresh":
            return LocalOutput(upload, step.state)
        start = self.model_weights(step.payload, None) if self.p.finetune_from == "global" else sd
        plan = finetune_plan(self, self.p, step.info.round, step.model)
        personal = finetune(step.model, start, step.client, plan, step.info.generator(FINETUNE_KEY))
        return LocalOutput(upload, {**step.state, "personal": personal})

    # ---------------------------------------------------------------- evaluation
    def adapt_for_eval(self, step: LocalStep) -> Mapping[str, Tensor] | None:
        """Oh et al. §3 / Alg. 1's evaluation: the global model (body + initial head) fine-tuned on the
        client's training data, the whole network (``finetune: full``) or the head."""
        if self.p.eval_finetune == "stale" or step.client.num_samples == 0:
            return None
        plan = finetune_plan(self, self.p, step.info.round, step.model)
        return finetune(
            step.model, step.model.state_dict(), step.client, plan, step.info.generator(FINETUNE_KEY)
        )

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The global model (body + initial head; fine-tuned by :meth:`adapt_for_eval`); under ``stale``
        the client's kept fine-tuned model once it has one."""
        if state is not None and "personal" in state:
            return state["personal"]
        return self.model_weights(payload, None)
