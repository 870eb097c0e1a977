"""FedAvg-FT: FedAvg whose clients fine-tune the global model on their own data (Wang, Mathews, Kiddon,
Eichner, Beaufays, Ramage 2019, "Federated Evaluation of On-device Personalization", arXiv:1910.10252).

The standard personalization baseline of the personalized-FL literature (the "FedAvg + FT" rows of FedBABU,
Oh et al. ICLR 2022, and of FedRep, Collins et al. ICML 2021). Training is FedAvg's unchanged: the server
broadcasts w, a client runs local SGD on cross-entropy and uploads its model, the server takes the
sample-weighted mean (McMahan et al. 2017, Alg. 1). Personalization (Wang et al. §3): a client fine-tunes the
global model it received on its local training data for ``finetune_epochs`` epochs of SGD (every parameter,
or the head only) and is evaluated with the result.

Our contract (docs/methods/personalized.md, "FedAvg-FT / FedBABU: fine-tuning at evaluation"):

* The personalized protocol fine-tunes the model being evaluated (the server's w_{t+1} after round t), on a
  copy (:func:`fedskew.algorithms.finetune.finetune`) in :meth:`FedAvgFT.adapt_for_eval`, on the client's
  training data, as the paper does with the final global model; nothing of it is kept (no client state).
  A client without training data is scored with the global model. ``eval_finetune: stale`` keeps the former
  procedure: the client fine-tunes the model it *received* in its round (``finish_local``), keeps it in its
  state and is scored with it later (w_t after round t, older for a client not sampled since).
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
from fedskew.algorithms.finetune import FINETUNE_KEY, FineTuneParams, FineTuneWork, finetune, finetune_plan


@ALGORITHMS.register("fedavg_ft")
class FedAvgFT(FineTuneWork, Algorithm):
    """FedAvg-FT: FedAvg training; each client is evaluated with the global model fine-tuned locally."""

    personalized_eval: ClassVar[bool] = True

    Params = FineTuneParams
    p: FineTuneParams

    def adapt_for_eval(self, step: LocalStep) -> Mapping[str, Tensor] | None:
        """Wang et al. §3: the model being evaluated, fine-tuned on the client's training data."""
        if self.p.eval_finetune == "stale" or step.client.num_samples == 0:
            return None
        plan = finetune_plan(self, self.p, step.info.round, step.model)
        return finetune(
            step.model, step.model.state_dict(), step.client, plan, step.info.generator(FINETUNE_KEY)
        )

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload the trained model (FedAvg); under ``eval_finetune: stale`` keep the received global model
        fine-tuned on the client's data in ``state["personal"]``."""
        upload = Payload(arrays=model_arrays(step.model.state_dict()))
        if self.p.eval_finetune == "fresh":
            return LocalOutput(upload, step.state)
        plan = finetune_plan(self, self.p, step.info.round, step.model)
        gen = step.info.generator(FINETUNE_KEY)
        personal = finetune(step.model, step.payload.model_state(), step.client, plan, gen)
        return LocalOutput(upload, {**step.state, "personal": personal})

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The global model (fine-tuned by :meth:`adapt_for_eval`); under ``stale`` the client's kept
        fine-tuned model, the global one for the server and for clients never sampled."""
        if state is not None and "personal" in state:
            return state["personal"]
        return payload.model_state()
