"""CCVR (Luo, Chen, Hu, Zhang, Liang, Feng 2021, "No Fear of Heterogeneity: Classifier Calibration for
Federated Learning with Non-IID Data", NeurIPS), §4 Eqs. (2)–(4).

Training is FedAvg's. Classifier calibration with virtual representations: under the *global* model's
feature extractor each client computes, per class c it holds, the mean μ_{c,k}, the unbiased covariance
Σ_{c,k} and the count N_{c,k} of its features (Eq. 2), and the server pools them into the global class
statistics (Eqs. 3–4; :func:`combine_statistics`)

    μ_c = Σ_k N_{c,k}/N_c μ_{c,k},
    Σ_c = Σ_k (N_{c,k}−1)/(N_c−1) Σ_{c,k} + Σ_k N_{c,k}/(N_c−1) μ_{c,k}μ_{c,k}ᵀ − N_c/(N_c−1) μ_cμ_cᵀ,

which equal the mean and unbiased covariance of the pooled features exactly. It samples M_c virtual features
per class from N(μ_c, Σ_c) and retrains the head (cross-entropy, SGD) on them, the body unchanged.

Per-round design (the paper calibrates once, after training; docs/decisions.md "CCVR: calibration in a
per-round framework"): in round t a client computes its statistics with the received w^t in
``start_local`` (before training, the model unchanged) and uploads them beside its trained model; the
server aggregates w^{t+1} by FedAvg (the training trajectory is FedAvg's, as in the paper) and keeps
``calibrated`` = w^t with the head retrained on virtual features. Global evaluation uses ``calibrated``, so
the evaluated model lags the trajectory by one round. ``calibrate="final"`` computes and uploads statistics
only in the last round (the paper's one-shot calibration of the model the statistics see); earlier rounds
evaluate the FedAvg model. Statistics come from the round's participants (the paper: every client).

Edge cases: a client's class with one sample has Σ_{c,k} = 0 (its weight N_{c,k}−1 in Eq. 4 is zero, so
any value gives the same Σ_c); a class with N_c = 1 overall gets Σ_c = 0 (its virtual features are its
mean). Σ_c may be singular (fewer samples than dimensions): sampling uses its symmetric square root.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedskew import numerics
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
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    embedding_dim,
    model_arrays,
    sample_weights,
    server_arrays,
    weighted_average,
)
from fedskew.algorithms.helpers import eval_mode, frozen
from fedskew.algorithms.layouts import UploadLayout, class_rows, specs_of, template
from fedskew.models.base import FedModel, HeadView, embed_in_chunks

#: ``RoundInfo.generator`` key of the server's virtual-feature stream
VIRTUAL_KEY = 81
STAT_KEYS = ("stat_classes", "stat_means", "stat_covs", "stat_counts")


def class_statistics(z: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eq. (2) for the classes present in ``(z [N, d], y [N])``: ``(classes [P], means [P, d],
    covs [P, d, d], counts [P])``, covariances unbiased (denominator N_{c,k}−1; zero for one sample);
    computed in float64, returned in ``z``'s dtype."""
    z64 = z.double()
    counts = torch.bincount(y, minlength=num_classes)
    classes = torch.nonzero(counts).flatten()
    means, covs = [], []
    for c in classes.tolist():  # one matrix product per class held (not per sample)
        zc = z64[y == c]
        mu = zc.mean(0)
        centered = zc - mu
        covs.append(centered.T @ centered / max(zc.shape[0] - 1, 1))
        means.append(mu)
    d = z.shape[1]
    if not means:
        return classes, z.new_zeros((0, d)), z.new_zeros((0, d, d)), counts[classes]
    return classes, torch.stack(means).to(z.dtype), torch.stack(covs).to(z.dtype), counts[classes]


def combine_statistics(
    classes: Tensor, means: Tensor, covs: Tensor, counts: Tensor, num_classes: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Eqs. (3)–(4) over the uploaded rows (any number per class): ``(μ [C, d], Σ [C, d, d], N [C])`` in
    float64; classes without samples get zeros, classes with N_c = 1 get Σ_c = 0."""
    d = means.shape[1]
    n_k = counts.double()
    mu_k, cov_k = means.double(), covs.double()
    n = torch.zeros(num_classes, dtype=torch.float64).index_add(0, classes, n_k)
    mu = torch.zeros(num_classes, d, dtype=torch.float64).index_add(0, classes, n_k[:, None] * mu_k)
    mu = mu / n.clamp_min(1.0)[:, None]
    outer_k = mu_k[:, :, None] * mu_k[:, None, :]
    terms = (n_k - 1).clamp_min(0.0)[:, None, None] * cov_k + n_k[:, None, None] * outer_k
    scatter = torch.zeros(num_classes, d, d, dtype=torch.float64).index_add(0, classes, terms)
    scatter = scatter - n[:, None, None] * (mu[:, :, None] * mu[:, None, :])
    sigma = torch.where((n > 1)[:, None, None], scatter / (n - 1).clamp_min(1.0)[:, None, None], 0.0)
    return mu, sigma, n


def sample_virtual(
    mu: Tensor, sigma: Tensor, sizes: list[int], gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``sizes[c]`` draws from N(μ_c, Σ_c) per class (float64): ``(features [M, d], labels [M])``, with
    Σ_c's symmetric square root (Σ_c may be singular)."""
    evals, evecs = torch.linalg.eigh(0.5 * (sigma + sigma.transpose(1, 2)))
    roots = evecs * numerics.sqrt(evals.clamp_min(0.0))[:, None, :]  # Σ_c = root root^T
    feats, labels = [], []
    for c, m in enumerate(sizes):
        if m == 0:
            continue
        eps = torch.randn(m, mu.shape[1], generator=gen, dtype=torch.float64)
        feats.append(mu[c] + eps @ roots[c].T)
        labels.append(torch.full((m,), c, dtype=torch.long))
    return torch.cat(feats), torch.cat(labels)


def retrain_head(
    view: nn.Module,
    head: dict[str, Tensor],
    feats: Tensor,
    labels: Tensor,
    schedule: tuple[int, int, float],
    gen: torch.Generator,
) -> tuple[dict[str, Tensor], float]:
    """Mini-batch SGD on cross-entropy of ``view`` (head weights ``head``, keys as ``view`` names them) over
    the virtual set; ``schedule = (epochs, batch_size, lr)``. Returns the new weights and the last epoch's
    mean loss."""
    epochs, batch_size, lr = schedule
    params = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in head.items()}
    trained = [k for k, v in params.items() if v.requires_grad]
    last = float("nan")
    for _ in range(epochs):
        perm = torch.randperm(labels.shape[0], generator=gen).to(feats.device)
        total = 0.0
        for s in range(0, perm.shape[0], batch_size):
            idx = perm[s : s + batch_size]
            loss = F.cross_entropy(functional_call(view, params, (feats[idx],)), labels[idx])
            grads = torch.autograd.grad(loss, [params[k] for k in trained])
            for k, g in zip(trained, grads, strict=True):
                params[k] = (params[k] - lr * g).detach().requires_grad_()
            total += float(loss.detach()) * idx.shape[0]
        last = total / perm.shape[0]
    return {k: v.detach() for k, v in params.items()}, last


@ALGORITHMS.register("ccvr")
class CCVR(Algorithm):
    """CCVR (Luo et al. 2021): FedAvg, with the head calibrated on virtual features from class Gaussians."""

    mean_aggregation = False  # FedAvg, then a head calibrated on uploaded class statistics

    class Params(HyperParams):
        virtual_per_class: int = Field(
            200,
            ge=1,
            description="M_c, virtual features per class (§4 leaves M_c free; 200 as FL-bench's "
            "reimplementation, the authors released no code)",
        )
        allocation: Literal["uniform", "proportional"] = Field(
            "uniform",
            description="M_c = virtual_per_class, or C·virtual_per_class·N_c/N (§4: M_c 'could be "
            "determined by the fraction N_c/N')",
        )
        calibration_epochs: int = Field(1, ge=1, description="passes over the virtual set (FL-bench: 1)")
        calibration_lr: float | None = Field(None, gt=0.0, description="SGD lr (None: client.lr)")
        calibration_batch_size: int | None = Field(None, ge=1, description="None: client.batch_size")
        calibrate: Literal["every_round", "final"] = Field(
            "every_round",
            description="calibrate the received model every round (evaluation lags one round) or only in "
            "the last round (the paper's post-training calibration)",
        )

    p: Params
    #: a global-architecture model whose head is evaluated functionally during calibration
    working_buffers = frozenset({"head_nets"})

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        self.head_nets: dict[Hashable, nn.Module] = {}

    def prepare_model(self, model: nn.Module) -> nn.Module:
        embedding_dim(model, self.name)  # a one-line error for a model without features()
        return model

    def calibrates(self, round_idx: int) -> bool:
        return self.p.calibrate == "every_round" or round_idx == self.ctx.rounds

    # ---------------------------------------------------------------- client
    def start_local(self, step: LocalStep) -> LocalPlan:
        """Eq. (2) under the received global model (eval mode, before training): ``derived["stats"]``."""
        plan = super().start_local(step)
        if not self.calibrates(step.info.round):
            return plan
        model, client = step.model, step.client
        with eval_mode(model):
            z = embed_in_chunks(cast(FedModel, model).features, client.x)
        stats = class_statistics(z.flatten(1), client.y, self.ctx.num_classes)
        return LocalPlan(plan.phases, derived={"stats": stats})

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        upload = Payload(arrays=model_arrays(step.model.state_dict()))
        if "stats" in step.derived:  # the statistics beside the model (class ids and counts: integers)
            stats = zip(STAT_KEYS, step.derived["stats"], strict=True)
            upload.arrays.update({k: v.detach().clone() for k, v in stats})
        return LocalOutput(upload, step.state)

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The model it was sent and, in a calibrating round, Eq. (2)'s statistics of the classes held."""
        specs = specs_of(broadcast.arrays)
        if self.calibrates(info.round):
            d = embedding_dim(template(self.ctx, info.cid), self.name)
            names = ("stat_classes", "stat_counts")
            specs.update(class_rows(self.ctx.num_classes, names=names, stat_means=(d,), stat_covs=(d, d)))
        return UploadLayout(specs)

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        server["calibrated"] = server["weights"]  # nothing calibrated yet: evaluate the global model
        return server

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """Training clients get the trajectory's model, global evaluation (``cid=None``) the calibrated."""
        weights = server["calibrated"] if info.cid is None else server["weights"]
        return Payload(arrays=server_arrays(weights))

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """FedAvg for w^{t+1}; the received w^t calibrated on the pooled statistics (falls back to w^{t+1}
        when no statistics arrived)."""
        weights = weighted_average([u.payload.model_state() for u in uploads], sample_weights(uploads))
        rows = [u.payload.arrays for u in uploads if STAT_KEYS[0] in u.payload.arrays]
        if not rows or sum(int(r["stat_counts"].sum()) for r in rows) == 0:
            return ServerUpdate({**server, "weights": weights, "calibrated": weights})
        classes, means, covs, counts = (torch.cat([r[k].cpu() for r in rows]) for k in STAT_KEYS)
        mu, sigma, n = combine_statistics(classes, means, covs, counts, self.ctx.num_classes)
        calibrated, loss = self.calibrated(server["weights"], mu, sigma, n, info)
        metrics = {"calibration_loss": loss, "calibration_classes": int((n > 0).sum())}
        return ServerUpdate({**server, "weights": weights, "calibrated": calibrated}, metrics)

    def virtual_sizes(self, n: Tensor) -> list[int]:
        """M_c per class (0 for a class without samples)."""
        m = self.p.virtual_per_class
        if self.p.allocation == "uniform":
            return [m if float(c) > 0 else 0 for c in n]
        share = n / n.sum() * (m * n.shape[0])
        return [int(v) for v in share.round().long()]

    def head_net(self) -> nn.Module:
        if None not in self.head_nets:
            with torch.random.fork_rng(devices=[]):  # never touch the global stream
                model = self.ctx.build_model(None).to(self.ctx.device)
            self.head_nets[None] = frozen(model)
        return self.head_nets[None]

    def calibrated(
        self, weights: dict[str, Tensor], mu: Tensor, sigma: Tensor, n: Tensor, info: RoundInfo
    ) -> tuple[dict[str, Tensor], float]:
        """``weights`` with the head retrained on virtual features from N(μ_c, Σ_c); the last epoch's loss."""
        model = cast(FedModel, self.head_net())
        gen = info.generator(VIRTUAL_KEY)
        feats, labels = sample_virtual(mu, sigma, self.virtual_sizes(n), gen)
        device = self.ctx.device
        head_keys = [k for k, v in weights.items() if model.is_head(k)]
        head = {"model." + k: weights[k].to(device) for k in head_keys}
        client = self.ctx.client
        schedule = (
            self.p.calibration_epochs,
            self.p.calibration_batch_size or client.batch_size,
            self.p.calibration_lr or client.lr,
        )
        feats = feats.to(device, next(iter(head.values())).dtype)
        new, loss = retrain_head(HeadView(model), head, feats, labels.to(device), schedule, gen)
        out = dict(weights)
        out.update({k: new["model." + k].to(weights[k].device) for k in head_keys})
        return out, loss


__all__ = ["CCVR", "class_statistics", "combine_statistics", "retrain_head", "sample_virtual"]
