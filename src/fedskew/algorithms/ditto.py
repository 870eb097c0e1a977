"""Ditto (Li, Hu, Beirami, Smith 2021, "Ditto: Fair and Robust Federated Learning through Personalization",
ICML), Algorithm 1.

Each client k keeps a personal model v_k and solves, besides the global objective G(F_1, …, F_K),

    min_v h_k(v; w*) = F_k(v) + λ/2 ‖v − w*‖²                                          (Eq. 1)

Round t, client k (Algorithm 1): the global copy is updated from the received w^t by the global method's
local solver (FedAvg: local SGD on F_k), and ``for s local iterations: v_k ← v_k − η(∇F_k(v_k) + λ(v_k −
w^t))``; the client sends w_k^t − w^t and the server aggregates as the global method does (FedAvg).

Both models are trained by the engine's one optimizer loop, on the same mini-batches, as the authors' code
does (``flearn/trainers_MTL/ditto.py``: per local iteration one batch, one step of v_k and one of w on it,
both at ``learning_rate``). :meth:`Ditto.prepare_model` gives every model a copy of itself as the
submodule ``ditto_personal`` (the personal model v_k); the loss on a batch is

    ℓ = CE(w; batch) + CE(v; batch) + λ/2 ‖v − w^t‖²,

whose gradient is ∇F_k(w) in w and ∇F_k(v) + λ(v − w^t) in v: one SGD step of the engine is exactly one
global step and one personal step of Algorithm 1 (with the client's momentum and weight decay, applied to
both). The number of personal steps s is the number of global steps (the code's ``local_iters``);
``personal_epochs`` ≠ ``client.epochs`` trains the model with more epochs alone for the difference.

Only the global copy w is uploaded; v_k stays in the client state (``personal``), initialised with the run's
initial model (v_k^0 = w^0, as the code). Evaluation: the personalized protocol scores v_k (the paper's
metric); the global protocol scores w (Ditto's global model is FedAvg's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    Phase,
    State,
    clone_state,
    model_arrays,
)
from fedskew.algorithms.fedprox import proximal_term
from fedskew.algorithms.helpers import personal_module
from fedskew.algorithms.work import Work, epochs_work
from fedskew.search_space import tunable

#: the submodule holding the personal model v_k in every model Ditto trains
PERSONAL = "ditto_personal"
PREFIX = PERSONAL + "."


def is_personal(name: str) -> bool:
    """Whether a state entry of a prepared model belongs to the personal copy v_k."""
    return name.startswith(PREFIX)


def is_global(name: str) -> bool:
    """Whether a state entry of a prepared model belongs to the global copy w."""
    return not name.startswith(PREFIX)


@ALGORITHMS.register("ditto")
class Ditto(Algorithm):
    """Ditto (Li et al. 2021): FedAvg on w, and per client a personal v_k pulled towards the received w^t."""

    loss_reads = frozenset({"payload"})  # the anchor w^t of the proximal term
    personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        lam: float = tunable(
            1.0,
            low=0.05,
            high=2.0,
            log=True,
            protocols=("personalized",),  # λ shapes v only: w's local solver never sees it (Alg. 1)
            ge=0.0,
            description="λ of h_k (Eq. 1) (source: Li et al. 2021 tune λ over {0.05, 0.1, 0.2, 0.5, 1, 2}; "
            "λ = 1 in the authors' run scripts `run_*_ditto_lam1.sh`, as FL-bench's default; search: that "
            "grid's range, log)",
        )
        personal_epochs: int | None = Field(
            None,
            ge=0,
            description="local epochs s of the personal model (source: Alg. 1 'for s local iterations'); "
            "None: client.epochs, the personal and global steps interleaved on the same batches as the "
            "authors' code (`local_iters` for both)",
        )

    p: Params

    # ---------------------------------------------------------------- construction
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Every model gets its personal copy ``ditto_personal`` (same architecture, same initial values)."""
        return personal_module(model, PERSONAL)

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        return {"weights": {k: v for k, v in clone_state(model.state_dict()).items() if is_global(k)}}

    # ---------------------------------------------------------------- client
    def init_client(self, cid: int) -> State:
        """v_k^0: the run's initial model in the client's architecture."""
        initial = self.ctx.initial_state(cid)
        return {"personal": {k: v for k, v in initial.items() if is_global(k)}}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """Training: w^t into the global copy and v_k into ``ditto_personal``; ``state=None``: w^t only."""
        if state is None:
            return payload.model_state()
        return {**payload.model_state(), **{PREFIX + k: v for k, v in state["personal"].items()}}

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """Personalized protocol: v_k in the model's own entries; global protocol: w."""
        if state is None:
            return payload.model_state()
        return {**payload.model_state(), **state["personal"]}

    def start_local(self, step: LocalStep) -> LocalPlan:
        """Both copies for min(E, s) epochs, then the one with more epochs alone for the difference."""
        epochs, lr = self.ctx.client.epochs, self.ctx.client.lr
        s = epochs if self.p.personal_epochs is None else self.p.personal_epochs
        phases = [Phase(epochs=min(epochs, s), lr=lr)]
        if s != epochs:
            alone = is_personal if s > epochs else is_global
            phases.append(Phase(epochs=abs(s - epochs), lr=lr, trainable=alone))
        return LocalPlan(phases)

    def extra_work(self, num_samples: int, local: Work) -> Mapping[str, Work]:
        """:mod:`fedskew.algorithms.work`: a step of the joint phase updates both copies (two forward-backward
        passes), so the personal copy's updates there are work besides the loop's steps; its lone epochs
        (``personal_epochs`` > E) are steps of the loop already."""
        cfg = self.ctx.client
        s = cfg.epochs if self.p.personal_epochs is None else self.p.personal_epochs
        joint = epochs_work(min(cfg.epochs, s), num_samples, cfg.batch_size)
        return {"personal_model": Work(min(joint.steps, local.steps), min(joint.samples, local.samples))}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        """CE(w) + CE(v) + λ/2 ‖v − w^t‖² (gradients: ∇F_k(w) and ∇F_k(v) + λ(v − w^t))."""
        personal = getattr(step.model, PERSONAL)
        loss = F.cross_entropy(step.model(batch.x), batch.y)
        loss_v = F.cross_entropy(personal(batch.x), batch.y)
        if self.p.lam:
            loss_v = loss_v + 0.5 * self.p.lam * proximal_term(personal, step.payload.model_state())
        return loss + loss_v

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload w_k^t (the global copy); keep v_k."""
        sd = step.model.state_dict()
        personal = {k[len(PREFIX) :]: v.detach().clone() for k, v in sd.items() if is_personal(k)}
        return LocalOutput(Payload(arrays=model_arrays(sd, is_global)), {**step.state, "personal": personal})
