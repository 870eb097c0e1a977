"""FedNTD (Lee, Jeong, Shin, Bae, Yun 2022, "Preservation of the Global Knowledge by Not-True Distillation in
Federated Learning", NeurIPS; arXiv:2106.03097), §4.

The client distils the received (frozen) global model into its local model on the not-true classes only:

    L = L_CE(q^l, y) + β L_NTD(q̃^l_τ, q̃^g_τ),
    L_NTD = −Σ_{c≠y} q̃^g_τ(c) log( q̃^l_τ(c) / q̃^g_τ(c) )   (= KL(q̃^g_τ ‖ q̃^l_τ)),
    q̃_τ(c) = exp(z_c/τ) / Σ_{c'≠y} exp(z_{c'}/τ)   for c ≠ y,

z^l the local and z^g the global model's logits, averaged over the batch. Aggregation is FedAvg's.

Choices (docs/decisions.md):

* The authors' code (Lee-Gihun/FedNTD, ``algorithms/fedntd/criterion.py``) multiplies L_NTD by τ² (the usual
  distillation scaling); the paper's objective does not. ``scaling="code"`` selects the code's variant; at the
  default τ = 1 both agree.
* The global logits come from ``torch.func.functional_call`` of the training model with the received
  weights, under ``no_grad``: no module is kept, so the loss is a pure function of (model, batch, payload)
  and trains vectorized. The forward runs in the training model's mode (train), as the authors' code (a
  deep copy of the model, not switched to eval); BatchNorm running statistics of that forward go to copies
  and are dropped.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedskew import numerics
from fedskew.algorithms.base import ALGORITHMS, Algorithm, Batch, HyperParams, LocalStep, Payload
from fedskew.search_space import tunable


def not_true_logits(logits: Tensor, y: Tensor) -> Tensor:
    """The ``[B, C−1]`` logits of every class but the true one, in class order (no masking, no data-dependent
    shapes: column j takes class ``j + [j ≥ y]``)."""
    cols = torch.arange(logits.shape[1] - 1, device=logits.device).unsqueeze(0)
    idx = cols + (cols >= y.unsqueeze(1)).long()
    return logits.gather(1, idx)


def ntd_loss(local: Tensor, global_: Tensor, y: Tensor, tau: float) -> Tensor:
    """``KL(q̃^g_τ ‖ q̃^l_τ)`` over the not-true classes, mean over the batch (FedNTD's L_NTD, without τ²)."""
    log_q_l = F.log_softmax(not_true_logits(local, y) / tau, dim=1)
    log_q_g = F.log_softmax(not_true_logits(global_, y) / tau, dim=1)
    return (numerics.exp(log_q_g) * (log_q_g - log_q_l)).sum(1).mean()


def global_logits(model: nn.Module, payload: Payload, x: Tensor) -> Tensor:
    """The received global model's logits on ``x`` (no gradient), through the training model's code with the
    payload's weights substituted; buffers are copies, so a train-mode forward changes nothing kept."""
    weights = payload.model_state()
    buffers = {n for n, _ in model.named_buffers()}
    state = {k: (v.clone() if k in buffers else v) for k, v in weights.items()}
    with torch.no_grad():
        return functional_call(model, state, (x,), strict=False).detach()


@ALGORITHMS.register("fedntd")
class FedNTD(Algorithm):
    """FedNTD (Lee et al. 2022): cross-entropy plus not-true distillation from the received global model."""

    loss_reads: ClassVar[frozenset[str]] = frozenset({"payload"})  # the global model's weights

    class Params(HyperParams):
        beta: float = tunable(
            1.0,
            low=0.1,
            high=10.0,
            log=True,
            ge=0.0,
            description="weight β of L_NTD (source: Lee et al. 2022 experimental setup, β = 1; the authors' "
            "config/fedntd.json; search: fedskew, [0.1, 10] log)",
        )
        tau: float = tunable(
            1.0,
            low=0.5,
            high=5.0,
            log=True,
            gt=0.0,
            description="softmax temperature τ of the not-true distributions (source: Lee et al. 2022 "
            "experimental setup, τ = 1; the authors' config/fedntd.json; criterion.py's class default is 3; "
            "search: fedskew, [0.5, 5] log spans both)",
        )
        scaling: Literal["paper", "code"] = Field(
            "paper",
            description="'paper' = β L_NTD as in the paper's objective; 'code' = β τ² L_NTD as the authors' "
            "criterion.py (equal at τ = 1)",
        )

    p: Params

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        logits = step.model(batch.x)
        loss = F.cross_entropy(logits, batch.y)
        if self.p.beta == 0.0 or logits.shape[1] < 2:  # hyper-parameter / shape branches, not data
            return loss
        glob = global_logits(step.model, step.payload, batch.x)
        weight = self.p.beta * (self.p.tau**2 if self.p.scaling == "code" else 1.0)
        return loss + weight * ntd_loss(logits, glob, batch.y, self.p.tau)
