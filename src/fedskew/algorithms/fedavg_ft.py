"""FedAvg-FT: FedAvg whose clients fine-tune the global model on their own data (Wang, Mathews, Kiddon,
Eichner, Beaufays, Ramage 2019, "Federated Evaluation of On-device Personalization", arXiv:1910.10252).

The standard personalization baseline of the personalized-FL literature (the "FedAvg + FT" rows of FedBABU,
Oh et al. ICLR 2022, and of FedRep, Collins et al. ICML 2021). Training is FedAvg's unchanged: the server
broadcasts w, a client runs local SGD on cross-entropy and uploads its model, the server takes the
sample-weighted mean (McMahan et al. 2017, Alg. 1). Personalization (Wang et al. §3): a client fine-tunes the
global model it received on its local training data for ``finetune_epochs`` epochs of SGD (every parameter,
or the head only) and is evaluated with the result.

Our contract (docs/decisions.md, "FedAvg-FT / FedBABU: when the global model is fine-tuned"):

* Evaluation has no data access, so the fine-tuning runs during the client's round, in ``finish_local``, on
  a copy (:func:`fedskew.algorithms.finetune.finetune`), from the global model the client *received* this
  round, not from its locally trained model, and never reaches the upload. The fine-tuned model is kept in
  the client's state and is what the personalized protocol evaluates: after round t it is the fine-tuned
  w_t, one round behind the server's w_{t+1} (the papers fine-tune the final global model once, after
  training). A client not yet sampled (or without training data) is evaluated with the global model.
* ``finetune_lr`` unset uses the round's local learning rate (``client.lr`` times the round's decay);
  batch size, momentum and weight decay are the client config's.
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
    State,
    model_arrays,
)
from fedskew.algorithms.finetune import FINETUNE_KEY, FineTuneParams, finetune, finetune_plan


@ALGORITHMS.register("fedavg_ft")
class FedAvgFT(Algorithm):
    """FedAvg-FT: FedAvg training; each client is evaluated with the global model fine-tuned locally."""

    mean_aggregation = True
    personalized_eval: ClassVar[bool] = True
    vectorizable = True
    loss_reads = frozenset()  # plain cross-entropy

    Params = FineTuneParams
    p: FineTuneParams

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload the trained model (FedAvg); keep the received global model fine-tuned on the client's
        data in ``state["personal"]``."""
        upload = Payload(arrays=model_arrays(step.model.state_dict()))
        plan = finetune_plan(self, self.p, result, step.model)
        gen = step.info.generator(FINETUNE_KEY)
        personal = finetune(step.model, step.payload.model_state(), step.client, plan, gen)
        return LocalOutput(upload, {**step.state, "personal": personal})

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The client's fine-tuned model; the global one for the server and for clients never sampled."""
        if state is not None and "personal" in state:
            return state["personal"]
        return payload.model_state()
