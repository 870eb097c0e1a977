"""FedDecorr (Shi, Liang, Zhang, Tan, Bai 2023, "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR; arXiv:2210.00226), §4.

Local loss on a batch with representations ``z = features(x)`` (``N × d``):

    ℓ = CE(head(z), y) + β L_FedDecorr,     L_FedDecorr = (1/d²) ‖K‖_F²,

K the correlation matrix of the batch: each dimension z-scored over the batch (ẑ = (z − mean) / std), then
``K = ẑᵀẑ / N`` (the paper's form; the default is the authors' code, whose scale their β was tuned on, see
below). Aggregation is FedAvg's; evaluation is the plain model.

Choices (docs/decisions.md):

* ``formula="code"`` (default) is the authors' ``FedDecorrLoss`` (bytedance/FedDecorr ``loss.py``): unbiased
  variance, ``(ẑᵀẑ)²`` over the off-diagonal entries averaged over ``d(d−1)`` and divided by ``N`` (once, not
  ``N²``). Its gradient is ``(N−1)² d / (N (d−1))`` times the paper formula's (about ``N``: 30× at batch 32),
  a ratio that depends on the batch, so no constant rescaling of β carries the authors' tuned strength over
  to the paper formula; the code formula with their β = 0.1 is that strength at every batch size.
* ``formula="paper"`` is the paper's expression: population variance (so ``K`` is exactly the correlation
  matrix, ones on its diagonal), the diagonal included (a perfectly decorrelated batch gives
  ``d/d² = 1/d``); with the same β it regularises about ``N`` times more weakly.
* ``std = sqrt(var + 1e-8)`` (the code's ε); a constant dimension then standardises to 0.
* A batch of one sample: ``z − mean = 0`` so ``K = 0`` and the term is 0 in both formulas (the code returns 0
  explicitly); no data-dependent branching.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew import numerics
from fedskew.algorithms.base import ALGORITHMS, Algorithm, Batch, HyperParams, LocalStep, embedding_dim
from fedskew.models.base import FedModel
from fedskew.search_space import tunable

#: the z-score's ε under the square root (source: bytedance/FedDecorr loss.py, ``self.eps = 1e-8``)
EPS = 1e-8


def code_loss(z: Tensor) -> Tensor:
    """The authors' ``FedDecorrLoss`` of a ``[N, d]`` batch (bytedance/FedDecorr ``loss.py``)."""
    n, d = z.shape
    centred = z - z.mean(dim=0, keepdim=True)
    var = centred.pow(2).sum(0, keepdim=True) / max(n - 1, 1)  # unbiased, as torch.var
    zhat = centred / numerics.sqrt(var + EPS)
    gram = zhat.T @ zhat
    off = gram.pow(2).sum() - torch.diagonal(gram).pow(2).sum()
    return off / max(d * (d - 1), 1) / n


def paper_loss(z: Tensor) -> Tensor:
    """The paper's ``(1/d²) ‖K‖_F²`` of a ``[N, d]`` batch, K its correlation matrix (Shi et al. 2023 §4)."""
    n, d = z.shape
    centred = z - z.mean(dim=0, keepdim=True)
    zhat = centred / numerics.sqrt(centred.pow(2).mean(0, keepdim=True) + EPS)
    corr = zhat.T @ zhat / n
    return corr.pow(2).sum() / d**2


#: L_FedDecorr by ``formula`` (see the module docstring)
FORMULAS: dict[str, Callable[[Tensor], Tensor]] = {"code": code_loss, "paper": paper_loss}


def decorrelation_loss(z: Tensor, formula: str = "code") -> Tensor:
    """FedDecorr's regulariser of a ``[N, d]`` batch of representations (see the module docstring)."""
    return FORMULAS[formula](z)


@ALGORITHMS.register("feddecorr")
class FedDecorr(Algorithm):
    """FedDecorr (Shi et al. 2023): cross-entropy plus the decorrelation of the batch's representations."""

    class Params(HyperParams):
        beta: float = tunable(
            0.1,
            low=0.01,
            high=1.0,
            log=True,
            ge=0.0,
            description="weight β of L_FedDecorr on the 'code' formula's scale (source: authors' "
            "approach/fedavg.py default --feddecorr_coef 0.1 and run_scripts for CIFAR-10 / TinyImageNet; "
            "0.05 for CIFAR-100); search space ours (no grid of the authors read): a decade either side "
            "of 0.1",
        )
        formula: Literal["code", "paper"] = Field(
            "code",
            description="'code' (default) = the authors' loss.py, the formula their β was tuned on: "
            "off-diagonal mean of (ẑᵀẑ)² over d(d−1), divided by N, unbiased variance; 'paper' = "
            "(1/d²)‖K‖_F², diagonal included (Shi et al. 2023 §4), about N times weaker at the same β",
        )

    p: Params

    def prepare_model(self, model: nn.Module) -> nn.Module:
        embedding_dim(model, self.name)  # a one-line error for a model without features()
        return model

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        model = cast(FedModel, step.model)
        z = model.features(batch.x)
        loss = F.cross_entropy(model.head(z), batch.y)
        if self.p.beta == 0.0:
            return loss
        return loss + self.p.beta * decorrelation_loss(z.flatten(1), self.p.formula)
