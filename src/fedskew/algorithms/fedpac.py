"""FedPAC (Xu, Tong, Huang 2023, "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration", ICLR), Algorithm 1.

The model is a shared feature extractor f_θ (the body, averaged by the server as in FedAvg) and a personal
linear head φ_i. In round t client i

1. computes, with the received body θ^(t) and before training, its feature statistics (§4.2): the
   class-conditional means μ_ik, the class shares p_ik = n_ik / n_i and the variance term
   ``V_i = (1/n_i) (mean_l ‖f(x_l)‖² − Σ_k p_ik² ‖μ_ik‖²)``, i.e. the variance of the feature–label product
   f(x) yᵀ divided by n_i (the authors' ``statistics_extraction``);
2. trains the head for ``head_epochs`` with the body frozen, on cross-entropy;
3. trains the body with the head frozen on (§4.1, local-global feature alignment)
   ``CE + λ · (1/(B·d)) Σ_b ‖f(x_b) − c_{y_b}‖²`` against the global prototypes c (none exist in round 1: the
   term is zero, as the code's ``round > 0``; a class without a global prototype uses the client's own
   pre-training class mean, as the code);
4. uploads the body, its head, its local prototypes (class means under the trained body, eval mode)
   with their class counts, and the statistics of step 1.

The server averages the bodies (sample-weighted), the prototypes per class (weighted by class counts) and,
for every uploading client i, solves the quadratic program of §4.2 (Eq. 10–11) over the simplex

    α_i = argmin_{α ≥ 0, Σα = 1}  αᵀ M_i α,   (M_i)_{jl} = Σ_k ⟨h_ik − h_jk, h_ik − h_lk⟩ + δ_jl V_j,
    h_jk = p_jk μ_jk,

(the bias term ‖Σ_j α_j (h_i − h_j)‖²_F plus the variance term Σ_j α_j² V_j), then stores the client's next
head φ̂_i = Σ_j α_ij φ_j. M_i is a Gram matrix plus a non-negative diagonal, so the problem is
convex; it is solved by accelerated projected gradient with restarts (:func:`simplex_qp`; the authors use
cvxpy). A client is sent the body, the global prototypes and its own φ̂_i, and is evaluated with them (the
model it would start its next round from). The alignment term is the authors' ``nn.MSELoss`` (the squared
distance divided by the embedding size d), for which λ = 1 is set; ``distance="squared_l2"`` drops the 1/d,
as the regulariser is printed (‖f(x) − c_y‖²). Options: ``head_lr`` (the code's 0.1), ``combine=false``
(no classifier collaboration: each client keeps its own trained head). docs/decisions.md, "FedPAC: ...".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew import numerics
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    Context,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    Phase,
    RoundInfo,
    ServerTable,
    ServerUpdate,
    State,
    Upload,
    clone_state,
    embedding_dim,
    model_arrays,
    sample_weights,
    server_arrays,
    weighted_average,
)
from fedskew.algorithms.fedper import personal_names
from fedskew.algorithms.helpers import eval_mode, no_global_model
from fedskew.algorithms.layouts import ArraySpec, UploadLayout, class_rows, specs_of
from fedskew.algorithms.protos import aggregate_prototypes, class_means, pack
from fedskew.errors import ConfigError
from fedskew.models.base import FedModel, embed_in_chunks
from fedskew.search_space import tunable

HEAD = "head."  # payload prefix of the personal head


def project_simplex(v: Tensor, allowed: Tensor) -> Tensor:
    """Euclidean projection of each row of ``v [B, m]`` onto the simplex of the entries ``allowed [B, m]``
    (the others are set to 0); every row must allow at least one entry (Duchi et al. 2008, sort-based)."""
    masked = torch.where(allowed, v, torch.full_like(v, float("-inf")))
    u = masked.sort(dim=1, descending=True).values
    valid = torch.isfinite(u)
    u0 = torch.where(valid, u, torch.zeros_like(u))
    css = u0.cumsum(1)
    j = torch.arange(1, v.shape[1] + 1, dtype=v.dtype, device=v.device)
    cond = valid & (u0 - (css - 1.0) / j > 0)
    rho = cond.to(torch.long).cumsum(1).argmax(1, keepdim=True)  # the last index where cond holds
    theta = (css.gather(1, rho) - 1.0) / (rho + 1).to(v.dtype)
    return torch.where(allowed, (v - theta).clamp_min(0.0), torch.zeros_like(v))


def simplex_qp(m: Tensor, allowed: Tensor | None = None, iters: int = 5000, tol: float = 1e-12) -> Tensor:
    """``argmin_α αᵀ M α`` over the probability simplex for each of the ``B`` problems ``m [B, n, n]``
    (symmetric positive semi-definite), restricted to the entries ``allowed [B, n]``.

    Accelerated projected gradient (FISTA, step 1/L with L = 2 λ_max(M)) with adaptive restart (O'Donoghue &
    Candès 2015), in float64, from the uniform weights; stops when no weight moves more than ``tol``."""
    q = m.double()
    b, n = q.shape[0], q.shape[1]
    ok = torch.ones(b, n, dtype=torch.bool, device=q.device) if allowed is None else allowed.to(q.device)
    lip = 2.0 * torch.linalg.eigvalsh(q)[:, -1].clamp_min(1e-300)[:, None]
    x = ok.double() / ok.sum(1, keepdim=True)
    y, t = x, torch.ones(b, 1, dtype=q.dtype, device=q.device)
    for _ in range(iters):
        grad = 2.0 * torch.bmm(q, y[:, :, None])[:, :, 0]
        new = project_simplex(y - grad / lip, ok)
        restart = ((y - new) * (new - x)).sum(1, keepdim=True) > 0
        t_new = (1.0 + numerics.sqrt(1.0 + 4.0 * t * t)) / 2.0
        momentum = torch.where(restart, torch.zeros_like(t), (t - 1.0) / t_new)
        y = new + momentum * (new - x)
        t = torch.where(restart, torch.ones_like(t), t_new)
        done = float((new - x).abs().max()) <= tol
        x = new
        if done:
            break
    return x


def collaboration_matrices(h: Tensor, v: Tensor) -> Tensor:
    """``M [m, m, m]`` of §4.2 (Eq. 10–11): ``M[i, j, l] = ⟨h_i − h_j, h_i − h_l⟩_F + δ_jl v_j`` for the
    clients' statistics ``h [m, C, D]`` (rows p_jk μ_jk) and variance terms ``v [m]`` (via a Gram matrix)."""
    flat = h.reshape(h.shape[0], -1).double()
    g = flat @ flat.T
    d = g.diagonal()
    return d[:, None, None] - g[:, :, None] - g[:, None, :] + g[None] + torch.diag(v.double())[None]


def feature_statistics(z: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Class means ``μ [C, D]`` (float64) and ``V`` (0-d float64) of client features ``z [n, D]`` with labels
    ``y`` (module docstring, step 1); zeros for a client without samples."""
    zd = z.double()
    means, counts = class_means(zd, y, num_classes)
    n = y.shape[0]
    if n == 0:
        return means, torch.zeros((), dtype=torch.float64, device=z.device)
    h = means * (counts.double() / n)[:, None]
    v = (zd.pow(2).sum(1).mean() - h.pow(2).sum()) / n
    return means, v.clamp_min(0.0)


@ALGORITHMS.register("fedpac")
class FedPAC(Algorithm):
    """FedPAC (Xu et al. 2023): prototype-aligned shared body, personal heads combined by the server."""

    mean_aggregation = False  # per-client head combinations

    personalized_eval: ClassVar[bool] = True
    requires_personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        lam: float = tunable(
            1.0,
            low=0.1,
            high=10.0,
            log=True,
            ge=0.0,
            description="λ, weight of the feature-alignment term (§4.1; source: the authors' code, "
            "--lam default 1.0 'for mse_loss'; search: fedskew, [0.1, 10] log)",
        )
        head_epochs: int = Field(
            1, ge=0, description="epochs on the head, body frozen, before the body (Alg. 1; code: 1 epoch)"
        )
        body_epochs: int | None = Field(
            None, ge=0, description="epochs on the body, head frozen (None: client.epochs; code default 5)"
        )
        head_lr: float | None = Field(
            None, gt=0.0, description="learning rate of the head phase (None: client.lr; authors' code: 0.1)"
        )
        distance: Literal["mse", "squared_l2"] = Field(
            "mse",
            description="alignment distance per sample: mean over the embedding of (f(x) − c_y)² (the "
            "authors' nn.MSELoss, for which λ = 1 is set) or its sum ‖f(x) − c_y‖² (§4.1 as printed)",
        )
        combine: bool = Field(
            True, description="classifier collaboration (§4.2); false: each client keeps its own trained head"
        )
        qp_iters: int = Field(5000, ge=1, description="maximum iterations of the simplex QP solver")

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        model = ctx.model_template(None)
        self.dim = embedding_dim(model, self.name)
        self.head_keys = frozenset(personal_names(model, "head"))
        if not self.head_keys or len(self.head_keys) == len(model.state_dict()):
            raise ConfigError("fedpac needs a model with a separate classifier head (see `fedskew list`)")

    def is_head(self, name: str) -> bool:
        return name in self.head_keys

    def is_body(self, name: str) -> bool:
        return name not in self.head_keys

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        sd = clone_state(model.state_dict())
        c = self.ctx.num_classes
        return {
            "weights": {k: v for k, v in sd.items() if self.is_body(k)},
            "head0": {k: v for k, v in sd.items() if self.is_head(k)},  # the initial head
            "heads": ServerTable(),  # a row per client whose next head φ̂_i was computed (else head0)
            "protos": torch.zeros(c, self.dim),
            "present": torch.zeros(c, dtype=torch.bool),
        }

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """The body, the global prototypes that exist (with their class ids) and, for a client, its head."""
        classes = torch.nonzero(server["present"]).flatten()
        arrays = {**server_arrays(server["weights"]), "classes": classes, "protos": server["protos"][classes]}
        if info.cid is not None:
            head = server["heads"].get(info.cid, server["head0"])
            arrays.update({HEAD + k: v.clone() for k, v in head.items()})
        return Payload(arrays=arrays)

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """FedAvg of the bodies, class-count-weighted prototypes, the uploaders' next heads (§4.2)."""
        body = weighted_average([u.payload.model_state() for u in uploads], sample_weights(uploads))
        protos, present, device = server["protos"], server["present"], server["protos"].device
        arr = [u.payload.arrays for u in uploads]
        classes = torch.cat([a["classes"] for a in arr]).to(device)
        if classes.numel():
            local = torch.cat([a["protos"] for a in arr]).to(device, protos.dtype)
            counts = torch.cat([a["counts"] for a in arr]).to(device)
            table, got = aggregate_prototypes(classes, local, counts, self.ctx.num_classes, "weighted")
            protos, present = torch.where(got[:, None], table, protos), present | got
        heads_up = [u.payload.prefixed(HEAD) for u in uploads]
        alpha = self.combination_weights(uploads) if self.p.combine else torch.eye(len(uploads))
        head0, rows = server["head0"], {}
        for i, u in enumerate(uploads):
            new = weighted_average(heads_up, alpha[i])
            rows[u.cid] = {k: new[k].to(v.device, v.dtype) for k, v in head0.items()}
        heads = server["heads"].with_rows(rows)  # the other clients' rows are shared, not copied
        metrics = {
            "alpha_self": float(alpha.diagonal().mean()),
            "alpha_support": float((alpha > 1e-3).sum(1).double().mean()),
            "proto_classes": int(present.sum()),
        }
        state = {**server, "weights": body, "heads": heads, "protos": protos, "present": present}
        return ServerUpdate(state, metrics)

    def combination_weights(self, uploads: list[Upload]) -> Tensor:
        """``α [m, m]`` (row i: the weights of the uploaders' heads in client i's next head), §4.2. A
        client without samples neither contributes to nor receives a combination (α_ii = 1)."""
        m, c = len(uploads), self.ctx.num_classes
        h = torch.zeros(m, c, self.dim, dtype=torch.float64)
        v = torch.zeros(m, dtype=torch.float64)
        for j, u in enumerate(uploads):
            a = u.payload.arrays
            counts = a["counts"].cpu().double()
            if counts.numel():
                share = counts / counts.sum()
                h[j, a["classes"].cpu()] = a["stat_means"].cpu().double() * share[:, None]
            v[j] = a["stat_v"].cpu().double().reshape(())
        has = torch.tensor([u.num_samples > 0 for u in uploads])
        allowed = torch.where(has[:, None], has[None, :].expand(m, m), torch.eye(m, dtype=torch.bool))
        return simplex_qp(collaboration_matrices(h, v), allowed, self.p.qp_iters)

    # ---------------------------------------------------------------- client
    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None:
            raise no_global_model(self.name, "head")
        return {**payload.model_state(), **payload.prefixed(HEAD)}

    def _features(self, model: nn.Module, x: Tensor) -> Tensor:
        with eval_mode(model):
            return embed_in_chunks(cast(FedModel, model).features, x)

    def start_local(self, step: LocalStep) -> LocalPlan:
        """Statistics under the received body (before training), then the head phase and the body phase."""
        z = self._features(step.model, step.client.x)
        means, v = feature_statistics(z, step.client.y, self.ctx.num_classes)
        lr = self.ctx.client.lr
        body = self.ctx.client.epochs if self.p.body_epochs is None else self.p.body_epochs
        phases = [
            Phase(self.p.head_epochs, self.p.head_lr or lr, trainable=self.is_head),
            Phase(body, lr, trainable=self.is_body),
        ]
        return LocalPlan(phases, derived={"stat_means": means, "stat_v": v})

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """Alignment targets ``[C, D]``: the global prototype, else the client's pre-training class mean;
        ``on [C]``: 1 once any global prototype exists (round 1 trains on cross-entropy only)."""
        device = step.client.x.device
        classes = step.payload.arrays["classes"].to(device)
        targets = step.derived["stat_means"].to(device, torch.float32).clone()
        targets[classes] = step.payload.arrays["protos"].to(device, torch.float32)
        on = torch.full((self.ctx.num_classes,), float(classes.numel() > 0), device=device)
        return {"targets": targets, "on": on}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        model = cast(FedModel, step.model)
        h = model.features(batch.x)
        loss = F.cross_entropy(model.head(h), batch.y)
        if self.p.lam > 0:  # no gradient reaches the head: it only moves the body (the head phase freezes it)
            sq = (h - step.scratch["targets"][batch.y].to(h.dtype)).pow(2)
            dist = sq.mean(1) if self.p.distance == "mse" else sq.sum(1)
            loss = loss + self.p.lam * (step.scratch["on"][batch.y].to(h.dtype) * dist).mean()
        return loss

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload: body, head, prototypes under the trained body (eval mode) with class counts, and
        the pre-training statistics (class means of the held classes, V)."""
        model, client = step.model, step.client
        table, counts = class_means(self._features(model, client.x), client.y, self.ctx.num_classes)
        classes, protos, counts = pack(table, counts)
        sd = model.state_dict()
        arrays = model_arrays(sd, self.is_body)
        arrays.update({HEAD + k: v.detach().clone() for k, v in sd.items() if self.is_head(k)})
        arrays.update(
            classes=classes,
            protos=protos.detach().clone(),
            counts=counts,
            stat_means=step.derived["stat_means"][classes].to(torch.float32),
            stat_v=step.derived["stat_v"].reshape(1).to(torch.float32),
        )
        return LocalOutput(Payload(arrays=arrays), step.state)

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The body and head it was sent; per class held a prototype, its count and the statistics' class
        mean; V."""
        specs = specs_of(broadcast.arrays, lambda k: k not in ("classes", "protos"))
        specs.update(class_rows(self.ctx.num_classes, protos=(self.dim,), stat_means=(self.dim,)))
        specs["stat_v"] = ArraySpec((1,), torch.float32)
        return UploadLayout(specs)


__all__ = ["FedPAC", "collaboration_matrices", "feature_statistics", "project_simplex", "simplex_qp"]
