"""FeSEM (Xie, Long, Shen, Zhou, Wang, Jiang, Zhang 2020, "Multi-Center Federated Learning",
arXiv:2005.01026), §4 and Algorithm 1: Federated Stochastic Expectation Maximization.

The server keeps K centers W̃^(k) (whole models) and minimises the multi-center loss
``Σ_i Σ_k r_i^(k) ‖W_i − W̃^(k)‖²`` over the assignments r and the centers by alternating

* E-step: each client i is assigned to the nearest center, ``r_i = argmin_k ‖W_i − W̃^(k)‖²`` (L2 over all
  model parameters; buffers such as BatchNorm statistics are left out);
* M-step: each center becomes the average of its clients' models, ``W̃^(k) = Σ_i r_i^(k) W_i / Σ_i r_i^(k)``
  (``center_weights="samples"``: weighted by sample counts, as FedAvg); a center without clients is kept;
* local update: client i trains (plain SGD on cross-entropy) from its center W̃^(r_i), which gives its new
  local model W_i.

W_i is exactly what client i uploads after its local update, so both steps run in ``aggregate`` on the
uploads (E-step against the current centers, then the M-step): a client is sent one model (its center) and
uploads one model, and nothing else travels. With full participation this is the paper's loop; with partial
participation a client keeps the assignment of its last upload until it uploads again.

Initialisation (the paper: "randomly"): every client trains from the run's initial model W_0 until the
centers exist; centers are seeded from K distinct uploaded models drawn with the round's generator (Forgy
initialisation of k-means; a center left unseeded because fewer than K models arrived is seeded in a later
round). K independent random networks as centers would put every client in the center nearest to W_0, since
all local models start from W_0. A client that never uploaded is sent the center nearest to W_0 (its local
model). Evaluation (``eval_model``): each client with its center (default) or with its own model after its
last local update. docs/decisions.md, "FeSEM: ...".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Context,
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
    model_arrays,
    param_names,
    sample_weights,
    server_arrays,
    weighted_average,
)
from fedskew.errors import ConfigError
from fedskew.search_space import tunable

SEED_KEY = 0x5E5E  # the server's draws of the models that seed the centers


def squared_distances(
    models: Sequence[Mapping[str, Tensor]], centers: Sequence[Mapping[str, Tensor]], keys: list[str]
) -> Tensor:
    """``[len(models), len(centers)]`` squared L2 distances over the entries ``keys`` (float64; differences
    taken entry by entry, so nearly equal models lose nothing to cancellation)."""
    out = torch.zeros(len(models), len(centers), dtype=torch.float64)
    for key in keys:
        stacked = torch.stack([m[key].detach().reshape(-1) for m in models]).double()
        for k, center in enumerate(centers):
            diff = stacked - center[key].detach().reshape(1, -1).to(stacked.device, torch.float64)
            out[:, k] += diff.pow(2).sum(1).cpu()
    return out


@ALGORITHMS.register("fesem")
class FeSEM(Algorithm):
    """FeSEM (Xie et al. 2020): K model centers, clients assigned to the nearest, centers averaged."""

    mean_aggregation = False  # cluster centres

    personalized_eval: ClassVar[bool] = True
    requires_personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        clusters: int = tunable(
            3,
            low=2,
            high=5,
            integer=True,
            ge=1,
            description="K, number of centers (the paper varies it, §5; no single value: a choice; search: "
            "fedskew, [2, 5])",
        )
        center_weights: Literal["uniform", "samples"] = Field(
            "uniform",
            description="M-step weights: the plain mean over a center's clients (Eq. of the M-step) or "
            "sample counts (FedAvg's n_i / n)",
        )
        eval_model: Literal["center", "local"] = Field(
            "center", description="evaluate a client with its center, or with its model after its last update"
        )

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        self.keys = param_names(ctx.model_template(None))  # the E-step distance runs over parameters

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        w0 = clone_state(model.state_dict())
        k = self.p.clusters
        return {
            "initial": w0,
            "centers": [w0] * k,  # placeholders until seeded (never changed in place)
            "seeded": torch.zeros(k, dtype=torch.bool),
            "assign": torch.full((self.ctx.num_clients,), -1, dtype=torch.long),
            "fallback": -1,  # the center nearest to W_0, for clients without an assignment (-1: W_0 itself)
        }

    def _center_of(self, server: State, cid: int | None) -> Mapping[str, Tensor]:
        k = int(server["assign"][cid]) if cid is not None else -1
        k = server["fallback"] if k < 0 else k
        return server["initial"] if k < 0 else server["centers"][k]

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """Client ``cid`` gets its center (one model); an unassigned client the center nearest to W_0."""
        return Payload(arrays=server_arrays(self._center_of(server, info.cid)))

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """Seed missing centers from uploads, then the E-step and the M-step on the uploaded models."""
        models = [u.payload.model_state() for u in uploads]
        centers, seeded = list(server["centers"]), server["seeded"].clone()
        missing = torch.nonzero(~seeded).flatten().tolist()
        if missing:  # Forgy: distinct uploaded models, drawn with the round's generator
            draw = torch.randperm(len(models), generator=info.generator(SEED_KEY)).tolist()
            for k, j in zip(missing, draw, strict=False):
                centers[k] = clone_state(models[j])
                seeded[k] = True
        dist = squared_distances(models, centers, self.keys)
        dist[:, ~seeded] = float("inf")
        r = dist.argmin(1)  # E-step (ties: the lowest center index)
        weights = sample_weights(uploads)
        for k in torch.unique(r).tolist():  # M-step: the centers that received clients
            members = torch.nonzero(r == k).flatten().tolist()
            w = weights[members] if self.p.center_weights == "samples" else torch.ones(len(members))
            w = w / w.sum() if float(w.sum()) > 0 else torch.full((len(members),), 1.0 / len(members))
            centers[k] = weighted_average([models[i] for i in members], w)
        assign = server["assign"].clone()
        cids = torch.tensor([u.cid for u in uploads], dtype=torch.long)
        changed = int((assign[cids] != r).sum())
        assign[cids] = r
        to_init = squared_distances([server["initial"]], centers, self.keys)[0]
        to_init[~seeded] = float("inf")
        fallback = int(to_init.argmin()) if bool(seeded.any()) else -1
        sizes = torch.bincount(assign[assign >= 0], minlength=self.p.clusters).tolist()
        metrics: dict[str, float | list[float]] = {
            "cluster_sizes": [float(s) for s in sizes],
            "assign_changes": float(changed),
        }
        state = {**server, "centers": centers, "seeded": seeded, "assign": assign, "fallback": fallback}
        return ServerUpdate(state, metrics)

    # ---------------------------------------------------------------- client
    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None:
            raise ConfigError("fesem has no single global model to evaluate; set eval.protocol=personalized")
        return payload.model_state()

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is not None and self.p.eval_model == "local" and "weights" in state:
            return state["weights"]
        return self.model_weights(payload, state)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload the local model W_i; keep it only when clients are evaluated with their own model."""
        sd = step.model.state_dict()
        state = {**step.state, "weights": clone_state(sd)} if self.p.eval_model == "local" else step.state
        return LocalOutput(Payload(arrays=model_arrays(sd)), state)


__all__ = ["FeSEM", "squared_distances"]
