"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez 2021, "Personalized Federated Learning with First Order
Model Optimization", ICLR), §3 and Algorithm 1.

The server keeps every client's latest uploaded model θ_n and an affinity matrix P. Client i receives M of
those models (ε-greedy over its row of P: each slot is, with probability ε_t, a random client, otherwise the
next best by P; ε_t = ε − (t − 1)·decay, floored at 0; never itself), and weighs each by the first-order
estimate of how much moving towards it lowers its validation loss (§3.2)::

    w_n = (L_i(θ_i^{t−1}) − L_i(θ_n)) / ‖θ_n − θ_i^{t−1}‖,      w̄_n = max(w_n, 0) / Σ_m max(w_m, 0),
    θ_i^t = θ_i^{t−1} + Σ_n w̄_n (θ_n − θ_i^{t−1})

(θ_i^{t−1} kept when no w_n is positive), then trains θ_i^t locally and uploads it with the w_n; the server
stores θ_i and adds P_{i,n} += w_n (Algorithm 1). Candidates come from clients that have uploaded at least
once, so round 1 is plain local training.

Choices (docs/decisions.md, "FedFomo"):

* L_i is the mean cross-entropy, in eval mode, on a validation split: a fixed ``val_share`` of the client's
  training samples drawn once from the run's seed and held out of its local training (``val_data:
  held_out``, the default): ``start_local`` names the other samples as the plan's ``train_indices``, so the
  client trains on the rest, as the authors' code does (NVlabs/FedFomo ``client.py`` ``init_data``: a
  seeded ``random_split`` into disjoint train and val sets, ``--train_split 0.8`` in its README commands)
  and PFLlib (``clientfomo.py``: the last ``val_ratio = 0.2`` of the training data is the val loader and is
  not trained on). ``val_data: in_training`` keeps fedskew's former reading (the split is also trained on,
  which favours the client's own model: docs/decisions.md, "Issue 52: FedFomo's held-out validation").
* Parameters are combined; BatchNorm statistics stay the client's (the authors' code mixes every state entry;
  the paper's CNNs have no BatchNorm). ‖·‖ is the L2 norm over parameters (``distance="l1"``: the authors'
  code's default ``--model_delta_norm l1``). ``affinity="normalized"`` adds w_n / |Σ_m w_m| as that code does.
* Training from θ_i^t: the runtime loads θ_i^{t−1} (:meth:`FedFomo.model_weights`: no data access), and
  ``start_local`` returns θ_i^t's parameters as the plan's ``start_weights``, which the runtime loads before
  training (docs/methods/personalized.md, "Contract: LocalPlan.start_weights"); the loss is plain
  cross-entropy.
* Server state: θ_n and P's rows are :class:`~fedskew.algorithms.server_table.ServerTable` rows of the
  clients that have uploaded, so a round copies its uploaders' rows only, and large federations spill them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedskew.algorithms.base import (
    ALGORITHMS,
    MODEL_PREFIX,
    Algorithm,
    ClientView,
    Context,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    ServerTable,
    ServerUpdate,
    State,
    Upload,
    clone_state,
    model_arrays,
)
from fedskew.algorithms.helpers import eval_mode, no_global_model
from fedskew.algorithms.layouts import ArraySpec, UploadLayout, specs_of, template
from fedskew.search_space import tunable
from fedskew.seeding import derive_seed

SELECT_KEY = 0xF0F0  # the server's ε-greedy draws
VAL_KEY = 0xF0F1  # each client's fixed validation split
IDS, WEIGHTS = "fomo_ids", "fomo_w"


def candidate_prefix(k: int) -> str:
    return f"cand{k}."


def select_candidates(
    affinity: Tensor, available: Tensor, m: int, epsilon: float, gen: torch.Generator
) -> list[int]:
    """ε-greedy choice of up to ``m`` ids among ``available`` (1-d ids): each slot explores (the next of a
    random order) with probability ``epsilon``, else exploits (the next best by ``affinity``, ties random)."""
    if available.numel() == 0:
        return []
    shuffled = available[torch.randperm(available.numel(), generator=gen)]
    best = shuffled[torch.argsort(-affinity[shuffled], stable=True)].tolist()
    rand = available[torch.randperm(available.numel(), generator=gen)].tolist()
    explore = (torch.rand(m, generator=gen) < epsilon).tolist()
    chosen: list[int] = []
    for k in range(min(m, available.numel())):
        source = rand if explore[k] else best
        chosen.append(next(j for j in source if j not in chosen))
    return chosen


def first_order_weights(base_loss: Tensor, losses: Tensor, distances: Tensor) -> Tensor:
    """w_n = (L(θ_i) − L(θ_n)) / ‖θ_n − θ_i‖ (0 where the models coincide)."""
    safe = torch.where(distances > 0, distances, torch.ones_like(distances))
    return torch.where(distances > 0, (base_loss - losses) / safe, torch.zeros_like(losses))


def mixing_weights(w: Tensor) -> Tensor:
    """w̄_n = max(w_n, 0) / Σ max(w_m, 0); all zero when no w_n is positive."""
    pos = w.clamp(min=0)
    total = pos.sum()
    return pos / total if float(total) > 0 else torch.zeros_like(w)


@torch.no_grad()
def validation_loss(model: nn.Module, state: Mapping[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of ``model`` with the entries ``state`` on ``(x, y)`` (eval mode, in chunks)."""
    total = torch.zeros((), device=x.device)
    for i in range(0, x.shape[0], 1024):
        logits = functional_call(model, dict(state), (x[i : i + 1024],))
        total = total + F.cross_entropy(logits, y[i : i + 1024], reduction="sum")
    return total / max(x.shape[0], 1)


@ALGORITHMS.register("fedfomo")
class FedFomo(Algorithm):
    """FedFomo (Zhang et al. 2021): each client mixes downloaded models by first-order validation gains."""

    mean_aggregation = False  # per-client mixtures, no global mean

    personalized_eval: ClassVar[bool] = True
    requires_personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        M: int = tunable(
            5,
            low=1,
            high=10,
            integer=True,
            ge=1,
            description="models downloaded per client and round (source: PFLlib M=5; "
            "authors' cfg NUM_UPDATE_CLIENTS=8; the authors' README runs 4 and 9 others, the paper's "
            "'5 models' and '10 models')",
        )
        epsilon: float = Field(0.3, ge=0, le=1, description="ε-greedy exploration (source: authors' cfg 0.3)")
        epsilon_decay: float = Field(
            0.05, ge=0, description="ε decreases by this every round (source: authors' cfg EPSILON_DECAY)"
        )
        val_share: float = Field(
            0.2,
            gt=0,
            lt=1,
            description="share of local samples in the validation split (source: authors' cfg VAL_SPLIT=0.2)",
        )
        val_data: Literal["held_out", "in_training"] = Field(
            "held_out",
            description="held_out: the validation split is not trained on (authors' code, PFLlib); "
            "in_training: it is also trained on (fedskew before issue 52)",
        )
        distance: Literal["l2", "l1"] = Field("l2", description="‖θ_n − θ_i‖: L2 (§3.2) or L1 (code default)")
        affinity: Literal["raw", "normalized"] = Field(
            "raw", description="P += w (Algorithm 1) or P += w/|Σw| (authors' code)"
        )

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        template = ctx.model_template(None)
        self.param_names = frozenset(n for n, _ in template.named_parameters())
        self.dtypes = {k: v.dtype for k, v in template.state_dict().items()}  # of the models the server keeps

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        """Two tables with a row per client that has uploaded (none yet): its latest model (``models``) and
        its row P_i of the affinity matrix (``P``, float64 [N]); a client without a row has P_i = 0."""
        return {"models": ServerTable(), "P": ServerTable()}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """The ε-greedy choice of other clients' latest models (nothing for global evaluation)."""
        if info.cid is None:
            return Payload()
        models, rows = server["models"], server["P"]
        available = models.ids()
        available = available[available != info.cid]
        eps = max(self.p.epsilon - (info.round - 1) * self.p.epsilon_decay, 0.0)
        gen = info.generator(SELECT_KEY)
        ids = select_candidates(self.affinity(rows, info.cid), available, self.p.M, eps, gen)
        arrays = {IDS: torch.tensor(ids, dtype=torch.long)}
        for k, j in enumerate(ids):
            arrays.update({candidate_prefix(k) + n: v for n, v in models[j].items()})
        return Payload(arrays=arrays)

    def affinity(self, rows: ServerTable, cid: int) -> Tensor:
        """P_i (float64 [N]): client ``cid``'s row of the affinity matrix, zeros before its first upload."""
        return rows[cid]["P"] if cid in rows else torch.zeros(self.ctx.num_clients, dtype=torch.float64)

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """Store each upload as its client's latest model; P_{i,n} += w_{i,n}. Only the uploaders' rows are
        new: the other rows are shared with ``server``'s tables."""
        models, rows = server["models"], server["P"]
        new_models, new_rows, used, offered = {}, {}, [], 0
        for u in uploads:
            sent = u.payload.model_state()
            new_models[u.cid] = {k: v.to(self.ctx.device, self.dtypes[k], copy=True) for k, v in sent.items()}
            ids, w = u.payload.arrays[IDS].cpu(), u.payload.arrays[WEIGHTS].cpu().double()
            if self.p.affinity == "normalized" and ids.numel():
                w = w / max(float(w.sum().abs()), 1e-9)
            p = self.affinity(rows, u.cid).clone()
            p[ids] += w
            new_rows[u.cid] = {"P": p}
            used.append(float((w > 0).sum()))
            offered += ids.numel()
        metrics = {  # how much clients mix: candidates used per uploader, their share, uploaders that mix
            "fomo_models_used": sum(used) / max(len(used), 1),
            "fomo_positive_share": sum(used) / max(offered, 1),
            "fomo_clients_mixing": float(sum(u > 0 for u in used)),
        }
        return ServerUpdate({"models": models.with_rows(new_models), "P": rows.with_rows(new_rows)}, metrics)

    # ---------------------------------------------------------------- client
    def init_client(self, cid: int) -> State:
        return {"weights": self.ctx.initial_state(cid)}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None:
            raise no_global_model(self.name)
        return state["weights"]

    def split(self, client: ClientView) -> tuple[Tensor, Tensor | None]:
        """The validation indices, a fixed ``val_share`` of the client's samples (at least one) drawn once
        from the run's seed, and the indices local training uses: the other samples under ``held_out`` (a
        client with fewer than two samples cannot hold one out: it trains on what it scores on), ``None`` (all
        of them) under ``in_training``."""
        n = client.num_samples
        size = min(n, max(1, round(self.p.val_share * n)))
        gen = torch.Generator().manual_seed(derive_seed(self.ctx.seed, VAL_KEY, client.cid))
        order = torch.randperm(n, generator=gen).to(client.y.device)
        if self.p.val_data == "in_training" or n < 2:
            return order[:size], None
        size = min(size, n - 1)  # at least one sample to train on
        return order[:size], order[size:].sort().values

    def distance(self, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
        diffs = torch.cat([(a[n] - b[n]).flatten() for n in sorted(self.param_names)])
        return diffs.abs().sum() if self.p.distance == "l1" else diffs.norm()

    def start_local(self, step: LocalStep) -> LocalPlan:
        """Eq. (3)–(4): the weights of the candidates on the validation split, θ_i^t to train from, and the
        samples to train on (``held_out``: all but the validation split)."""
        plan = super().start_local(step)
        ids = step.payload.arrays.get(IDS, torch.zeros(0, dtype=torch.long))
        theta = step.state["weights"]
        cands = [step.payload.prefixed(candidate_prefix(k)) for k in range(ids.numel())]
        val, train = self.split(step.client)
        x, y = step.client.x[val], step.client.y[val]
        if not cands or x.shape[0] == 0:
            zeros = torch.zeros(len(cands), device=x.device)
            return LocalPlan(plan.phases, derived={IDS: ids, WEIGHTS: zeros}, train_indices=train)
        with eval_mode(step.model) as model:
            base = validation_loss(model, theta, x, y)
            losses = torch.stack([validation_loss(model, c, x, y) for c in cands])
        dists = torch.stack([self.distance(c, theta) for c in cands]).to(losses.device)
        w = first_order_weights(base, losses, dists)
        mix = mixing_weights(w)
        derived = {IDS: ids, WEIGHTS: w}
        if float(mix.sum()) == 0:  # no candidate helps: θ_i^t = θ_i^{t−1}, loaded already
            return LocalPlan(plan.phases, derived=derived, train_indices=train)
        start = {
            n: theta[n] + sum(float(mix[k]) * (c[n] - theta[n]) for k, c in enumerate(cands) if mix[k] > 0)
            for n in sorted(self.param_names)
        }
        return LocalPlan(plan.phases, derived=derived, start_weights=start, train_indices=train)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        weights = clone_state(step.model.state_dict())  # trained from θ_i^t (the plan's start_weights)
        upload = Payload(arrays=model_arrays(weights))
        upload.arrays[IDS] = step.derived[IDS].detach().clone().cpu()
        upload.arrays[WEIGHTS] = step.derived[WEIGHTS].detach().clone().float()
        return LocalOutput(upload, {**step.state, "weights": clone_state(weights)})

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The client's trained model, the ids of the candidates it was sent and their weights w_n."""
        specs = specs_of(template(self.ctx, info.cid).state_dict(), prefix=MODEL_PREFIX)
        m = int(broadcast.arrays[IDS].shape[0])
        specs[IDS] = ArraySpec((m,), torch.int64, 0, self.ctx.num_clients - 1)
        specs[WEIGHTS] = ArraySpec((m,), torch.float32)
        return UploadLayout(specs)
