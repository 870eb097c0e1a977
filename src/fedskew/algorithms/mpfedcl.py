"""MP-FedCL (Qiao et al., "MP-FedCL: Multiprototype Federated Contrastive Learning for Edge Intelligence",
IEEE IoT-J 2023), with its variants SP-FedCL (one prototype per class) and DP-FedCL (DBSCAN prototypes).

Each round every client trains the global model on ``L = L_S + L_R`` (Eq. 12): cross-entropy plus the
supervised contrastive prototype loss of Eq. (11) against the global prototype pool, then clusters the
embeddings ``v = f_e(x)`` of each of its classes, collected during the last local epoch (Alg. 1, lines 13
and 19), into K k-means centroids (Eq. 7). It uploads its weights and its ≤ K·C centroids. The server
averages the weights (FedAvg, Alg. 1 line 9) and keeps every centroid in a pool grouped by class (Eq. 8,
never averaged). Clients rebuild the dense padded pool ``P [N, C, K, d]`` of Eqs. (9)–(10) from it: a
(client, class) with fewer than K centroids gets the class mean ``Ū_j`` of the pool in all K slots.

``L_R`` (Eq. 11 read slice by slice): for each slice (i, k) of the pool, which holds one prototype per
class, a softmax cross-entropy over the C classes of ``v·u_{i,a}^k / τ`` with the sample's own class as the
positive (as the proof of Lemma 2 and §II's stated goal require), averaged over the N·K slices and over the
batch. Prototypes are constants. Round 1 has an empty pool, so ``L_R = 0``. Inference (Eq. 13) labels a
test sample with the class of its nearest prototype (L2) in the real, unpadded pool (Eq. 8), using the
client's locally updated model; the classifier is recorded as a second head. Embeddings are L2-normalised
by default, so k-means, ``L_R`` and inference all see unit vectors (τ = 0.07 assumes unit-norm features).
The learning-rate decay of 0.95 (Table IV) is applied per round by the engine's ``client.lr_decay``.
Each of these readings has an entry "MP-FedCL: ..." in docs/decisions.md.

Named options keep the other readings available: ``positives: others`` (P(y) = "labels distinct from y"
as printed), ``reduction: sum`` (Eq. 11's sum over samples), ``normalize: false``, ``eval_weights:
global``, ``eval_pool: padded``, ``padding: fill``, ``loss_form: pooled`` (SupCon over the whole pool),
``proto_source: recompute``, ``kmeans_init: kmeans++``.
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
    fedavg_mean,
    model_arrays,
    server_arrays,
)
from fedskew.algorithms.layouts import UploadLayout, class_rows, specs_of
from fedskew.algorithms.protos import class_sums, kmeans, nearest_prototype_scores
from fedskew.models.base import FedModel, embed_in_chunks
from fedskew.search_space import tunable

CLUSTER_KEY = 0x4D50  # seed stream of the client-side clustering ("MP")


def group_ranks(keys: Tensor, num_keys: int) -> tuple[Tensor, Tensor]:
    """Position of every entry within its group (entries sharing a key, in input order) and group sizes."""
    order = torch.argsort(keys, stable=True)
    sizes = torch.bincount(keys, minlength=num_keys)
    starts = torch.cumsum(sizes, 0) - sizes
    ranks = torch.empty_like(keys)
    ranks[order] = torch.arange(keys.numel(), device=keys.device) - starts[keys[order]]
    return ranks, sizes


def class_table(protos: Tensor, classes: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """The real pool U = {U_1..U_C} (Eq. 8) as ``[C, K_max, d]`` plus a ``[C, K_max]`` mask of real entries,
    the input of :func:`~fedskew.algorithms.protos.nearest_prototype_scores` (Eq. 13)."""
    ranks, sizes = group_ranks(classes, num_classes)
    k_max = max(int(sizes.max()) if sizes.numel() else 0, 1)
    table = protos.new_zeros(num_classes, k_max, protos.shape[1])
    mask = torch.zeros(num_classes, k_max, dtype=torch.bool, device=protos.device)
    table[classes, ranks] = protos
    mask[classes, ranks] = True
    return table, mask


def pad_pool(
    protos: Tensor, classes: Tensor, owners: Tensor, num_classes: int, k: int, padding: str = "literal"
) -> tuple[Tensor, Tensor]:
    """Dense training pool ``P [N, C, K, d]`` (Eqs. 9–10) and the ``[C]`` mask of classes in the pool.

    ``N`` counts the clients that have prototypes in the pool (in client-id order). ``Ū_j`` is the mean of
    every prototype of class j (Eq. 9). ``literal``: a (client, class) with fewer than ``k`` prototypes gets
    ``Ū_j`` in all ``k`` slots (Eq. 10 as printed); ``fill``: its real prototypes are kept and only the empty
    slots get ``Ū_j``. ``k`` is raised to the largest count in the pool (DBSCAN gives varying counts).
    """
    _, owner_idx = torch.unique(owners, return_inverse=True)
    n = int(owner_idx.max()) + 1
    sums, counts = class_sums(protos, classes, num_classes)
    present = counts > 0
    mean = (sums / counts.clamp_min(1)[:, None]).to(protos.dtype)  # Ū_j (zero rows for absent classes)
    group = owner_idx * num_classes + classes
    ranks, sizes = group_ranks(group, n * num_classes)
    k = max(k, int(sizes.max()))
    pool = mean[None, :, None, :].expand(n, num_classes, k, -1).clone()
    keep = sizes[group] == k if padding == "literal" else torch.ones_like(group, dtype=torch.bool)
    pool[owner_idx[keep], classes[keep], ranks[keep]] = protos[keep]
    return pool, present


def prototype_contrastive_loss(
    z: Tensor,
    y: Tensor,
    pool: Tensor,
    present: Tensor,
    tau: float = 0.07,
    positives: str = "own",
    reduction: str = "mean",
) -> Tensor:
    """``L_R`` of Eq. (11), one softmax per pool slice: ``z [B, d]``, ``pool [N, C, K, d]`` (constants).

    For every slice (i, k): ``−log softmax_a(z·P[i, a, k] / τ)[y]``, averaged over the N·K slices; then the
    batch mean (default) or sum (``reduction: sum``, Eq. 11 literally). ``positives: others`` is the printed
    P(y) = [C]∖{y}: the mean over the other classes replaces the own class (it pushes samples towards
    the wrong classes). Classes absent from the pool are left out of the softmax; samples of such a class
    contribute nothing.
    """
    logits = torch.einsum("bd,nckd->bnkc", z, pool.detach()) / tau
    logp = logits.masked_fill(~present, float("-inf")).log_softmax(-1)
    valid = present[y]
    y = torch.where(valid, y, present.long().argmax())  # a class outside the pool: no -inf target
    if positives == "own":
        per_slice = -logp.gather(-1, y[:, None, None, None].expand(*logp.shape[:3], 1))[..., 0]
    else:
        others = present[None, :] & (torch.arange(pool.shape[1], device=y.device)[None, :] != y[:, None])
        w = (others.to(z.dtype) / others.sum(1, keepdim=True).clamp_min(1))[:, None, None, :]
        per_slice = -(logp.masked_fill(w == 0, 0.0) * w).sum(-1)
    per_sample = per_slice.mean((1, 2)) * valid
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def pooled_contrastive_loss(
    z: Tensor, y: Tensor, pool: Tensor, present: Tensor, tau: float = 0.07, reduction: str = "mean"
) -> Tensor:
    """Pooled reading of Eq. (11) (SupCon over the whole pool): ``−mean_{p∈Q_y} log(exp(z·p/τ) / Σ_{q∈Q}
    exp(z·q/τ))`` over all N·C·K padded prototypes Q; suits varying prototype counts (DP-FedCL)."""
    n, c, k, d = pool.shape
    labels = torch.arange(c, device=z.device).repeat_interleave(k).repeat(n)  # class of each flat entry
    flat = pool.detach().reshape(-1, d)
    logp = (z @ flat.T / tau).masked_fill(~present[labels][None], float("-inf")).log_softmax(-1)
    pos = (labels[None, :] == y[:, None]) & present[labels][None]
    per_sample = -(logp.masked_fill(~pos, 0.0)).sum(1) / pos.sum(1).clamp_min(1)
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def cluster_class(
    v: Tensor, method: str, k: int, generator: torch.Generator, kmeans_init: str, eps: float, min_samples: int
) -> Tensor:
    """Prototypes of one class's embeddings ``v [n, d]``: K k-means centroids (Eq. 7; ``min(K, n)`` when
    n < K), the mean (SP-FedCL), or DBSCAN cluster means with the class mean when DBSCAN finds no cluster
    (DP-FedCL, whose settings the paper does not give; noise points ignored)."""
    if method == "mean" or v.shape[0] == 1:
        return v.mean(0, keepdim=True)
    if method == "kmeans":
        return kmeans(v, k, iters=300, generator=generator, tol=1e-4, init=kmeans_init)[0]
    from sklearn.cluster import DBSCAN  # scikit-learn: a hard dependency already

    labels = torch.from_numpy(DBSCAN(eps=eps, min_samples=min_samples).fit_predict(v.double().cpu().numpy()))
    labels = labels.to(v.device)
    found = labels >= 0
    if not bool(found.any()):
        return v.mean(0, keepdim=True)
    sums, counts = class_sums(v[found], labels[found], int(labels.max()) + 1)
    return (sums / counts[:, None]).to(v.dtype)


@ALGORITHMS.register("mpfedcl")
class MPFedCL(Algorithm):
    """MP-FedCL (Qiao et al. 2023): k-means multi-prototypes, a global prototype pool and a supervised
    contrastive prototype loss; nearest-prototype inference."""

    mean_aggregation = False  # prototypes per class
    vectorizable = False

    personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        k: int = tunable(
            2,
            low=2,
            high=4,
            integer=True,
            ge=1,
            description="K, prototypes per class and client (source: paper §V-C, Fig. 5: MNIST 2, "
            "Digit-5/Office 4, DomainNet 3; search: §V-C's K ∈ {2, 3, 4})",
        )
        clustering: Literal["kmeans", "mean", "dbscan"] = Field(
            "kmeans", description="Eq. 7 k-means; mean (SP-FedCL, §V); DBSCAN (DP-FedCL, §V)"
        )
        tau: float = Field(0.07, gt=0, description="temperature τ of Eq. 11 (Table IV)")
        weight: float = Field(1.0, ge=0, description="weight of L_R in Eq. 12 (paper: 1, no λ)")
        normalize: bool = Field(
            True, description="L2-normalise the 256-d embedding (not in paper; τ = 0.07 assumes unit norm)"
        )
        positives: Literal["own", "others"] = Field(
            "own",
            description="P(y) of Eq. 11 (slice form): the own class (as Lemma 2's proof) or the printed "
            "'labels distinct from y'",
        )
        reduction: Literal["mean", "sum"] = Field(
            "mean", description="L_R over the batch: mean (as L_S, Eq. 2) or Eq. 11's literal sum"
        )
        loss_form: Literal["slice", "pooled"] = Field(
            "slice", description="per-(client, k) slice softmax of Eq. 11 or pooled SupCon over the pool"
        )
        padding: Literal["literal", "fill"] = Field(
            "literal",
            description="Eq. 10: Ū_j in all K slots when a client has < K (as printed), or in empty slots",
        )
        proto_source: Literal["last_epoch", "recompute"] = Field(
            "last_epoch", description="embeddings of the last local epoch (Alg. 1 l. 13) or an eval-mode pass"
        )
        kmeans_init: Literal["random", "kmeans++"] = Field(
            "random", description="initial centroids: K random data points (paper, §IV-A) or k-means++"
        )
        eps: float = Field(0.5, gt=0, description="DBSCAN eps (not in paper; on normalised embeddings)")
        min_samples: int = Field(2, ge=1, description="DBSCAN min_samples (not in paper)")
        eval_weights: Literal["local", "global"] = Field(
            "local", description="test-time model: the client's locally updated ω_i (§III-C) or the global ω"
        )
        eval_pool: Literal["real", "padded"] = Field(
            "real", description="inference pool: real prototypes U_j (Eqs. 8, 13) or the padded pool"
        )

    p: Params

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        dim = embedding_dim(model, self.name)
        server = super().init_server(model)
        server.update(
            protos=torch.zeros(0, dim, device=self.ctx.device),
            classes=torch.zeros(0, dtype=torch.long, device=self.ctx.device),
            owners=torch.zeros(0, dtype=torch.long, device=self.ctx.device),
        )
        return server

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """Global weights and the real pool with class and owner ids; clients pad it themselves (Eq. 10),
        which is the same information as the dense pool in at most N·C·K·d floats."""
        tensors = server_arrays(server["weights"])
        tensors.update(
            pool_protos=server["protos"].clone(),
            pool_classes=server["classes"].clone(),
            pool_owners=server["owners"].clone(),
        )
        return Payload(arrays=tensors)

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """FedAvg on the weights (Alg. 1 line 9); the pool keeps every uploaded centroid (Eq. 8), replacing
        the previous ones of the uploading clients. Metrics: the pool's size and coverage."""
        server = {**server, "weights": fedavg_mean(uploads)}
        dev = server["protos"].device
        uploaded = torch.tensor([u.cid for u in uploads], dtype=torch.long, device=dev)
        keep = ~torch.isin(server["owners"], uploaded)
        new = [u.payload.arrays for u in uploads]
        owners = [torch.full_like(t["classes"], u.cid) for t, u in zip(new, uploads, strict=True)]
        state = {
            **server,
            "protos": torch.cat([server["protos"][keep], *[t["protos"].to(dev) for t in new]]),
            "classes": torch.cat([server["classes"][keep], *[t["classes"].to(dev) for t in new]]),
            "owners": torch.cat([server["owners"][keep], *[o.to(dev) for o in owners]]),
        }
        return ServerUpdate(state, self.pool_metrics(state))

    def pool_metrics(self, server: State) -> dict[str, float]:
        """The pool's size, the classes it covers and its mean number of prototypes per (client, class)."""
        c = self.ctx.num_classes
        if server["classes"].numel() == 0:
            return {}
        per_class = torch.bincount(server["classes"], minlength=c)
        groups = torch.unique(server["owners"] * c + server["classes"]).numel()
        return {
            "pool_size": float(server["classes"].numel()),
            "pool_classes": float((per_class > 0).sum()),
            "protos_per_client_class": float(server["classes"].numel() / max(groups, 1)),
        }

    # ---------------------------------------------------------------- client
    def _embed(self, model: nn.Module, x: Tensor) -> Tensor:
        z = cast(FedModel, model).features(x)
        return F.normalize(z, dim=1) if self.p.normalize else z

    def _pool(self, payload: Payload, device: torch.device) -> tuple[Tensor, Tensor] | None:
        protos = payload.arrays["pool_protos"].to(device)
        if protos.shape[0] == 0:
            return None  # round 1: empty pool, L_R = 0 (docs/methods/mpfedcl.md, "MP-FedCL: round-1 pool")
        classes = payload.arrays["pool_classes"].to(device)
        owners = payload.arrays["pool_owners"].to(device)
        return pad_pool(protos, classes, owners, self.ctx.num_classes, self.p.k, self.p.padding)

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """The padded pool (Eq. 10; absent in round 1) and, for ``last_epoch``, buffers that collect the last
        epoch's embeddings and labels in batch order (Alg. 1 line 13)."""
        model, payload, client = step.model, step.payload, step.client
        scratch: dict[str, Tensor] = {}
        padded = self._pool(payload, client.x.device)
        if padded is not None:
            scratch["pool"], scratch["present"] = padded
        if self.p.proto_source == "last_epoch":
            n, dim = client.num_samples, embedding_dim(model, self.name)
            scratch["z"] = torch.zeros(n, dim, device=client.x.device)
            scratch["y"] = torch.zeros(n, dtype=client.y.dtype, device=client.x.device)
            scratch["filled"] = torch.zeros((), dtype=torch.long)
        return scratch

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        model, scratch = cast(FedModel, step.model), step.scratch
        z = self._embed(model, batch.x)
        loss = F.cross_entropy(model.head(z), batch.y)  # L_S (Eq. 1-2)
        if batch.last_epoch and "filled" in scratch:
            k, b = int(scratch["filled"]), batch.y.numel()
            scratch["z"][k : k + b] = z.detach()  # Alg. 1 line 13
            scratch["y"][k : k + b] = batch.y
            scratch["filled"].add_(b)
        if "pool" in scratch and self.p.weight > 0:
            pool, present = scratch["pool"], scratch["present"]
            if self.p.loss_form == "slice":
                reg = prototype_contrastive_loss(
                    z, batch.y, pool, present, self.p.tau, self.p.positives, self.p.reduction
                )
            else:
                reg = pooled_contrastive_loss(z, batch.y, pool, present, self.p.tau, self.p.reduction)
            loss = loss + self.p.weight * reg
        return loss

    def _recompute(self, model: nn.Module, client: ClientView) -> tuple[Tensor, Tensor]:
        model.eval()
        z = embed_in_chunks(lambda x: self._embed(model, x), client.x)
        model.train()
        return z, client.y

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        model, client, scratch, state = step.model, step.client, step.scratch, step.state
        filled = int(scratch["filled"]) if "filled" in scratch else 0
        if filled:
            z, y = scratch["z"][:filled], scratch["y"][:filled]
        else:  # proto_source=recompute, or no batch ran
            z, y = self._recompute(model, client)
        gen = step.info.generator(CLUSTER_KEY)
        protos, classes = [], []
        for j in torch.unique(y).tolist():  # one clustering per class held (≤ C calls, Eq. 7)
            p = self.p
            centers = cluster_class(z[y == j], p.clustering, p.k, gen, p.kmeans_init, p.eps, p.min_samples)
            protos.append(centers)
            classes.append(torch.full((centers.shape[0],), j, dtype=torch.long, device=z.device))
        weights = model.state_dict()
        if self.p.eval_weights == "local":
            state = {**state, "weights": clone_state(weights)}
        tensors = model_arrays(weights)
        if not protos:  # a client without training data uploads no prototype (its model is the global one)
            protos, classes = [z.new_zeros((0, z.shape[1]))], [y.new_zeros((0,), dtype=torch.long)]
        tensors.update(protos=torch.cat(protos).detach().clone(), classes=torch.cat(classes))
        return LocalOutput(Payload(arrays=tensors), state)

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The model it was sent (not the pool) and its prototypes with their class ids (how many per class
        depends on the clustering)."""
        specs = specs_of(broadcast.arrays, lambda k: not k.startswith("pool_"))
        d = broadcast.arrays["pool_protos"].shape[1]
        specs.update(class_rows(self.ctx.num_classes, "m", names=("classes", ""), protos=(d,)))
        return UploadLayout(specs)

    # ---------------------------------------------------------------- evaluation
    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is not None and "weights" in state and self.p.eval_weights == "local":
            return state["weights"]  # ω_i of the client's last local update
        return payload.model_state()

    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        """``proto``: nearest prototype of the pool (Eq. 13, primary); ``logits``: the classifier f_c."""
        z = self._embed(model, x)
        protos = payload.arrays["pool_protos"].to(z.device)
        if protos.shape[0] == 0:
            scores = torch.zeros(z.shape[0], self.ctx.num_classes, device=z.device)
        elif self.p.eval_pool == "real":
            classes = payload.arrays["pool_classes"].to(z.device)
            table, mask = class_table(protos, classes, self.ctx.num_classes)
            scores = nearest_prototype_scores(z, table, mask)
        else:
            pool, present = cast("tuple[Tensor, Tensor]", self._pool(payload, z.device))  # non-empty pool
            table = pool.transpose(0, 1).reshape(self.ctx.num_classes, -1, pool.shape[-1])
            mask = present[:, None].expand(-1, table.shape[1])
            scores = nearest_prototype_scores(z, table, mask)
        return {"proto": scores, "logits": cast(FedModel, model).head(z)}


@ALGORITHMS.register("spfedcl")
class SPFedCL(MPFedCL):
    """SP-FedCL (MP-FedCL §V): one prototype per class, the class mean; no clustering."""

    class Params(MPFedCL.Params):
        k: int = Field(1, ge=1, le=1, description="K = 1: a single prototype per class")
        clustering: Literal["mean"] = Field("mean", description="the class mean replaces k-means")


@ALGORITHMS.register("dpfedcl")
class DPFedCL(MPFedCL):
    """DP-FedCL (MP-FedCL §V): DBSCAN per class instead of k-means, so the prototype count varies; trained
    with the pooled SupCon form by default (docs/methods/mpfedcl.md, "MP-FedCL: DP-FedCL clustering and
    loss")."""

    class Params(MPFedCL.Params):
        k: int = Field(
            2, ge=1, description="least pad width K of the pool; DBSCAN sets the counts (not searched)"
        )
        clustering: Literal["dbscan"] = Field("dbscan", description="DBSCAN per class (paper §V)")
        loss_form: Literal["slice", "pooled"] = Field(
            "pooled",
            description="pooled SupCon (suits varying counts) or the slice form padded to the largest count",
        )


__all__ = [
    "DPFedCL",
    "MPFedCL",
    "SPFedCL",
    "class_table",
    "cluster_class",
    "pad_pool",
    "pooled_contrastive_loss",
    "prototype_contrastive_loss",
]
