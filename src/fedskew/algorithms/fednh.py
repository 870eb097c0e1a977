"""FedNH (Dai, Chen, Li, Heinecke, Sun, Xu, "Tackling Data Heterogeneity in Federated Learning with Class
Prototypes", AAAI 2023; arXiv:2212.02758; reference code ``Yutong-Dai/FedNH``, ``strategies/FedNH.py``).

The classifier is a table of C class prototypes ``μ_c`` on the unit hypersphere of the embedding space, owned
by the server and never trained by clients:

* **Uniformity** (the paper's first ingredient; code ``FedUHClient._initialize_model``): the server
  initialises the prototypes spread uniformly on the unit sphere (maximally separated) and clients keep
  them **fixed** during local training, so every client optimises against the same, balanced classifier.
* **Client logits** (cosine classifier): ``ℓ_c(x) = s · cos(f(x), μ_c) = s · ⟨f(x)/‖f(x)‖, μ_c/‖μ_c‖⟩``
  with a scale ``s`` that is a trainable parameter (code: ``scaling``, initialised to 1.0 in the CIFAR CNN,
  20.0 in the ResNet; ``FedNH_fix_scaling: False``). Local training minimises cross-entropy of ``ℓ`` over
  the feature extractor (and ``s``); the prototypes and the model's own linear head are frozen.
* **Client statistics** (*semantics*; code ``_estimate_prototype``): after training, an eval-mode pass over
  the local data gives, per held class c, the mean of the *normalised* embeddings
  ``μ_{k,c} = (1/n_{k,c}) Σ_{i: y_i=c} f(x_i)/‖f(x_i)‖``, re-normalised to unit length (code), uploaded
  with ``n_{k,c}``.
* **Semantics infusion** (server; code ``FedNHServer.aggregate``):
  ``μ̄_c = normalise(Σ_k n_{k,c} μ_{k,c} / Σ_k n_{k,c})`` over the participants holding c, then
  ``μ_c ← normalise(ρ μ_c + (1 − ρ) μ̄_c)`` with the smoothing ``ρ = 0.9`` (code ``FedNH_smoothing``).
  Classes no participant holds keep their prototype. ``ρ = 1`` never moves the prototypes (uniformity
  only: the code's ``FedUH``).
* **Body** aggregation: FedAvg over the non-head model state (and ``s``).
* **Prediction** (global model): ``argmax_c cos(f(x), μ_c)`` — reported through the ``logits`` head
  ``s · cos``, which has the same argmax for ``s > 0`` (``s`` is logged every round).

The paper's full text was not retrievable here, so no equation numbers are cited: every rule above is
taken from the authors' reference code (function named) and matches the paper's two ingredients
(uniformity, semantics) as described in its abstract. Choices and deviations (see ``docs/algorithms.md``):

* The prototypes and ``s`` live in the server state and the payload, not in the model; the model's own head
  (``model.head_prefix``) is never trained, sent, nor aggregated (it keeps its initial weights). ``s`` is
  attached to the reused model instance as the parameter ``fednh_scale`` only so that the engine's SGD
  trains it with the body (same lr, momentum, weight decay, as in the code's single optimizer).
* ``init=orthogonal`` (code ``FedNH_head_init: orthogonal``): C random orthonormal rows (pairwise cosine 0),
  which needs ``C ≤ d``; for ``C > d`` (or ``init=optimized``) we minimise a smooth maximum of the pairwise
  cosines on the sphere (:func:`uniform_prototypes`), which reaches the regular simplex (cosine
  ``−1/(C−1)``) when ``C ≤ d + 1`` and, e.g., the regular C-gon for ``d = 2``.
* ``body_weights=samples`` (fedskew's FedAvg, so FedNH and FedAvg differ only by the method); the authors'
  code averages uniformly over participants (``uniform``).
* ``normalize_means=True`` (code) re-normalises each client mean and the server mean before smoothing;
  ``False`` smooths towards the raw count-weighted mean of normalised embeddings (the plain formula).
* The code clips local gradients to norm 10 (in FedAvg too); the engine's SGD does not clip.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    Context,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    Phase,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    embedding_dim,
    model_arrays,
    sample_weights,
    weighted_average,
)
from fedskew.algorithms.helpers import eval_mode
from fedskew.algorithms.layouts import UploadLayout, class_rows, specs_of
from fedskew.algorithms.protos import aggregate_prototypes, class_means, pack
from fedskew.models.base import FedModel, embed_in_chunks
from fedskew.search_space import tunable
from fedskew.seeding import derive_seed

#: name of the scale parameter attached to the model for local training
SCALE = "fednh_scale"
#: seed key of the prototype initialisation (independent of the model's initial weights)
INIT_KEY = 0xF3D7
#: smooth-max temperature, steps and step size of the ``optimized`` initialisation
_OPT_TEMPERATURE, _OPT_STEPS, _OPT_LR = 10.0, 1000, 0.1


def max_pairwise_cosine(protos: Tensor) -> float:
    """``max_{i≠j} cos(μ_i, μ_j)`` of a ``[C, D]`` table (``-1`` for a single prototype)."""
    if protos.shape[0] < 2:
        return -1.0
    u = F.normalize(protos.double(), dim=1)
    eye = torch.eye(protos.shape[0], dtype=torch.bool, device=protos.device)
    return float((u @ u.T).masked_fill(eye, -2.0).max())


def uniform_prototypes(
    num_classes: int, dim: int, generator: torch.Generator, method: str = "orthogonal"
) -> Tensor:
    """``[C, D]`` unit-norm class prototypes spread over the sphere (FedNH *uniformity*), in float32.

    ``orthogonal`` (the code): C random orthonormal rows (QR of a Gaussian ``D × C`` matrix, sign-corrected
    so that the draw is Haar-uniform); requires ``C ≤ D``, otherwise falls back to ``optimized``.
    ``optimized``: from Gaussian rows, projected SGD (momentum 0.9) on the smooth maximum
    ``(1/t) log Σ_{i≠j} exp(t · cos(μ_i, μ_j))`` (t = 10), re-normalising after every step — a
    max-separation (Tammes) relaxation in the spirit of Mettes et al. 2019.
    """
    if method not in ("orthogonal", "optimized"):
        raise ValueError(f"prototype init must be orthogonal or optimized, got {method!r}")
    g = torch.randn(dim, num_classes, generator=generator, dtype=torch.float64)
    if method == "orthogonal" and num_classes <= dim:
        q, r = torch.linalg.qr(g)  # q [D, C] with orthonormal columns
        q = q * torch.sign(torch.diagonal(r))[None]
        return q.T.contiguous().float()
    w = F.normalize(g.T.contiguous(), dim=1).requires_grad_(True)
    eye = torch.eye(num_classes, dtype=torch.bool)
    opt = torch.optim.SGD([w], lr=_OPT_LR, momentum=0.9)
    for _ in range(_OPT_STEPS):
        u = F.normalize(w, dim=1)
        cos = (u @ u.T).masked_fill(eye, -2.0)
        loss = numerics.logsumexp(_OPT_TEMPERATURE * cos.flatten(), 0) / _OPT_TEMPERATURE
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            w.copy_(F.normalize(w, dim=1))
    return F.normalize(w.detach(), dim=1).float()


def cosine_logits(z: Tensor, protos: Tensor, scale: Tensor | float) -> Tensor:
    """FedNH's classifier: ``s · cos(z_b, μ_c)`` as ``[B, C]`` for embeddings ``z [B, D]``, prototypes
    ``[C, D]`` (normalised here, so any non-zero norm works) and the scale ``s``."""
    return scale * (F.normalize(z, dim=1) @ F.normalize(protos.to(z.dtype), dim=1).T)


def infuse_semantics(
    protos: Tensor,
    classes: Tensor,
    means: Tensor,
    counts: Tensor,
    rho: float,
    normalize_means: bool = True,
) -> tuple[Tensor, Tensor]:
    """The server's semantics infusion: ``μ_c ← normalise(ρ μ_c + (1−ρ) μ̄_c)`` for every class c some
    upload holds, ``μ̄_c = Σ_k n_{k,c} μ_{k,c} / Σ_k n_{k,c}`` (normalised first when ``normalize_means``).

    ``protos [C, D]`` current global prototypes; ``classes [P]``, ``means [P, D]``, ``counts [P]`` the
    concatenated uploads (one row per (client, class)). Returns ``(new prototypes [C, D], updated [C] bool)``;
    classes without uploads keep their prototype unchanged.
    """
    c = protos.shape[0]
    target, present = aggregate_prototypes(classes, means.to(protos.dtype), counts, c, "weighted")
    if normalize_means:
        target = F.normalize(target, dim=1)
    mixed = F.normalize(rho * protos + (1.0 - rho) * target, dim=1)
    return torch.where(present[:, None], mixed, protos), present


@ALGORITHMS.register("fednh")
class FedNH(Algorithm):
    """FedNH (Dai et al. 2023): fixed, uniformly initialised class prototypes as a cosine classifier, updated
    on the server by smoothing towards the clients' class means of normalised embeddings."""

    mean_aggregation = False  # class prototypes smoothed on the server
    vectorizable = False

    class Params(HyperParams):
        rho: float = tunable(
            0.9,
            low=0.5,
            high=1.0,
            ge=0.0,
            le=1.0,
            description="smoothing ρ of the semantics infusion μ_c ← ρ μ_c + (1−ρ) μ̄_c (source: code "
            "FedNH_smoothing=0.9, main.py and experiment yamls); 1 keeps the initial prototypes (FedUH) "
            "(search: fedskew, [0.5, 1])",
        )
        scale_init: float = Field(
            1.0,
            gt=0.0,
            description="initial scale s of the cosine logits s·cos(z, μ_c) (source: code, Conv2CifarNH "
            "scaling=1.0; its ResNet uses 20)",
        )
        learn_scale: bool = Field(
            True,
            description="train s locally and average it with the body (source: code "
            "FedNH_fix_scaling=False); False keeps s = scale_init",
        )
        init: Literal["orthogonal", "optimized"] = Field(
            "orthogonal",
            description="prototype initialisation: random orthonormal rows (code FedNH_head_init, needs "
            "C ≤ d, else optimized) or minimised maximum pairwise cosine (paper's uniformity objective)",
        )
        normalize_means: bool = Field(
            True,
            description="re-normalise each client class mean and the server's weighted mean before "
            "smoothing (source: code _estimate_prototype / aggregate); False: raw weighted mean",
        )
        body_weights: Literal["samples", "uniform"] = Field(
            "samples",
            description="body (and s) average: by local sample counts (fedskew FedAvg) or uniform over "
            "participants (authors' code)",
        )

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        #: head entries of the model (never trained, sent or aggregated), from the global architecture
        self.head_prefix = str(getattr(ctx.model_template(None), "head_prefix", FedModel.head_prefix))

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Every model the runtime builds gets the trainable scale s of the cosine logits."""
        if not isinstance(getattr(model, SCALE, None), nn.Parameter):
            device = next(model.parameters()).device
            model.register_parameter(SCALE, nn.Parameter(torch.ones(1, device=device)))
        return model

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        dim = embedding_dim(model, self.name)
        gen = torch.Generator().manual_seed(derive_seed(self.ctx.seed, INIT_KEY))
        protos = uniform_prototypes(self.ctx.num_classes, dim, gen, self.p.init).to(self.ctx.device)
        return {
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items() if k != SCALE},
            "protos": protos,
            "scale": torch.tensor([self.p.scale_init], device=self.ctx.device),
        }

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """The body (the model state without its head), the global prototypes and the scale s."""
        body = {k: v for k, v in server["weights"].items() if not self._is_head(k)}
        tensors = model_arrays(body)
        tensors["protos"] = server["protos"].clone()
        tensors["scale"] = server["scale"].clone()
        return Payload(arrays=tensors)

    def _is_head(self, name: str) -> bool:
        """Whether a state entry belongs to the model's (unused) head, by the model's ``head_prefix``."""
        return name.startswith(self.head_prefix)

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """FedAvg of the body (and s); semantics infusion of the prototypes (see :func:`infuse_semantics`).
        Metrics: s, how far and how many prototypes moved, and their largest pairwise cosine."""
        if self.p.body_weights == "samples":
            w = sample_weights(uploads)
        else:
            w = torch.full((len(uploads),), 1.0 / len(uploads), dtype=torch.float64)
        body = weighted_average([u.payload.model_state() for u in uploads], w)
        weights = {**server["weights"], **{k: v.to(server["weights"][k].device) for k, v in body.items()}}
        scale = server["scale"]
        if self.p.learn_scale:
            scales = torch.stack([u.payload.arrays["scale"].to(server["scale"]) for u in uploads])
            scale = (w.to(scales)[:, None] * scales).sum(0)
        dev = server["protos"].device
        classes = torch.cat([u.payload.arrays["classes"] for u in uploads]).to(dev)
        means = torch.cat([u.payload.arrays["protos"] for u in uploads]).to(dev)
        counts = torch.cat([u.payload.arrays["counts"] for u in uploads]).to(dev)
        old = server["protos"]
        new, updated = infuse_semantics(old, classes, means, counts, self.p.rho, self.p.normalize_means)
        # diagnostic: mean angle (degrees) the updated prototypes moved this round
        cos = (old[updated] * new[updated]).sum(1).clamp(-1.0, 1.0)
        shift = float(torch.rad2deg(numerics.acos(cos)).mean()) if bool(updated.any()) else 0.0
        metrics = {
            "fednh_scale": float(scale.reshape(-1)[0]),
            "proto_shift_deg": shift,
            "proto_updated": int(updated.sum()),
            "proto_max_cos": max_pairwise_cosine(new),
        }
        return ServerUpdate({**server, "weights": weights, "scale": scale, "protos": new}, metrics)

    # ---------------------------------------------------------------- client
    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The received body and scale s (the model's own head is never loaded: it is unused)."""
        return {**payload.model_state(), SCALE: payload.arrays["scale"].reshape(1)}

    def start_local(self, step: LocalStep) -> LocalPlan:
        learn = self.p.learn_scale

        def trainable(name: str) -> bool:
            # the prototypes are not model parameters; the model's own head is frozen and unused
            return learn if name == SCALE else not self._is_head(name)

        return LocalPlan([Phase(self.ctx.client.epochs, self.ctx.client.lr, trainable=trainable)])

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        return {"protos": step.payload.arrays["protos"].to(step.client.x.device)}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        z = cast(FedModel, step.model).features(batch.x)
        return F.cross_entropy(cosine_logits(z, step.scratch["protos"], getattr(step.model, SCALE)), batch.y)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload: body, s, and per held class the mean normalised embedding (eval-mode pass after
        training, as the code) with its count."""
        model, client = step.model, step.client
        with eval_mode(model):
            z = F.normalize(embed_in_chunks(cast(FedModel, model).features, client.x), dim=1)
        table, counts = class_means(z, client.y, self.ctx.num_classes)
        if self.p.normalize_means:
            table = F.normalize(table, dim=1)
        classes, means, counts = pack(table, counts)
        tensors = model_arrays(model.state_dict(), lambda k: k != SCALE and not self._is_head(k))
        tensors.update(
            scale=getattr(model, SCALE).detach().clone(),
            classes=classes,
            protos=means.detach().clone(),
            counts=counts,
        )
        return LocalOutput(Payload(arrays=tensors), step.state)

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The body and s it was sent, and per class held a prototype with its count."""
        specs = specs_of(broadcast.arrays, lambda k: k != "protos")
        protos = broadcast.arrays["protos"]
        specs.update(class_rows(self.ctx.num_classes, dtype=protos.dtype, protos=(protos.shape[1],)))
        return UploadLayout(specs)

    # ---------------------------------------------------------------- evaluation
    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        """``logits = s · cos(f(x), μ_c)``: its argmax is the nearest global prototype in angle."""
        z = cast(FedModel, model).features(x)
        scale = payload.arrays["scale"].to(z.device)
        return {"logits": cosine_logits(z, payload.arrays["protos"].to(z.device), scale)}
