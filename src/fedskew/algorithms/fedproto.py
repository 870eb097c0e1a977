"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022).

Clients never share weights. Each keeps a private model ``F_i = g_i ∘ f_i`` (any architecture with the common
embedding size d_c) across rounds and trains it on

    L = L_S(F_i(x), y) + λ · L_R,   L_R = (1/(B·d_c)) Σ_b 1[C̄^(y_b) exists] ‖f_i(x_b) − C̄^(y_b)‖²   (Eq. 7–8)

— the per-sample MSE of the authors' code (the appendix's per-sample form), against the detached global
prototypes of the client's classes. It uploads one prototype per class it holds (Eq. 3, the mean
embedding), and the server averages them class by class over the clients holding each class (Eq. 6, with
one normalisation only: the printed formula applies two). Inference (Eq. 4) labels a sample with its
nearest global prototype among the client's own classes (as the authors' code does); the classifier ``g_i``
is recorded as a second head (``accuracy_logits``).

Options, defaults first (the reasons are in docs/decisions.md, "FedProto: ..." entries):

* ``aggregation``: ``weighted`` by per-class sample counts or ``mean`` (the authors' code);
* ``proto_source``: ``last_epoch`` (train-mode embeddings collected while training the last local epoch,
  Algorithm 1 and the code) or ``recompute`` (an eval-mode pass over the local data after training);
* ``regularizer``: ``sample`` (per-sample MSE, the code; λ=1/1/0.1 are calibrated for it) or ``prototype``
  (``Σ_j (n_j/B)·mean_d (h̄_j − C̄_j)²`` over the batch's classes: the prototype-level distance of Eq. 8,
  i.e. the sample form minus its within-class scatter term; an ablation);
* ``eval_classes``: ``own`` (the client's classes, the code) or ``all`` (every global prototype).

Round 1 starts from an empty prototype set, not zero vectors (Algorithm 1 line 1 leaves it open; see
docs/methods/fedproto.md, "FedProto: initial global prototypes"), so it is pure cross-entropy training; with
λ = 0 FedProto is exactly :mod:`local`. Classes absent from a round's uploads (partial participation) keep
their previous global prototype. Differences from the code: no ``drop_last`` (the engine drops only a
trailing batch of one), exclusion by +∞ distance rather than the code's sentinel 100.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    clone_state,
    embedding_dim,
)
from fedskew.algorithms.helpers import eval_mode, no_global_model
from fedskew.algorithms.layouts import UploadLayout, class_rows
from fedskew.algorithms.protos import (
    ClassAccumulator,
    aggregate_prototypes,
    class_means,
    nearest_prototype_scores,
    pack,
)
from fedskew.models.base import FedModel, embed_in_chunks
from fedskew.search_space import tunable


def prototype_regularizer(h: Tensor, y: Tensor, targets: Tensor, has: Tensor, form: str = "sample") -> Tensor:
    """L_R of Eq. (8) on a batch: ``h [B, D]`` embeddings, ``targets [C, D]`` global prototypes (detached),
    ``has [C]`` which exist.

    ``sample``: ``nn.MSELoss`` between ``h`` and the rows ``C̄^(y_b)``, a sample without a global prototype
    contributing zero but counting in the mean (the authors' code). ``prototype``: per batch class j with a
    global prototype, ``(n_j/B) · mean_d (h̄_j − C̄_j)²``.
    """
    if form == "sample":
        target = torch.where(has[y][:, None], targets[y], h.detach())
        return F.mse_loss(h, target)
    c = targets.shape[0]
    sums = torch.zeros(c, h.shape[1], dtype=h.dtype, device=h.device).index_add(0, y, h)
    counts = torch.zeros(c, dtype=h.dtype, device=h.device).index_add(0, y, torch.ones_like(h[:, 0]))
    used = (counts > 0) & has  # masks, not boolean indexing: the same shapes for every batch (vmap)
    means = sums / counts.clamp_min(1)[:, None]
    per_class = (means - targets).pow(2).mean(1)
    return torch.where(used, counts / y.shape[0] * per_class, 0.0).sum()


@ALGORITHMS.register("fedproto")
class FedProto(Algorithm):
    """FedProto (Tan et al. 2022): personal models regularised towards global class prototypes."""

    mean_aggregation = False  # class prototypes, no model

    personalized_eval: ClassVar[bool] = True
    requires_personalized_eval: ClassVar[bool] = True
    heterogeneous_models: ClassVar[bool] = True  # only prototypes are shared (Algorithm 1)

    class Params(HyperParams):
        lam: float = tunable(
            1.0,
            low=0.01,
            high=4.0,
            log=True,
            ge=0.0,
            description="λ, weight of the prototype regularizer (Eq. 7; source: paper Appendix A, "
            "Experimental Details: 1 on MNIST and FEMNIST, 0.1 on CIFAR-10; search: Fig. 4 sweeps λ over "
            "[0, 4], log from 0.01 here; λ = 0 is Local)",
        )
        aggregation: Literal["weighted", "mean"] = Field(
            "weighted",
            description="Eq. 6 weights: per-class sample counts (convex weights, as the appendix's theory) "
            "or plain mean (authors' code)",
        )
        proto_source: Literal["last_epoch", "recompute"] = Field(
            "last_epoch",
            description="local prototypes from the last epoch's training embeddings (Alg. 1, code) or an "
            "eval-mode pass after training (cleaner: no dropout, no drift within the epoch)",
        )
        regularizer: Literal["sample", "prototype"] = Field(
            "sample",
            description="L_R form: per-sample MSE (authors' code, appendix; λ is calibrated for it) or the "
            "prototype-level distance of Eq. 8",
        )
        eval_classes: Literal["own", "all"] = Field(
            "own", description="nearest-prototype candidates: the client's classes (code) or all classes"
        )

    p: Params

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        # The server holds prototypes only, never a model (Algorithm 1: only prototypes are exchanged).
        dim = embedding_dim(model, self.name)
        c = self.ctx.num_classes
        return {
            "protos": torch.zeros(c, dim, device=self.ctx.device),
            "present": torch.zeros(c, dtype=torch.bool, device=self.ctx.device),
        }

    def _classes_for(self, server: State, cid: int | None) -> Tensor:
        present = server["present"]
        if cid is None or self.p.eval_classes == "all":
            return torch.nonzero(present).flatten()
        own = self.ctx.class_counts[cid].to(present.device) > 0
        return torch.nonzero(own & present).flatten()

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """The global prototypes of the client's classes that exist (empty in round 1), with their ids."""
        classes = self._classes_for(server, info.cid)
        return Payload(arrays={"classes": classes, "protos": server["protos"][classes].clone()})

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """Eq. (6): per-class average over the clients that uploaded the class (see ``aggregation``); the
        prototype distance and the number of classes with a global prototype as metrics."""
        classes = torch.cat([u.payload.arrays["classes"] for u in uploads]).to(server["protos"].device)
        local = torch.cat([u.payload.arrays["protos"] for u in uploads]).to(server["protos"].device)
        counts = torch.cat([u.payload.arrays["counts"] for u in uploads]).to(server["protos"].device)
        table, present = aggregate_prototypes(
            classes, local, counts, self.ctx.num_classes, self.p.aggregation
        )
        protos = torch.where(present[:, None], table, server["protos"])
        # diagnostic: mean squared distance (per dimension) of the uploaded local prototypes to the new global
        # ones — the prototype-level L_R of Fig. 4, which falls as λ grows
        distance = float((local - protos[classes]).pow(2).mean())
        known = server["present"] | present
        metrics = {"proto_distance": distance, "proto_classes": int(known.sum())}
        return ServerUpdate({**server, "protos": protos, "present": known}, metrics)

    # ---------------------------------------------------------------- client
    def init_client(self, cid: int) -> State:
        # A private model in the client's own architecture, from the run's initial weights.
        return {"weights": self.ctx.initial_state(cid)}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None:
            raise no_global_model(self.name)
        return state["weights"]

    def _targets(self, payload: Payload, dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Dense ``[C, D]`` table and ``[C]`` mask of the received prototypes."""
        c = self.ctx.num_classes
        classes = payload.arrays["classes"].to(device)
        table = torch.zeros(c, dim, device=device)
        table[classes] = payload.arrays["protos"].to(device)
        has = torch.zeros(c, dtype=torch.bool, device=device)
        has[classes] = True
        return table, has

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """The dense table of the received prototypes and, for ``last_epoch``, the Eq. (3) sums."""
        dim, device = embedding_dim(step.model, self.name), step.client.x.device
        targets, has = self._targets(step.payload, dim, device)
        scratch = {"targets": targets, "has": has}
        if self.p.proto_source == "last_epoch":
            acc = ClassAccumulator.zeros(self.ctx.num_classes, dim, device)
            scratch.update(acc_sums=acc.sums, acc_counts=acc.counts)
        return scratch

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        model, scratch = cast(FedModel, step.model), step.scratch
        h = model.features(batch.x)
        loss = F.cross_entropy(model.head(h), batch.y)  # = NLL of the code's log_softmax outputs
        if batch.last_epoch and "acc_sums" in scratch:
            # Eq. (3) over the last epoch, parameters before each step (in place: the engine keeps scratch)
            ClassAccumulator(scratch["acc_sums"], scratch["acc_counts"]).add(h, batch.y)
        if self.p.lam > 0:  # zero (value and gradient) while no global prototype exists, as in round 1
            reg = prototype_regularizer(h, batch.y, scratch["targets"], scratch["has"], self.p.regularizer)
            loss = loss + self.p.lam * reg
        return loss

    def _recompute(self, model: nn.Module, client: ClientView) -> tuple[Tensor, Tensor]:
        with eval_mode(model):
            h = embed_in_chunks(cast(FedModel, model).features, client.x)
        return class_means(h, client.y, self.ctx.num_classes)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        model, client, scratch = step.model, step.client, step.scratch
        if "acc_sums" in scratch and result.steps > 0:
            table, seen = ClassAccumulator(scratch["acc_sums"], scratch["acc_counts"]).means()
        else:  # proto_source=recompute, or no batch was run (epochs=0)
            table, seen = self._recompute(model, client)
        classes, protos, _ = pack(table, seen)
        # only prototypes leave the client (with class ids and |D_ij|: integer metadata for Eq. 6's weights)
        counts = client.class_counts.to(classes.device)[classes].long()
        upload = Payload(arrays={"classes": classes, "protos": protos.detach().clone(), "counts": counts})
        return LocalOutput(upload, {**step.state, "weights": clone_state(model.state_dict())})

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """Only prototypes, of the classes held, with their counts (Eq. 6's weights)."""
        protos = broadcast.arrays["protos"]
        return UploadLayout(class_rows(self.ctx.num_classes, dtype=protos.dtype, protos=(protos.shape[1],)))

    # ---------------------------------------------------------------- evaluation
    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        """``proto``: nearest received global prototype (Eq. 4, primary); ``logits``: the local classifier."""
        fed_model = cast(FedModel, model)
        h = fed_model.features(x)
        table, has = self._targets(payload, h.shape[1], h.device)
        return {"proto": nearest_prototype_scores(h, table, has), "logits": fed_model.head(h)}
