"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan 2023, "FedALA: Adaptive Local Aggregation for Personalized
Federated Learning", AAAI), Algorithm 1 lines 6–16 (the ALA module) around FedAvg.

A sampled client i holding its old local model θ_i (the one it trained last time) receives the global model
Θ and builds its starting point element-wise (§3, "Adaptive Local Aggregation")::

    θ̂_i = θ_i + (Θ − θ_i) ⊙ [1, …, 1, W_i]       (lower layers: Θ; the top p layers: learned W_i ∈ [0, 1])

W_i is learned on a random s% sample of the local data: per mini-batch of that sample,
``W ← clip(W − η · ∇_θ̂ L(θ̂) ⊙ (Θ − θ_i), 0, 1)`` then θ̂ is rebuilt from W. At the first ALA of a client W
starts at ones and is trained epoch after epoch until the standard deviation of the last ``num_pre_loss``
epoch losses falls below ``threshold``; afterwards one epoch per round, from the W kept in the client's state.
The client then trains θ̂ with the usual local SGD and uploads it; the server averages uploads (FedAvg).

Details from the authors' code (``system/utils/ALA.py``): the sample is a contiguous slice of
``⌊s/100·n⌋`` samples from a uniformly drawn start, batched in order with ``drop_last``; a recorded epoch loss
is its last batch's loss; ALA is skipped while the client has no old local model (its first participation:
θ_i = Θ, so it starts from Θ). The code counts ``layer_idx`` in parameter *tensors* (its default and run
script's 2 are one weight and one bias); ``layers`` here counts parameterised modules (p = 1 ↔ 2), and 0
means every layer, as ``layer_idx=0`` does there. ALA mixes parameters only: BatchNorm statistics are the old
local model's, as in the code (the paper's CNNs have none). Only sampled clients run ALA (the code runs it
for every client each round); a client is evaluated with the local model it trained last (no data at
evaluation time; the code evaluates right after ALA), or Θ before its first participation.

Starting local training from θ̂: the runtime loads :meth:`model_weights` (Θ, no data access), ``start_local``
learns W and returns the top layers of θ̂ as the plan's ``start_weights``, which the runtime loads before
training (contract, :class:`~fedskew.algorithms.steps.LocalPlan`); the loss is plain cross-entropy, so the
engine's SGD (momentum, weight decay) runs from θ̂ itself, in every engine mode, vectorized included, and
``finish_local`` uploads the trained model (docs/methods/personalized.md, "Contract:
LocalPlan.start_weights").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

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
    State,
    clone_state,
    model_arrays,
)
from fedskew.algorithms.helpers import train_mode
from fedskew.search_space import tunable

ALA_KEY = 0xA1A  # the start of the sampled slice


# ------------------------------------------------------------ the mixed layers
def top_layers(model: nn.Module, count: int) -> list[str]:
    """Parameter names of the last ``count`` parameterised modules (0: all), in registration order."""
    names = [n for n, _ in model.named_parameters()]
    owners = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
    keep = set(owners if count == 0 else owners[-count:])
    return [n for n in names if n.rpartition(".")[0] in keep]


# ------------------------------------------------------------ the ALA weight learning
def learn_ala_weights(
    model: nn.Module,
    frozen: Mapping[str, Tensor],
    local: Mapping[str, Tensor],
    glob: Mapping[str, Tensor],
    weights: Mapping[str, Tensor],
    data: tuple[Tensor, Tensor],
    p: FedALA.Params,
    batch_size: int,
    start: bool,
) -> tuple[dict[str, Tensor], dict[str, Tensor], int]:
    """ALA (Algorithm 1 lines 8–15) on the sample ``data``: the learned weights W, the top layers of θ̂ and the
    number of epochs run. ``frozen`` holds every other model entry (lower layers = Θ, buffers: copies)."""
    x, y = data
    diff = {n: glob[n] - local[n] for n in local}
    w = {n: v.clone() for n, v in weights.items()}
    hat = {n: local[n] + diff[n] * w[n] for n in local}
    batches = x.shape[0] // batch_size
    losses: list[float] = []
    while batches:
        for b in range(batches):
            params = {n: v.detach().requires_grad_(True) for n, v in hat.items()}
            sl = slice(b * batch_size, (b + 1) * batch_size)
            loss = F.cross_entropy(functional_call(model, {**frozen, **params}, (x[sl],)), y[sl])
            grads = torch.autograd.grad(loss, list(params.values()))
            for (n, _), g in zip(params.items(), grads, strict=True):
                w[n] = (w[n] - p.eta * g * diff[n]).clamp(0.0, 1.0)
                hat[n] = local[n] + diff[n] * w[n]
        losses.append(float(loss.detach()))
        recent = torch.tensor(losses[-p.num_pre_loss :])
        converged = len(losses) > p.num_pre_loss and float(recent.std(unbiased=False)) < p.threshold
        # a NaN loss never passes the std test (NaN < threshold is false): without this stop the first ALA
        # would run all max_start_epochs for a client whose update the engine then rejects anyway
        diverged = not math.isfinite(losses[-1])
        if not start or converged or diverged or len(losses) >= p.max_start_epochs:
            break
    return w, {n: v.detach() for n, v in hat.items()}, len(losses)


@ALGORITHMS.register("fedala")
class FedALA(Algorithm):
    """FedALA (Zhang et al. 2023): FedAvg whose clients start from an element-wise learned mix of the global
    and their old local model (ALA)."""

    personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        rand_percent: float = tunable(
            80.0,
            low=5.0,
            high=100.0,
            gt=0,
            le=100,
            description="s: % of local data W is learned on (source: run_me.sh -rp 80; search: fedskew, "
            "[5, 100])",
        )
        layers: int = Field(
            1,
            ge=0,
            description="p: top parameterised layers mixed by W; lower ones take Θ; 0: all (source: "
            "main.py/run_me.sh layer_idx 2 = one weight + one bias: the top layer)",
        )
        eta: float = tunable(
            1.0,
            low=0.1,
            high=10.0,
            log=True,
            gt=0,
            description="η: learning rate of W (source: main.py default; search: fedskew, [0.1, 10] log)",
        )
        threshold: float = Field(
            0.1, ge=0, description="first ALA stops when the std of the last losses < this (source: ALA.py)"
        )
        num_pre_loss: int = Field(
            10, ge=1, description="how many recent epoch losses that std covers (source: ALA.py default 10)"
        )
        max_start_epochs: int = Field(
            1000, ge=1, description="cap on the first ALA's epochs (not in the paper/code: a safety stop)"
        )

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        model = ctx.model_template(None)
        self.param_names = frozenset(n for n, _ in model.named_parameters())
        self.top = tuple(top_layers(model, self.p.layers))

    # ---------------------------------------------------------------- client
    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """Θ; a client with an old local model keeps its buffers (ALA mixes parameters only)."""
        glob = payload.model_state()
        if not state or "local" not in state:
            return glob
        buffers = {k: v for k, v in state["local"].items() if k not in self.param_names}
        return {**glob, **buffers}

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """Personalized: the client's local model (trained last time it was sampled); global: Θ."""
        if state and "local" in state:
            return state["local"]
        return payload.model_state()

    def sample(self, step: LocalStep) -> tuple[Tensor, Tensor]:
        """The contiguous s% slice of the local data from a random start (ALA.py)."""
        n = step.client.num_samples
        size = int(self.p.rand_percent / 100 * n)
        start = int(torch.randint(0, n - size + 1, (1,), generator=step.info.generator(ALA_KEY)))
        return step.client.x[start : start + size], step.client.y[start : start + size]

    def start_local(self, step: LocalStep) -> LocalPlan:
        plan = super().start_local(step)
        if "local" not in step.state:  # first participation: θ_i = Θ, ALA is skipped (ALA.py)
            return plan
        model, local, glob = step.model, step.state["local"], step.payload.model_state()
        frozen = {k: v.detach() for k, v in model.named_parameters() if k not in self.top}
        frozen.update({k: v.detach().clone() for k, v in model.named_buffers()})  # BN updates hit copies
        start = "W" not in step.state
        weights = step.state.get("W") or {n: torch.ones_like(local[n]) for n in self.top}
        with train_mode(model):  # as the code's temporary copy of the (training) local model
            w, hat, epochs = learn_ala_weights(
                model,
                frozen,
                {n: local[n] for n in self.top},
                {n: glob[n] for n in self.top},
                weights,
                self.sample(step),
                self.p,
                self.ctx.client.batch_size,
                start,
            )
        # training starts from θ̂ (its top layers; the lower ones are Θ, loaded already)
        return LocalPlan(plan.phases, derived={"W": w, "ala_epochs": epochs}, start_weights=hat)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        weights = clone_state(step.model.state_dict())  # trained from θ̂ (the plan's start_weights)
        upload = Payload(arrays=model_arrays(weights))
        if "ala_epochs" in step.derived:
            upload.metrics["ala_epochs"] = float(step.derived["ala_epochs"])
        state = {**step.state, "local": weights}
        if "W" in step.derived:
            state["W"] = step.derived["W"]
        return LocalOutput(upload, state)
