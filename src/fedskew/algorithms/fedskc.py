"""FedSKC (Wang et al., "FedSKC: Federated Learning with Non-IID Data via Structural Knowledge
Collaboration").

Structural knowledge lives in the C-dimensional **logit** space: the paper defines it with the full model's
output ``f_k(w_k; x)`` (§III-A), calls it "the normalized pre-softmax output" (§III-D), and GPR takes a
variance over its C entries (Eq. 5); see docs/methods/fedskc.md, "FedSKC: space of the structural knowledge".

* **Local structural knowledge** (§III-A): after local training each client computes, per class it holds, the
  mean logit vector of its final model and applies SiLU, ``c_k^j = c̄ ⊙ σ(c̄)``.
* **Global structural knowledge** (Eq. 1, §III-A): per class, each participant's prototype is averaged with
  those of its ``M`` nearest other participants (L2), and the merged prototypes are averaged.
* **Local Contrastive Learning** (Eqs. 2–3, §III-B): ``L = L_CE + L_LCL`` with
  ``L_LCL = CE([s(l_i, c̃^1)/τ, …, s(l_i, c̃^C)/τ], y_i)`` and ``s(l, c) = cos(l, c) / U_j``.
* **Global Discrepancy Aggregation** (Eq. 4, §III-B): ``d_k = Σ_j ‖c_k^j − c̃^j‖``, ``a_k = d_k/Σd``,
  ``b_k = N_k/ΣN``, ``e_k ∝ σ(N_k − a_k d_k + b_k)``, ``w = Σ e_k w_k``.
* **Global Period Review** (Eq. 5, §III-B): ``γ_r`` = relative change of the summed per-class variance of the
  global prototypes; ``w ← β w_agg + (1−β) γ_r (w_prev − w_agg)``.

Two printed formulas are degenerate (Eq. 4 saturates, Eq. 5 is not a convex combination), so both forms
are options and the logs show the difference (docs/methods/fedskc.md, "FedSKC: GDA weights saturate (Eq.
4)" and
"FedSKC: Eq. 5 is not a convex combination"):

* ``gda_mode``: ``literal`` (raw ``N_k`` in the sigmoid: saturates to exactly uniform weights whenever
  ``N_k ≳ 37``; default) or ``relative`` (``N_k → b_k``, i.e. ``σ(2 b_k − a_k d_k)``, the FedDisco form). In
  development runs on ``digits`` the relative form put almost all weight on one or two clients (``a_k d_k``
  is on the scale of the logit distances, ``b_k`` on the scale of 1/|A_r|) and cost 15–25 points, while the
  literal form trains like uniform averaging, so the literal form is the default.
* ``gpr_form``: ``literal`` (coefficients sum to β: the model also shrinks by β every round; on ``digits`` it
  cost 20–40 points) or ``affine`` (``w_agg + (1−β) γ_r (w_prev − w_agg)``, a server step adapted to the
  prototype variance; default).

Points the paper leaves open (each an entry "FedSKC: ..." in docs/decisions.md): prototypes from an
eval-mode pass over the local data after training (Algorithm 1 computes them after the local epochs); only
present classes are uploaded, Eq. (1) runs over the participants holding the class with
``M_eff = min(M, |P_j| − 1)``, absent classes carry over; ``U_j`` per mini-batch, detached (``u_mode``
gives the other readings of Eq. 2); LCL skipped until prototypes exist and restricted to classes with one;
batch means for both losses; GDA on the server with the fresh ``c̃_r`` (Algorithm 1) applied to every
floating state entry; GPR skipped in round 1, ``w_prev`` = the model broadcast this round, population
variance (as Eq. 5 writes it) over the classes present in both rounds. Component switches
``lcl``/``gda``/``gpr`` give Table V's ablation (all off is FedAvg).
"""

from __future__ import annotations

from typing import Literal

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
    Scratch,
    ServerUpdate,
    State,
    Upload,
    model_arrays,
    sample_weights,
    weighted_average,
)
from fedskew.algorithms.layouts import UploadLayout, class_rows, specs_of
from fedskew.algorithms.protos import class_means, pack
from fedskew.models.base import embed_in_chunks
from fedskew.search_space import tunable

_EPS = 1e-8


def structural_knowledge(
    logits: Tensor, labels: Tensor, num_classes: int, silu: bool = True
) -> tuple[Tensor, Tensor]:
    """Local structural knowledge (§III-A): per-class mean logit vectors ``[C, C]``, then ``c ⊙ σ(c)``.

    Returns ``(table, counts)``; classes without samples have a zero row and count 0.
    """
    means, counts = class_means(logits, labels, num_classes)
    return (F.silu(means) if silu else means), counts


def merge_nearest(protos: Tensor, present: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """Global structural knowledge, Eq. (1), for every class at once.

    ``protos [K, C, D]`` client prototypes, ``present [K, C]`` which exist. For class j, participant k's
    merged prototype is the mean of its own and its ``M_eff = min(M, |P_j| − 1)`` nearest other participants'
    prototypes (L2; only the participants ``P_j`` holding class j take part), and ``c̃^j`` is the mean of the
    merged prototypes over ``P_j``. Returns ``(global [C, D], has [C])``; classes nobody holds have a zero row
    and ``has=False``.
    """
    k, c, _ = protos.shape
    per_class = protos.transpose(0, 1)  # [C, K, D]
    dist = numerics.cdist(per_class.double(), per_class.double())  # [C, K, K]
    valid = present.T[:, :, None] & present.T[:, None, :]  # [C, K, K] both hold the class
    valid &= ~torch.eye(k, dtype=torch.bool, device=protos.device)
    dist = dist.masked_fill(~valid, float("inf"))
    kk = min(m, k - 1)
    merged = per_class.clone()
    count = torch.ones(c, k, 1, dtype=protos.dtype, device=protos.device)
    if kk > 0:
        nn_dist, nn_idx = dist.topk(kk, dim=-1, largest=False)  # [C, K, M]
        use = torch.isfinite(nn_dist).to(protos.dtype)  # fewer than M other holders: M_eff < M
        gathered = torch.gather(
            per_class[:, None].expand(c, k, k, -1),
            2,
            nn_idx[..., None].expand(-1, -1, -1, per_class.shape[-1]),
        )  # [C, K, M, D]
        merged = merged + (gathered * use[..., None]).sum(2)
        count = count + use.sum(-1, keepdim=True)
    merged = merged / count
    holders = present.T.to(protos.dtype)  # [C, K]
    n = holders.sum(1)
    glob = (merged * holders[..., None]).sum(1) / n.clamp_min(1)[:, None]
    return glob, n > 0


def discrepancies(
    protos: Tensor, present: Tensor, glob: Tensor, has: Tensor, per_class: bool = False
) -> Tensor:
    """``d_k = Σ_j ‖c_k^j − c̃^j‖₂`` over the client's classes that have a global prototype (Alg. 1 l. 18;
    absent classes add nothing); ``per_class=True`` rescales by ``C / |present_k|``. Returns ``[K]``
    float64."""
    use = present & has[None]
    dist = (protos.double() - glob.double()[None]).norm(dim=-1) * use
    d = dist.sum(1)
    if per_class:
        d = d * protos.shape[1] / use.sum(1).clamp_min(1)
    return d


def gda_weights(d: Tensor, n: Tensor, mode: str = "literal") -> Tensor:
    """Eq. (4): ``e_k = σ(N_k − a_k d_k + b_k) / Σ_i σ(N_i − a_i d_i + b_i)`` with ``a_k = d_k/Σd`` and
    ``b_k = N_k/ΣN`` over the participants. ``mode="relative"`` uses ``b_k`` for ``N_k`` (raw counts
    saturate the sigmoid)."""
    d, n = d.double(), n.double()
    a = d / d.sum() if float(d.sum()) > 0 else torch.zeros_like(d)
    b = n / n.sum()
    size = n if mode == "literal" else b
    s = torch.sigmoid(size - a * d + b)
    return s / s.sum()


def prototype_variance_change(glob: Tensor, prev: Tensor, common: Tensor) -> float:
    """``γ_r = Σ_j (σ²_{r,j} − σ²_{r−1,j}) / Σ_j σ²_{r−1,j}`` (Eq. 5) over the ``common`` classes, with the
    population variance (1/C, as the paper writes it) of each prototype's C entries."""
    var_now = glob[common].double().var(dim=1, unbiased=False)
    var_prev = prev[common].double().var(dim=1, unbiased=False)
    denom = float(var_prev.sum())
    return float((var_now - var_prev).sum()) / denom if denom > 0 else 0.0


def period_review(
    aggregated: dict[str, Tensor], previous: dict[str, Tensor], gamma: float, beta: float, form: str
) -> dict[str, Tensor]:
    """Eq. (5) on every floating entry (integer buffers such as BatchNorm counters keep the aggregate):
    ``literal``: ``β w_agg + (1−β) γ (w_prev − w_agg)``; ``affine``: ``w_agg + (1−β) γ (w_prev − w_agg)``."""
    scale = beta if form == "literal" else 1.0
    step = (1.0 - beta) * gamma
    out: dict[str, Tensor] = {}
    for key, w in aggregated.items():
        if w.is_floating_point():
            out[key] = w * scale + step * (previous[key].to(w.device) - w)
        else:
            out[key] = w
    return out


def lcl_loss(
    logits: Tensor, labels: Tensor, glob: Tensor, has: Tensor, tau: float, u: Tensor | None
) -> Tensor:
    """Eqs. (2)–(3): InfoNCE of each logit vector against the global prototypes, as
    ``CE([cos(l_i, c̃^j)/U_j/τ]_j, y_i)`` (a stable log-sum-exp) over the classes with a prototype. ``u [C]``
    is the normaliser (``None``: per-batch ``U_j = mean_i ‖l_i − c̃^j‖``, detached). Samples whose class has
    no prototype are dropped; returns 0 if none is left."""
    classes = torch.nonzero(has).flatten()
    keep = has[labels]
    if classes.numel() == 0 or not bool(keep.any()):
        return logits.sum() * 0.0
    anchors, y = logits[keep], labels[keep]
    keys = glob[classes].to(anchors.dtype)
    cos = F.normalize(anchors, dim=1) @ F.normalize(keys, dim=1).T  # [B, P]
    u = numerics.cdist(anchors.detach(), keys).mean(0) + _EPS if u is None else u[classes].to(anchors.dtype)
    remap = torch.full((has.shape[0],), -1, dtype=torch.long, device=labels.device)
    remap[classes] = torch.arange(classes.numel(), device=labels.device)
    return F.cross_entropy(cos / u[None, :] / tau, remap[y])


@ALGORITHMS.register("fedskc")
class FedSKC(Algorithm):
    """FedSKC: logit prototypes, local contrastive learning, discrepancy aggregation, period review."""

    mean_aggregation = False
    vectorizable = False

    class Params(HyperParams):
        m: int = tunable(
            1,
            low=0,
            high=3,
            integer=True,
            ge=0,
            description="M, nearest clients merged in Eq. (1) (source: §IV-A, M=1; search: Fig. 3(b) varies "
            "M, 0 no merging; [0, 3] fedskew's bound)",
        )
        tau: float = tunable(
            0.08,
            low=0.02,
            high=0.2,
            log=True,
            gt=0.0,
            description="LCL temperature τ, Eq. (3) (source: §IV-A, τ=0.08; search: Fig. 3(a) varies τ, "
            "0.01 diverges, flat on [0.07, 0.11]; [0.02, 0.2] log fedskew's bounds)",
        )
        beta: float = Field(
            0.95, ge=0.0, le=1.0, description="GPR momentum β, Eq. (5) (source: §III-B/§IV-A, β=0.95)"
        )
        lcl: bool = Field(True, description="local contrastive learning on (Table V ablation switch)")
        lcl_weight: float = Field(1.0, ge=0.0, description="weight of L_LCL (source: Alg. 1, L_CE + L_LCL)")
        lcl_warmup: int = Field(
            0, ge=0, description="LCL weight min(1, r/warmup) in round r (public code: 100; paper: none, 0)"
        )
        u_mode: Literal["batch", "round", "scalar", "none"] = Field(
            "batch",
            description="U of Eq. (2): per-batch U_j (detached; the paper's per-dataset mean moves with "
            "every step), per-round U_j over D^k with the received model, one per-batch scalar, or none "
            "(pure cosine, the public code)",
        )
        silu_anchor: bool = Field(
            False, description="also apply SiLU to the anchors l_i (ablation; the paper: c_k only)"
        )
        silu_protos: bool = Field(
            True, description="SiLU on the local prototypes (§III-A; off in the public code)"
        )
        gda: bool = Field(True, description="global discrepancy aggregation on (off: FedAvg's n_k/n weights)")
        gda_mode: Literal["literal", "relative"] = Field(
            "literal",
            description="Eq. (4) with raw N_k (literal: uniform weights once N_k > ~37) or the relative size "
            "b_k (the FedDisco form GDA follows)",
        )
        discrepancy: Literal["sum", "per_class"] = Field(
            "sum", description="d_k over the client's classes (public code) or rescaled by C/|present_k|"
        )
        gpr: bool = Field(True, description="global period review on (Table V ablation switch)")
        gpr_form: Literal["literal", "affine"] = Field(
            "affine", description="Eq. (5) as printed (sums to β: shrinks the model) or its sum-to-one form"
        )
        gamma_clip: float | None = Field(
            None, gt=0.0, description="clamp γ_r to [−clip, clip] (an optional safety; not in paper)"
        )

    p: Params

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        c = self.ctx.num_classes
        state = super().init_server(model)
        state.update(
            protos=torch.zeros(c, c, device=self.ctx.device),  # c̃_{r−1}, broadcast to the next round
            has=torch.zeros(c, dtype=torch.bool, device=self.ctx.device),
        )
        return state

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        payload = super().broadcast(server, info)
        if info.cid is not None:
            payload.arrays.update(protos=server["protos"].clone(), has=server["has"].clone())
        return payload

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """Eq. (1) global prototypes, Eq. (4) aggregation weights, Eq. (5) period review (Alg. 1 l. 6–24);
        the GDA weights, γ_r and the clients' loss statistics as metrics."""
        dev = server["protos"].device
        k, c = len(uploads), self.ctx.num_classes
        local = torch.zeros(k, c, c, device=dev)
        present = torch.zeros(k, c, dtype=torch.bool, device=dev)
        for i, u in enumerate(uploads):
            cls = u.payload.arrays["classes"].to(dev)
            local[i, cls] = u.payload.arrays["protos"].to(dev)
            present[i, cls] = True
        glob, has = merge_nearest(local, present, self.p.m)
        glob = torch.where(has[:, None], glob, server["protos"])  # carry absent classes over (not in paper)
        has = has | server["has"]

        n = torch.tensor([float(u.num_samples) for u in uploads], dtype=torch.float64)
        d = discrepancies(local, present, glob, has, self.p.discrepancy == "per_class").cpu()
        fedavg = sample_weights(uploads)
        weights = gda_weights(d, n, self.p.gda_mode) if self.p.gda else fedavg
        states = [u.payload.model_state() for u in uploads]
        new = weighted_average(states, weights)

        common = has & server["has"]
        gamma = float("nan")
        if self.p.gpr and bool(common.any()):  # round 1 has no c̃_{r−1} (Eq. 5 needs it)
            gamma = prototype_variance_change(glob, server["protos"], common)
            if self.p.gamma_clip is not None:
                gamma = max(-self.p.gamma_clip, min(self.p.gamma_clip, gamma))
            new = period_review(new, server["weights"], gamma, self.p.beta, self.p.gpr_form)

        uniform = torch.full_like(weights, 1.0 / k)
        stats = {
            key: sum(u.payload.metrics.get(key, 0.0) for u in uploads) / k for key in ("ce", "lcl", "lcl_u")
        }
        metrics: dict[str, float | list[float]] = {
            "gda_weights": [round(float(w), 6) for w in weights],
            "gda_weight_min": float(weights.min()),
            "gda_weight_max": float(weights.max()),
            "gda_l1_to_fedavg": float((weights - fedavg).abs().sum()),
            "gda_l1_to_uniform": float((weights - uniform).abs().sum()),
            "discrepancy_mean": float(d.mean()),
            "gamma": gamma,
            "proto_norm": float(glob[has].norm(dim=1).mean()) if bool(has.any()) else 0.0,
            "ce_loss": stats["ce"],
            "lcl_loss": stats["lcl"],
            "lcl_u": stats["lcl_u"],
        }
        return ServerUpdate({**server, "weights": new, "protos": glob, "has": has}, metrics)

    # ---------------------------------------------------------------- client
    def lcl_weight(self, round_idx: int) -> float:
        """The weight of L_LCL in round ``round_idx`` (Alg. 1: 1; the public code ramps it up)."""
        if not self.p.lcl:
            return 0.0
        ramp = min(1.0, round_idx / self.p.lcl_warmup) if self.p.lcl_warmup > 0 else 1.0
        return self.p.lcl_weight * ramp

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """The per-round U_j when asked for, and the last epoch's loss sums."""
        model, payload, client = step.model, step.payload, step.client
        dev = client.x.device
        scratch = {
            "ce": torch.zeros((), device=dev),
            "lcl": torch.zeros((), device=dev),
            "u": torch.zeros((), device=dev),
            "n": torch.zeros((), dtype=torch.long),
        }
        # Per-round U_j (Eq. 2 read per round): mean distance of the received model's logits to each c̃^j.
        if self.p.u_mode == "round" and bool(payload.arrays["has"].any()):
            model.eval()
            logits = embed_in_chunks(model, client.x)
            model.train()
            glob = payload.arrays["protos"].to(logits.device)
            scratch["u_round"] = numerics.cdist(self._anchor(logits), glob).mean(0) + _EPS
        return scratch

    def _anchor(self, logits: Tensor) -> Tensor:
        return F.silu(logits) if self.p.silu_anchor else logits

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        payload, scratch = step.payload, step.scratch
        logits = step.model(batch.x)
        ce = F.cross_entropy(logits, batch.y)
        weight = self.lcl_weight(step.info.round)  # the round is given (RoundInfo), never sent
        has = payload.arrays["has"]
        loss = ce
        if batch.last_epoch:
            scratch["ce"].add_(ce.detach() * batch.y.numel())
            scratch["n"].add_(batch.y.numel())
        if weight > 0 and bool(has.any()):
            glob = payload.arrays["protos"]
            anchor = self._anchor(logits)
            u = self._normaliser(anchor, glob, has, scratch)
            lcl = lcl_loss(anchor, batch.y, glob, has, self.p.tau, u)
            loss = ce + weight * lcl
            if batch.last_epoch:
                scratch["lcl"].add_(lcl.detach() * batch.y.numel())
                scratch["u"].add_(u[has].mean().detach() * batch.y.numel())
        return loss

    def _normaliser(self, anchor: Tensor, glob: Tensor, has: Tensor, scratch: Scratch) -> Tensor:
        """``U`` per class, ``[C]`` (Eq. 2, read as ``u_mode`` says)."""
        if self.p.u_mode == "none":
            return torch.ones(glob.shape[0], dtype=anchor.dtype, device=anchor.device)
        if self.p.u_mode == "round":
            return scratch["u_round"]
        dist = numerics.cdist(anchor.detach(), glob.to(anchor.dtype))  # [B, C]
        if self.p.u_mode == "scalar":
            return dist[:, has].mean().expand(glob.shape[0]) + _EPS
        return dist.mean(0) + _EPS

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        model, client, scratch = step.model, step.client, step.scratch
        # An eval-mode pass over the local data with the final model (no augmentation): Algorithm 1 computes
        # c_k after the local epochs; see docs/methods/fedskc.md, "FedSKC: how local prototypes are computed".
        model.eval()
        logits = embed_in_chunks(model, client.x)
        model.train()
        table, counts = structural_knowledge(logits, client.y, self.ctx.num_classes, self.p.silu_protos)
        classes, protos, _ = pack(table, counts)
        n = max(int(scratch["n"]), 1)
        metrics = {"ce": float(scratch["ce"]) / n, "lcl": float(scratch["lcl"]) / n}
        metrics["lcl_u"] = float(scratch["u"]) / n
        tensors = model_arrays(model.state_dict())
        tensors.update(classes=classes, protos=protos.detach().clone())
        return LocalOutput(Payload(arrays=tensors, metrics=metrics), step.state)

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The model it was sent and per class held its structural prototype (over the C logits)."""
        specs = specs_of(broadcast.arrays, lambda k: k not in ("protos", "has"))
        c = self.ctx.num_classes
        specs.update(class_rows(c, names=("classes", ""), protos=(c,)))
        return UploadLayout(specs)
