"""APFL (Deng, Kamani, Mahdavi 2020, "Adaptive Personalized Federated Learning", arXiv:2003.13461),
Algorithm 1 ("Local Descent APFL") with the paper's adaptive mixing weight (the α update by its gradient
∇_α f_i(v̄_i) = ⟨v_i − w_i, ∇f_i(v̄_i)⟩, projected onto [0, 1]).

Client i keeps a local model v_i and a mixing weight α_i ∈ [0, 1]; its personalized model is the mixture
v̄_i = α_i v_i + (1 − α_i) w_i of its local model and its copy w_i of the global model. Every local step on a
mini-batch ξ (Algorithm 1, from the values of the previous step):

    w_i ← w_i − η ∇f_i(w_i; ξ)
    v_i ← v_i − η ∇_v f_i(v̄_i; ξ)          = v_i − η α_i ∇f_i(v̄_i; ξ)
    α_i ← Π_[0,1](α_i − η_α ∇_α f_i(v̄_i; ξ)),   ∇_α f_i(v̄_i) = ⟨v_i − w_i, ∇f_i(v̄_i; ξ)⟩   (adaptive α)

and the server averages the uploaded w_i (FedAvg); v_i and α_i never leave the client. The engine trains one
model, so :meth:`APFL.prepare_model` adds v as a copy of the architecture (submodule ``apfl_local``) and the
local loss is ``CE(w(x), y) + CE(v̄(x), y)`` with w detached inside v̄: one SGD step then takes exactly the w
and v steps above (the first term's gradient reaches only w, the second's only v, scaled by α). α is not an
engine parameter (it must be projected onto [0, 1] after each step): the loss computes ∇_α by autograd at the
step's point and applies the projected step to the round's ``scratch`` value in place; ``finish_local`` keeps
it. A client is evaluated with v̄ = α v + (1 − α) w built from the server's current w (the paper's
personalized output mixes α v with the average of the w's).

Options (paper first; docs/decisions.md, "APFL: ..."):

* ``adaptive``: learn α as above (the method's adaptive α), or keep it fixed (Algorithm 1 as printed);
* ``alpha_every``: ``step`` (every local step, the paper) or ``round`` (once per round on the first batch, the
  authors' FedTorch code);
* ``alpha_l2``: the authors' code adds ``0.02 · α`` to ∇_α (0 in the paper);
* ``mixing``: ``params`` (the paper's mixture of parameters) or ``logits`` (the authors' code mixes outputs,
  ``α v(x) + (1 − α) w(x)``).

Deviations: the w and v steps are simultaneous, from the step's common point (Algorithm 1); the authors' code
steps w first and builds v̄ from the new w. The server averages with sample weights (the paper: uniformly
over the sampled clients). BatchNorm statistics of v̄ are v's own buffers. The loss reported for training is
the sum of the two cross-entropies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    Context,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    MeanInfo,
    Payload,
    ServerUpdate,
    State,
    clone_state,
    model_arrays,
)
from fedskew.algorithms.helpers import personal_module
from fedskew.errors import ConfigError
from fedskew.search_space import tunable

#: the submodule holding the client's local model v (its state entries are prefixed ``apfl_local.``)
LOCAL = "apfl_local"
PREFIX = LOCAL + "."


def is_global(name: str) -> bool:
    """A state entry of w (the architecture's own), not of the local copy v."""
    return not name.startswith(PREFIX)


@ALGORITHMS.register("apfl")
class APFL(Algorithm):
    """APFL (Deng et al. 2020): a local model mixed with the global one by a learned weight α."""

    personalized_eval: ClassVar[bool] = True
    #: the loss takes α's gradient by autograd and updates α in place: not a vmap-able pure function
    vectorizable = False

    class Params(HyperParams):
        alpha: float = tunable(
            0.5,
            low=0.25,
            high=0.75,
            protocols=("personalized",),  # α shapes v only: w's step never sees it (Alg. 1)
            ge=0.0,
            le=1.0,
            description="initial mixing weight α (source: authors' code --fed_personal_alpha 0.5; the "
            "paper's experiments use α ∈ {0.25, 0.5, 0.75}; search: that range)",
        )
        adaptive: bool = Field(
            True,
            description="learn α by projected SGD on ⟨v − w, ∇f(v̄)⟩ (the paper's adaptive α); False: α fixed "
            "(Algorithm 1 as printed)",
        )
        alpha_lr: float | None = Field(
            None,
            gt=0.0,
            description="step size of α (None: the round's local lr, the paper's single η_t)",
        )
        alpha_every: Literal["step", "round"] = Field(
            "step",
            description="α update at every local step (paper) or once per round on the first batch "
            "(authors' FedTorch code)",
        )
        alpha_l2: float = Field(
            0.0, ge=0.0, description="λ added as λ·α to ∇_α (paper: 0; authors' code: 0.02)"
        )
        mixing: Literal["params", "logits"] = Field(
            "params",
            description="v̄ = α v + (1 − α) w in parameters (paper) or α v(x) + (1 − α) w(x) in outputs "
            "(authors' code)",
        )

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        #: parameter names of the architecture (mixed in v̄; buffers are v's own)
        self.param_names = frozenset(
            n for n, _ in ctx.model_template(None).named_parameters() if is_global(n)
        )

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Every model gets the local copy v (submodule ``apfl_local``, unused by ``forward``)."""
        if isinstance(model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            raise ConfigError("apfl: the model's forward would run the added local copy; use a FedModel")
        return personal_module(model, LOCAL)

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        return {"weights": {k: v for k, v in clone_state(model.state_dict()).items() if is_global(k)}}

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        """FedAvg of w; the mean α the clients reported, as a diagnostic."""
        update = super().server_step(server, mean, info)
        alphas = [u.payload.metrics["alpha"] for u in info.uploads if "alpha" in u.payload.metrics]
        metrics = {"apfl_alpha": sum(alphas) / len(alphas)} if alphas else {}
        return ServerUpdate(update.state, metrics)

    # ---------------------------------------------------------------- client
    def init_client(self, cid: int) -> State:
        """v starts as the run's initial model (the code's copy of the global model), α at ``alpha``."""
        init = self.ctx.initial_state(cid)
        return {"local": {k: v for k, v in init.items() if is_global(k)}, "alpha": torch.tensor(self.p.alpha)}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """w from the payload; v from the client's state (under ``apfl_local.``)."""
        w = payload.model_state()
        if state is None:
            return w
        return {**w, **{PREFIX + k: v for k, v in state["local"].items()}}

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """The round's α (updated in place by the loss) and a step counter."""
        alpha = step.state["alpha"].detach().clone().to(step.client.x.device, torch.float32)
        return {"alpha": alpha, "steps": torch.zeros((), dtype=torch.long, device=alpha.device)}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        """``CE(w(x)) + CE(v̄(x))``, w detached in v̄; takes the projected α step (see the module docstring)."""
        model = step.model
        out_w = model(batch.x)
        update = self.p.adaptive and (self.p.alpha_every == "step" or int(step.scratch["steps"]) == 0)
        alpha = step.scratch["alpha"].detach().clone().requires_grad_(update)
        loss_bar = F.cross_entropy(self.mixed_forward(model, alpha, batch.x, out_w), batch.y)
        if update:
            (g,) = torch.autograd.grad(loss_bar, alpha, retain_graph=True)
            client = self.ctx.client  # the round's rate: lr_decay and lr_schedule
            lr = self.p.alpha_lr or client.lr * client.round_lr_scale(step.info.round, self.ctx.rounds)
            with torch.no_grad():
                step.scratch["alpha"].copy_((alpha - lr * (g + self.p.alpha_l2 * alpha)).clamp(0.0, 1.0))
        step.scratch["steps"].add_(1)
        return F.cross_entropy(out_w, batch.y) + loss_bar

    def mixed_forward(self, model: nn.Module, alpha: Tensor, x: Tensor, out_w: Tensor) -> Tensor:
        """The personalized model's output on ``x`` (``out_w``: the global model's, not differentiated)."""
        local = getattr(model, LOCAL)
        if self.p.mixing == "logits":
            return alpha * local(x) + (1 - alpha) * out_w.detach()
        w = dict(model.named_parameters())
        mixed = {n: alpha * v + (1 - alpha) * w[n].detach() for n, v in local.named_parameters()}
        return functional_call(local, mixed, (x,))  # v's buffers (BatchNorm statistics of v̄)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload w; keep v and α."""
        sd = step.model.state_dict()
        alpha = step.scratch["alpha"].detach().clone() if "alpha" in step.scratch else step.state["alpha"]
        upload = Payload(arrays=model_arrays(sd, is_global), metrics={"alpha": float(alpha)})
        local = {k[len(PREFIX) :]: v.detach().clone() for k, v in sd.items() if not is_global(k)}
        return LocalOutput(upload, {**step.state, "local": local, "alpha": alpha})

    # ---------------------------------------------------------------- evaluation
    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The global model w for the server; for a client, v̄ in the architecture's own entries
        (``mixing: params``; v's buffers), or w and v side by side (``mixing: logits``)."""
        weights = self.model_weights(payload, state)
        if state is None or self.p.mixing == "logits":
            return weights
        w, v, a = payload.model_state(), state["local"], state["alpha"]
        mixed = {k: a * t + (1 - a) * w[k] if k in self.param_names else t for k, t in v.items()}
        return {**weights, **mixed}

    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        if state is None or self.p.mixing == "params":
            return {"logits": model(x)}
        a = state["alpha"].to(x.device)
        return {"logits": a * getattr(model, LOCAL)(x) + (1 - a) * model(x)}
