"""FedRCL (Seo, Kim, Kim, Han, "Relaxed Contrastive Learning for Federated Learning", CVPR 2024).

Each client trains the received global model on

    L = CE(f(x), y) + β · R_l [ L_RCL^l ],                                      (multi-level objective)

R_l the mean (default, as the authors' code) or sum over the selected feature levels l, each level's output
globally average-pooled (conv maps) or flattened, then L2-normalised: z_i^l. For one level and anchor i of
a mini-batch, with s_ij = z_i·z_j, P_i = {j ≠ i : y_j = y_i}, A_i = {a ≠ i}:

    L_SCL(i) = −(1/|P_i|) Σ_{p∈P_i} log( exp(s_ip/τ) / Σ_{a∈A_i} exp(s_ia/τ) )    (SupCon objective)
    D(i)     = −log( exp(1/τ) / (exp(1/τ) + Σ_{j∈P_i, s_ij>λ} exp(s_ij/τ)) )     (divergence penalty)
             = log(1 + Σ_{j∈P_i, s_ij>λ} exp((s_ij − 1)/τ))
    L_RCL(i) = L_SCL(i) + w · D(i)

averaged over the anchors that have at least one positive. The penalty treats a same-class sample that is
already closer than λ like a negative of a contrast whose positive is the anchor itself (similarity 1), so
it pushes apart only the excessively similar positive pairs and leaves every pair with s_ij ≤ λ alone
(the "relaxation" that prevents SCL's representation collapse). Aggregation is FedAvg's.

Sources and choices. The paper's method section (its equation numbers) could not be retrieved while this
was written, so no equation numbers are cited: the formulas follow the paper's abstract ("a divergence
penalty on excessively similar sample pairs within each class", SCL as the base objective, a multi-level
extension) and the authors' public code, github.com/skynbe/FedRCL (``configs/client/fedrcl.yaml``,
``utils/loss.py`` ``CLLoss``, ``clients/rcl_client.py``):

* τ = 0.05, λ = 0.7, β = 1, w = 1: the authors' ``fedrcl.yaml`` (``temp``, ``threshold``, pair weights).
* Levels: the authors apply the loss to every block of their ResNet-18 (stem + 4 stages,
  ``branch_level: [0..4]``) with pre-ReLU features (``feature_relu: False``), averaged over the levels.
  Here ``layers: all`` (default) hooks, for a :class:`~fedskew.models.zoo.ResNet`, the stem and the last
  BasicBlock of every stage (pre-ReLU: ``bn1`` for the stem, ``bn2 + downsample`` for a block); for any other
  model, the input (pre-activation) of every ``nn.ReLU`` module of the body, in registration order — for
  ``cnn_fedproto`` the two conv blocks and the 50-d embedding layer. A model without ``nn.ReLU`` modules in
  its body (or with ``layers: embedding``) uses only ``features(x)``. A list of integers picks levels.
* L_SCL is the paper's full SupCon over the mini-batch (all same-label positives, all other samples in the
  denominator). The authors' code instead contrasts the least-similar positive against the two most similar
  negatives (``topk_pos: 1, topk_neg: 2``) and applies the penalty to the least-similar positive only;
  these top-k variants are not implemented.
* No frozen global model, no proximal or feature-alignment term: their weights are 0 in the authors' config.
* The authors' clients clip gradients at norm 10 and use AMP; the engine here does neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew import numerics
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    fedavg_mean,
    model_arrays,
    sample_weights,
)
from fedskew.models.base import FedModel
from fedskew.models.zoo import ResNet
from fedskew.search_space import tunable

DIAG_KEYS = ("rcl_scl", "rcl_penalty", "rcl_active_pairs", "rcl_pos_sim")


# ------------------------------------------------------------------------------------------------- loss
def pool_feature(h: Tensor) -> Tensor:
    """A level's output as ``[B, d]``: conv maps ``[B, C, H, W]`` global-average-pooled, others flattened."""
    return h.mean(dim=(2, 3)) if h.dim() == 4 else h.flatten(1)


def relaxed_contrastive_terms(
    z: Tensor, y: Tensor, tau: float, threshold: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-anchor ``L_SCL(i)``, ``D(i)`` (module docstring), the mask of anchors with a positive, the
    ``[B, B]`` positive-pair mask and the ``[B, B]`` cosine similarities, on L2-normalised ``z`` (normalised
    here)."""
    z = F.normalize(pool_feature(z), dim=1)
    b = z.shape[0]
    sim = z @ z.T
    eye = torch.eye(b, dtype=torch.bool, device=z.device)
    pos = (y[:, None] == y[None, :]) & ~eye
    n_pos = pos.sum(1)
    logits = (sim / tau).masked_fill(eye, float("-inf"))
    log_prob = logits - numerics.logsumexp(logits, dim=1, keepdim=True)  # over A_i
    scl = -log_prob.masked_fill(~pos, 0.0).sum(1) / n_pos.clamp_min(1)
    over = pos & (sim > threshold)  # the excessively similar positive pairs
    pen_logits = ((sim - 1.0) / tau).masked_fill(~over, float("-inf"))
    zero = torch.zeros(b, 1, dtype=z.dtype, device=z.device)  # the anchor itself: (1 − 1)/τ
    penalty = numerics.logsumexp(torch.cat([zero, pen_logits], 1), dim=1)
    return scl, penalty, n_pos > 0, pos, sim


def relaxed_contrastive_loss(
    z: Tensor, y: Tensor, tau: float = 0.05, threshold: float = 0.7, penalty_weight: float = 1.0
) -> Tensor:
    """``L_RCL`` = mean over anchors with a positive of ``L_SCL(i) + w·D(i)`` (module docstring); 0 (with a
    graph) when no anchor of the batch has a positive."""
    scl, penalty, has_pos, _, _ = relaxed_contrastive_terms(z, y, tau, threshold)
    per_anchor = scl + penalty_weight * penalty if penalty_weight else scl
    if not bool(has_pos.any()):
        return z.sum() * 0.0
    return per_anchor[has_pos].mean()


def supervised_contrastive_loss(z: Tensor, y: Tensor, tau: float = 0.05) -> Tensor:
    """SupCon (Khosla et al. 2020, L_out) over the mini-batch: ``L_RCL`` without the divergence penalty."""
    return relaxed_contrastive_loss(z, y, tau, penalty_weight=0.0)


# ---------------------------------------------------------------------------------------- feature levels
def _relu_modules(body: nn.Module) -> list[nn.Module]:
    return [m for m in body.modules() if isinstance(m, nn.ReLU)]


def level_names(model: nn.Module) -> list[str]:
    """Names of the levels ``layers: all`` collects (see :func:`collect_features`)."""
    if isinstance(model, ResNet):
        return ["stem"] + [f"layer{i + 1}" for i in range(model.num_stages)]
    body = getattr(model, "body", None)
    relus = _relu_modules(body) if isinstance(body, nn.Module) else []
    if not relus:
        return ["embedding"]
    names = {id(m): n for n, m in cast(nn.Module, body).named_modules()}  # a Module: it has ReLUs
    return [f"body.{names[id(m)]}" for m in relus]


@contextmanager
def _capture(model: nn.Module, pre_activation: bool) -> Iterator[list[Tensor]]:
    """Forward hooks that append every level's output (in forward order) to the yielded list."""
    out: list[Tensor] = []
    handles = []
    if isinstance(model, ResNet):
        parts: dict[int, Tensor] = {}

        def stem_hook(_m: nn.Module, _inp: tuple[Tensor, ...], o: Tensor) -> None:
            out.append(o if pre_activation else F.relu(o))

        handles.append(model.bn1.register_forward_hook(stem_hook))
        for i in range(model.num_stages):
            block = getattr(model, f"layer{i + 1}")[-1]

            def bn2_hook(_m: nn.Module, _inp: tuple[Tensor, ...], o: Tensor, key: int = i) -> None:
                parts[key] = o

            def down_hook(_m: nn.Module, _inp: tuple[Tensor, ...], o: Tensor, key: int = i) -> None:
                h = parts.pop(key) + o  # BasicBlock: relu(bn2(conv2(.)) + downsample(x))
                out.append(h if pre_activation else F.relu(h))

            handles.append(block.bn2.register_forward_hook(bn2_hook))
            handles.append(block.downsample.register_forward_hook(down_hook))
    else:
        body = getattr(model, "body", None)
        for m in _relu_modules(body) if isinstance(body, nn.Module) else []:

            def relu_hook(_m: nn.Module, inp: tuple[Tensor, ...], o: Tensor) -> None:
                out.append(inp[0] if pre_activation else o)

            handles.append(m.register_forward_hook(relu_hook))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def collect_features(
    model: nn.Module, x: Tensor, layers: str | list[int] = "all", pre_activation: bool = True
) -> tuple[Tensor, list[Tensor]]:
    """One forward pass of ``model.features``: the embedding ``z`` (for the head) and the selected levels'
    outputs, each pooled to ``[B, d_l]`` by :func:`pool_feature` (not yet normalised).

    ``layers``: ``"embedding"`` (only ``z``), ``"all"`` (every level of :func:`level_names`) or indices into
    that list. Levels of a model without ``nn.ReLU`` modules in its body fall back to ``[z]``.
    """
    if layers == "embedding":
        z = cast(FedModel, model).features(x)
        return z, [z]
    with _capture(model, pre_activation) as levels:
        z = cast(FedModel, model).features(x)
    levels = [pool_feature(h) for h in levels] or [z]
    if layers == "all":
        return z, levels
    try:
        return z, [levels[i] for i in cast("list[int]", layers)]  # the two names are handled above
    except IndexError:
        raise ValueError(
            f"fedrcl: layers {layers} out of range; the model has {len(levels)} levels "
            f"({', '.join(level_names(model))})"
        ) from None


# ------------------------------------------------------------------------------------------- algorithm
@ALGORITHMS.register("fedrcl")
class FedRCL(Algorithm):
    """FedRCL (Seo et al. 2024): CE + β · multi-level relaxed supervised contrastive loss; FedAvg."""

    mean_aggregation = False
    vectorizable = False

    class Params(HyperParams):
        beta: float = tunable(
            1.0,
            low=0.1,
            high=10.0,
            log=True,
            ge=0.0,
            description="β, weight of the (multi-level) L_RCL term (source: authors' "
            "fedrcl.yaml, rcl_loss weights 1; search: fedskew, [0.1, 10] log)",
        )
        tau: float = Field(
            0.05, gt=0.0, description="temperature τ (source: authors' fedrcl.yaml, temp 0.05)"
        )
        threshold: float = Field(
            0.7,
            ge=-1.0,
            le=1.0,
            description="λ: positive pairs with cosine similarity > λ are penalised "
            "(source: authors' fedrcl.yaml, threshold 0.7)",
        )
        penalty_weight: float = Field(
            1.0,
            ge=0.0,
            description="w, weight of the divergence penalty inside L_RCL; 0 gives plain SCL "
            "(source: authors' fedrcl.yaml, penalty pair weight 1)",
        )
        layers: Literal["all", "embedding"] | list[int] = Field(
            "all",
            description="feature levels: all blocks (paper: multi-level RCL), the embedding only, "
            "or indices into the level list",
        )
        layer_reduction: Literal["mean", "sum"] = Field(
            "mean", description="combine the levels' losses by mean (authors' code) or sum"
        )
        pre_activation: bool = Field(
            True, description="levels taken before the ReLU (authors' feature_relu: False)"
        )

    p: Params

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """FedAvg on the weights; sample-weighted mean of the clients' loss diagnostics as metrics."""
        update = ServerUpdate({**server, "weights": fedavg_mean(uploads)})
        w = sample_weights(uploads)
        metrics = {
            k: float(sum(wk * u.payload.metrics[k] for wk, u in zip(w.tolist(), uploads, strict=True)))
            for k in DIAG_KEYS
            if all(k in u.payload.metrics for u in uploads)
        }
        return ServerUpdate(update.state, metrics)

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """Sums of the last epoch's diagnostics: SCL, penalty, share of penalised pairs, mean positive
        similarity, and the number of batches."""
        return {"diag": torch.zeros(5, dtype=torch.float64, device=step.client.x.device)}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        p, model, scratch = self.p, cast(FedModel, step.model), step.scratch
        if p.beta == 0.0:
            return F.cross_entropy(model(batch.x), batch.y)
        z, levels = collect_features(model, batch.x, p.layers, p.pre_activation)
        loss = F.cross_entropy(model.head(z), batch.y)
        total = z.new_zeros(())
        scl_sum, pen_sum = z.new_zeros(()), z.new_zeros(())
        for h in levels:
            scl, pen, has_pos, pos, sim = relaxed_contrastive_terms(h, batch.y, p.tau, p.threshold)
            if bool(has_pos.any()):
                scl_m, pen_m = scl[has_pos].mean(), pen[has_pos].mean()
                total = total + scl_m + p.penalty_weight * pen_m
                scl_sum, pen_sum = scl_sum + scl_m.detach(), pen_sum + pen_m.detach()
        if p.layer_reduction == "mean":
            total = total / len(levels)
        if batch.last_epoch:  # diagnostics of the last local epoch; pair statistics of the last level's loop
            with torch.no_grad():
                sim = sim.detach()
                n_pos = pos.sum().clamp_min(1)
                row = torch.stack(
                    [
                        scl_sum / len(levels),
                        pen_sum / len(levels),
                        (pos & (sim > p.threshold)).sum() / n_pos,
                        (sim * pos).sum() / n_pos,
                        torch.ones_like(scl_sum),
                    ]
                ).double()
            scratch["diag"].add_(row)
        return loss + p.beta * total

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        acc = step.scratch["diag"]
        metrics = dict(zip(DIAG_KEYS, (acc[:4] / acc[4]).tolist(), strict=True)) if acc[4] > 0 else {}
        upload = Payload(arrays=model_arrays(step.model.state_dict()), metrics=metrics)
        return LocalOutput(upload, step.state)


__all__ = [
    "FedRCL",
    "collect_features",
    "level_names",
    "pool_feature",
    "relaxed_contrastive_loss",
    "relaxed_contrastive_terms",
    "supervised_contrastive_loss",
]
