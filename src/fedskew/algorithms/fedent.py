"""FedEnt (Zheng, Yuan, Wang, Duan 2024, "Adaptive Federated Learning via New Entropy Approach",
arXiv:2303.14966v3), with the distance-metric variant FedNorm of its §6.2.3 (FedCos, the other one, is
:mod:`fedskew.algorithms.fedcos`; the numerics are :mod:`fedskew.algorithms.fedent_solver`).

FedEnt is FedAvg with one scalar learning rate ``η_i(t)`` per client and round, held for all ``E`` local
epochs (Algorithm 2). It solves the mean-field optimal-control problem of Eqs. (15)–(16): the cost is
``β Σ_j p̄_j log p̄_j + (1 − β) η_i²`` with ``p̄_i = θ_i ‖w_i‖² / φ2`` (Eq. 13), and Pontryagin's conditions
(Eqs. 19–22) give Proposition 1, Eq. (17)/(23), solved for η by
:func:`~fedskew.algorithms.fedent_solver.solve_eta` at ``x = φ1(t)`` with the gradient ``g = ∇F_i(x)`` of
one probe mini-batch (Algorithm 2, line 4) and clipped to ``[0, η_max]`` (docs/decisions.md, "FedEnt:
solving the implicit Eq. (23)"). The value used is the EMA of Eq. (37), ``η_i(t) = γ η_i(t−1) + (1 − γ)
η_raw``, seeded with ``η_i(−1) = client.lr`` (docs/methods/fedent.md, "FedEnt: initial rate η_i(−1)");
aggregation is FedAvg's (Eq. 3). ``start_local`` derives η and the probe statistics for the round; they
reach ``finish_local`` through ``LocalPlan.derived`` and are never kept in the client's state.

Mean-field estimators (Definition 2, Eqs. 11–12). ``φ1(t)`` is the actual global model ``w(t)``, the
quantity it estimates (docs/methods/fedent.md, "FedEnt: which point φ1(t) is"). ``φ2(t+1)`` is the scalar
fixed
point of Eq. (28), ``φ2(t+1) = Σ_j θ_j ‖φ1(t) − A_j(φ1(t), φ2(t+1)) g_j‖²``, solved by the server once per
round. The paper evaluates it before training (Algorithm 1) with every client's gradient at every
``φ1(t)``; the server here has no client data, so it uses the statistics ``(s_j, G_j)`` that the previous
round's participants reported (see ``phi2_fixed_point``, docs/algorithms.md and docs/decisions.md,
"FedEnt: when φ2 is computed"). The full forward pass of Algorithm 1 with a gradient oracle is
:func:`~fedskew.algorithms.fedent_solver.mean_field_trajectory`.

FedNorm (Eq. 61): FedEnt's machinery with the cost ``β Σ_j ‖w_i − w‖²`` in place of the entropy, whose
Hamiltonian solution is ``η = max{0, (φ1(t) − φ1(t+1))ᵀ g / ((1 − β)/(β N) + ‖g‖²)}`` (derived with the
steps of the proof of Proposition 1, §4.2; the paper refers to Tu et al. 2022 for it).

The round's diagnostics (rates, solver regime, entropy, drift, φ2) are :class:`ServerUpdate` metrics, never
server state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    MODEL_PREFIX,
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
    fedavg_mean,
    load_state,
)
from fedskew.algorithms.fedent_solver import (
    BRACKETED_ROOT,
    CLOSED_FORM,
    F64,
    KEPT,
    MINIMISED,
    PBAR_FLOOR,
    PHI_FLOOR,
    SATURATED,
    dot,
    entropy_term,
    eq18_bound,
    eta_fednorm,
    minimise_cost,
    phi2_fixed_point,
    solve_eta,
    sq_dist,
    sq_norm,
)
from fedskew.algorithms.layouts import UploadLayout, specs_of
from fedskew.search_space import tunable
from fedskew.seeding import derive_seed

log = logging.getLogger("fedskew.algorithms.fedent")

PROBE_KEY = 0xE7E7  # seed key of the mini-batch that probes ∇F_i(w(t)) (Algorithm 2, line 4)
PROBE_CHUNK = 1024  # chunk size of the full local gradient (probe="full")
STEP_PREFIX = "mf_step."  # FedNorm: payload prefix of the estimate of φ1(t) − φ1(t+1)


# ================================================================================================ FedEnt
class RateParams(HyperParams):
    """Shared by FedEnt and FedNorm: the control weight, the EMA and the probe."""

    beta: float = tunable(
        0.99,
        low=0.5,
        high=0.999,
        ge=0.0,
        lt=1.0,
        description="weight β of the distance term against (1 − β) η² (source: paper §6.1, β = 0.99 for "
        "FedEnt and FedNorm; β = 0 allowed as an ablation, the paper states β ∈ (0, 1); search: fedskew, "
        "§6.2.5 varies β without stating its values)",
    )
    gamma: float = tunable(
        0.99,
        low=0.5,
        high=1.0,
        ge=0.0,
        le=1.0,
        description="EMA decay γ of Eq. (37) (source: paper §6.1/§6.2.5, γ = 0.99; γ = 1 freezes η at "
        "client.lr, i.e. FedAvg — an ablation; search: fedskew, §6.2.5 varies γ without stating its values)",
    )
    eta_max: float = Field(
        1.0, gt=0.0, description="clip of the raw η (source: paper Eq. 7/§4.2, domain η ∈ [0, 1])"
    )
    probe: Literal["batch", "full"] = Field(
        "batch",
        description="gradient ∇F_i(w(t)) for η: one seeded mini-batch of client.batch_size (source: "
        "Algorithm 2 line 4) or the full local gradient (not in paper; affordable on small data)",
    )


class FedEntParams(RateParams):
    """FedEnt's hyper-parameters: the rate's solver options on top of :class:`RateParams`."""

    eq24: Literal["consistent", "printed"] = Field(
        "consistent",
        description="closed form η = c s / (1 + c‖g‖²) (algebra of Eq. 23) or Eq. (24) as "
        "printed, with ‖g‖ in place of ‖g‖² (ablation)",
    )
    solver: Literal["stationary", "minimiser"] = Field(
        "stationary",
        description="η_raw: the stationary point of Eq. (23) (Proposition 1, the paper) or the minimiser "
        "of the mean-field cost β p̄ log p̄ + (1 − β) η² on [0, η_max] (not in paper; differs where "
        "1 + cG < 0, where the cost is not convex in η)",
    )
    fallback: Literal["root", "keep"] = Field(
        "root",
        description="singular / non-converged closed form: smallest root of Eq. (23) on [0, η_max] "
        "(not in paper) or keep η_i(t−1), skipping the EMA update (more conservative)",
    )
    grad_bound: float | None = Field(
        None,
        gt=0.0,
        description="D of Assumption 1 for the optional Eq. (18) clip, e.g. Table II (40 MNIST, 6770 "
        "EMNIST-L, 57 CIFAR10, 79 CIFAR100); None: no clip (the bound is not rigorous when p̄ < e^−3)",
    )
    phi2_estimator: Literal["fixed_point", "global_norm"] = Field(
        "fixed_point",
        description="φ2(t+1): the scalar fixed point of Eq. (28) over the previous round's reported "
        "statistics (the scalar step of Algorithm 1), or ‖w(t)‖², the fixed point when every "
        "client's step is 0",
    )
    phi2_tol: float = Field(
        1e-3, gt=0.0, description="ε2 of Algorithm 1 for the φ2 fixed point (source: paper §4.3, 1e-3)"
    )


@ALGORITHMS.register("fedent")
class FedEnt(Algorithm):
    """FedEnt (Zheng et al. 2024): per-client, per-round learning rate from the entropy mean-field control."""

    mean_aggregation = False  # population weights and a server step on reported scalars
    federation_counts = "sizes"  # a client solves Eq. (17) with its θ_i = n_i / n: every size, no histogram

    # plain cross-entropy at a per-client rate: the vectorized engine steps each client with its own η

    Params = FedEntParams
    p: FedEntParams
    #: upload values the server needs (counted as communicated); the other probe statistics are metrics
    upload_config: ClassVar[tuple[str, ...]] = ("eta", "s", "G")
    #: the probe statistics uploaded as metrics (the server's diagnostics read them)
    upload_metrics: ClassVar[tuple[str, ...]] = ("eta_raw", "branch", "pbar", "clip", "neg_den", "solver_gap")

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        sizes = ctx.client_sizes.to(F64)
        self.theta = sizes / sizes.sum()  # population θ_i = n_i / n, known to every process of the run

    # ------------------------------------------------------------------ server
    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        server["params"] = [n for n, _ in model.named_parameters()]  # only trainable weights enter w
        server["eta"] = torch.full((self.ctx.num_clients,), float(self.ctx.client.lr), dtype=F64)  # η(−1)
        return {**server, **self.init_estimators(server)}

    def init_estimators(self, server: State) -> State:
        """φ2(1): no client has reported yet, so every η_j is taken as 0 and Eq. (28) gives ‖w(0)‖²."""
        return {"phi2_next": sq_norm(server["weights"], server["params"])}

    def estimator_config(self, server: State) -> tuple[dict[str, Tensor], dict[str, float]]:
        """The mean-field estimates a client needs to solve Eq. (17): (arrays, config)."""
        return {}, {"phi2_next": float(server["phi2_next"])}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        payload = super().broadcast(server, info)
        if info.cid is not None:
            arrays, config = self.estimator_config(server)
            payload.arrays.update(arrays)
            payload.config.update(eta_prev=float(server["eta"][info.cid]), **config)
        return payload

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """FedAvg over the sampled set (Eq. 3); the sampled clients' η_i(t) recorded for Eq. (37), φ2 for
        the next round (Eq. 28); the round's rate, entropy and drift diagnostics as metrics."""
        old = server["weights"]
        state = {**server, "weights": fedavg_mean(uploads)}
        reported = [{**u.payload.metrics, **u.payload.config} for u in uploads]
        eta = torch.tensor([values["eta"] for values in reported], dtype=F64)
        cids = torch.tensor([u.cid for u in uploads], dtype=torch.long)
        dev = state["eta"].device  # on the training device after a resume
        etas = state["eta"].clone()
        etas[cids.to(dev)] = eta.to(dev)  # clients that were not sampled keep theirs
        diag = self.rate_diagnostics(state, uploads, reported)
        estimators, more = self.update_estimators(state, uploads, old)
        return ServerUpdate({**state, **estimators, "eta": etas}, {**diag, **more})

    def rate_diagnostics(
        self, server: State, uploads: list[Upload], reported: list[dict]
    ) -> dict[str, float]:
        """The round's rates η_i(t) and raw rates, the solver's regime, the entropy term of Eq. (8) over the
        uploaded models and the client drift, from the aggregated ``server`` state."""
        names, new = server["params"], server["weights"]

        def col(key: str) -> Tensor:
            return torch.tensor([values[key] for values in reported], dtype=F64)

        cids = torch.tensor([u.cid for u in uploads], dtype=torch.long)
        eta, raw, branch = col("eta"), col("eta_raw"), col("branch")
        states = [u.payload.model_state() for u in uploads]
        sq = torch.tensor([sq_norm(st, names) for st in states], dtype=F64)
        # client drift ‖w_i,E(t) − w(t+1)‖ (bounded by Prop. 4)
        drift = torch.tensor([math.sqrt(sq_dist(st, new, names)) for st in states], dtype=F64)
        pre = self.name
        return {
            f"{pre}_eta_min": float(eta.min()),
            f"{pre}_eta_median": float(eta.median()),
            f"{pre}_eta_max": float(eta.max()),
            f"{pre}_eta_raw_mean": float(raw.mean()),
            f"{pre}_eta_raw_zero": float((raw == 0.0).double().mean()),
            f"{pre}_eta_raw_clip": float(col("clip").mean()),
            **self.solver_diagnostics(reported),
            f"{pre}_fallback": float(((branch != CLOSED_FORM) & (branch != MINIMISED)).double().mean()),
            f"{pre}_entropy": entropy_term(self.theta[cids], sq),
            f"{pre}_drift": float(drift.mean()),
        }

    def solver_diagnostics(self, reported: list[dict]) -> dict[str, float]:
        """Per round: the share of clients in the non-convex regime 1 + cG < 0, and how often (and by how
        much) the cost's minimiser differs from the stationary point of Eq. (23)."""
        if not reported or "neg_den" not in reported[0]:
            return {}
        gap = torch.tensor([abs(v["solver_gap"]) for v in reported], dtype=F64)
        return {
            f"{self.name}_neg_den": sum(v["neg_den"] for v in reported) / len(reported),
            f"{self.name}_solvers_differ": float((gap > 1e-6).double().mean()),
            f"{self.name}_solver_gap_mean": float(gap.mean()),
        }

    def update_estimators(
        self, server: State, uploads: list[Upload], old: Mapping[str, Tensor]
    ) -> tuple[State, dict[str, float]]:
        """φ2 for the next round from Eq. (28), with X = ‖w(t+1)‖² and the participants' (s_j, G_j):
        ``(new server entries, diagnostics)``."""
        pre, used = self.name, float(server["phi2_next"])
        X = sq_norm(server["weights"], server["params"])
        cids = torch.tensor([u.cid for u in uploads], dtype=torch.long)
        pbar = torch.tensor([u.payload.metrics["pbar"] for u in uploads], dtype=F64)
        diag = {f"{pre}_phi2": used, f"{pre}_pbar_median": float(pbar.median())}
        if self.p.phi2_estimator == "global_norm":
            return {"phi2_next": X}, diag
        s = torch.tensor([u.payload.config["s"] for u in uploads], dtype=F64)
        G = torch.tensor([u.payload.config["G"] for u in uploads], dtype=F64)
        theta = self.theta[cids]
        sol = phi2_fixed_point(
            X,
            s,
            G,
            theta,
            theta / theta.sum(),  # the sampled clients stand in for the population
            self.p.beta,
            start=used,
            tol=self.p.phi2_tol,
            printed_eq24=self.p.eq24 == "printed",
            eta_max=self.p.eta_max,
        )
        if not sol.converged:
            log.warning("%s: φ2 fixed point not converged in %d iterations", self.name, sol.iterations)
        diag.update(
            {f"{pre}_phi2_iters": float(sol.iterations), f"{pre}_phi2_converged": float(sol.converged)}
        )
        return {"phi2_next": sol.phi2}, diag

    # ------------------------------------------------------------------ client
    def probe_gradient(self, step: LocalStep) -> list[Tensor]:
        """``∇F_i(w(t))`` in train mode (Algorithm 2 line 4) without disturbing local training: the RNG is
        forked (dropout masks of training stay those of FedAvg) and buffers are restored afterwards."""
        model, client = step.model, step.client
        params = list(model.parameters())
        n = client.num_samples
        seed = derive_seed(self.ctx.seed, PROBE_KEY, step.info.round - 1, client.cid)
        dev = client.x.device
        devices = (
            [dev.index if dev.index is not None else torch.cuda.current_device()]
            if dev.type == "cuda"
            else []
        )
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            model.train()
            if self.p.probe == "batch":
                gen = torch.Generator().manual_seed(seed)
                idx = torch.randperm(n, generator=gen)[: max(1, min(self.ctx.client.batch_size, n))].to(dev)
                loss = self.local_loss(step, Batch(client.x[idx], client.y[idx]))
                grads = list(torch.autograd.grad(loss, params))
            else:
                grads = [torch.zeros_like(p) for p in params]
                for start in range(0, n, PROBE_CHUNK):
                    sl = slice(start, min(start + PROBE_CHUNK, n))
                    part = self.local_loss(step, Batch(client.x[sl], client.y[sl]))
                    share = part * ((sl.stop - sl.start) / n)
                    for g, d in zip(grads, torch.autograd.grad(share, params), strict=True):
                        g.add_(d)
        load_state(model, step.payload.model_state())  # undo the probe's BatchNorm statistics
        return [g.detach() for g in grads]

    def raw_eta(
        self, params: list[Tensor], grads: list[Tensor], payload: Payload, cid: int
    ) -> tuple[float, int, dict]:
        """Eq. (17) solved on ``x = w(t)``: returns ``(η_raw, branch, statistics to upload)``."""
        idx = range(len(params))
        s, G, X = dot(params, grads, idx), dot(grads, grads, idx), dot(params, params, idx)
        theta, phi2 = float(self.theta[cid]), payload.config["phi2_next"]
        bound = (
            None if self.p.grad_bound is None else eq18_bound(theta, X, phi2, self.p.beta, self.p.grad_bound)
        )
        eta_t, branch_t = solve_eta(
            s,
            G,
            X,
            theta,
            phi2,
            self.p.beta,
            printed_eq24=self.p.eq24 == "printed",
            eta_max=self.p.eta_max,
            bound=bound,
        )
        eta, branch = float(eta_t), int(branch_t)
        hi = self.p.eta_max if bound is None else min(self.p.eta_max, float(bound))
        # where 1 + cG < 0 the cost is not convex in η and the stationary point need not minimise it
        K = math.sqrt(G) if self.p.eq24 == "printed" else G
        phi = max(phi2, PHI_FLOOR)
        pbar_s = min(max(theta * (X - 2.0 * eta * s + eta * eta * G) / phi, PBAR_FLOOR), 1.0)
        c = self.p.beta * theta * (1.0 + math.log(pbar_s)) / ((1.0 - self.p.beta) * phi)  # Eq. (17)
        eta_min = float(minimise_cost(s, G, X, theta, phi, self.p.beta, max(hi, 0.0)))
        if self.p.solver == "minimiser":
            eta, branch = eta_min, MINIMISED
        pbar = min(max(theta * (X - 2.0 * eta * s + eta * eta * G) / phi, 0.0), 1.0)
        stats = {
            "s": s,
            "G": G,
            "pbar": pbar,
            "clip": float(eta >= hi),
            "neg_den": float(1.0 + c * K < 0.0),
            "solver_gap": eta_min - float(eta_t),  # minimiser − stationary point
        }
        if branch in (BRACKETED_ROOT, SATURATED) and self.p.fallback == "keep":
            branch = KEPT
        return eta, branch, stats

    def start_local(self, step: LocalStep) -> LocalPlan:
        grads = self.probe_gradient(step)
        params = [p.detach() for p in step.model.parameters()]
        eta_raw, branch, stats = self.raw_eta(params, grads, step.payload, step.cid)
        prev = step.payload.config["eta_prev"]
        # Eq. (37) after clipping; "keep" skips the update on a failed closed form
        eta = prev if branch == KEPT else self.p.gamma * prev + (1.0 - self.p.gamma) * eta_raw
        probe = {"eta": eta, "eta_raw": eta_raw, "branch": float(branch), **stats}
        # one scalar η for all E epochs (Algorithm 2); η and the probe's statistics are this round's only
        return LocalPlan([Phase(epochs=self.ctx.client.epochs, lr=eta)], derived={"probe": probe})

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        out = super().finish_local(step, result)
        probe = step.derived["probe"]  # η for the server's record, (s, G) for Eq. (28); the rest for the logs
        out.upload.config.update({k: v for k, v in probe.items() if k in self.upload_config})
        out.upload.metrics.update({k: v for k, v in probe.items() if k not in self.upload_config})
        return out

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The model it was sent (not the estimators), ``upload_config`` and the probe's statistics."""
        specs = specs_of(broadcast.arrays, lambda k: k.startswith(MODEL_PREFIX))
        return UploadLayout(specs, frozenset(self.upload_config), frozenset(self.upload_metrics))


# ================================================================================================ FedNorm
@ALGORITHMS.register("fednorm")
class FedNorm(FedEnt):
    """FedNorm (Tu et al. 2022, as in FedEnt Eq. 61): the entropy term replaced by ``Σ_j ‖w_i − w‖²``."""

    class Params(RateParams):
        step_estimate: Literal["mean_field", "global_step"] = Field(
            "mean_field",
            description="φ1(t) − φ1(t+1): the one-step mean-field fixed point of Algorithm 1 from the "
            "initial guess φ1 = w(0), which is 0 (so η_raw = 0; derived), or the last observed global step "
            "w(t−1) − w(t), broadcast as a vector (not in paper: a non-degenerate estimate)",
        )

    # not a FedEnt.Params (both extend RateParams): the inherited hooks read FedEnt's own fields only on
    # paths FedNorm overrides (estimators, raw_eta) or never takes (start_local's fallback: closed form only)
    p: Params  # type: ignore[assignment]
    federation_counts = "own"  # θ_i enters only the server's weights: a client's closed form never reads it
    upload_config: ClassVar[tuple[str, ...]] = ("eta",)
    upload_metrics: ClassVar[tuple[str, ...]] = ("eta_raw", "branch", "a", "G", "clip")

    def init_estimators(self, server: State) -> State:
        if self.p.step_estimate == "global_step":
            return {"step": {n: torch.zeros_like(server["weights"][n]) for n in server["params"]}}
        return {}

    def estimator_config(self, server: State) -> tuple[dict[str, Tensor], dict[str, float]]:
        if self.p.step_estimate == "global_step":
            return {STEP_PREFIX + n: v for n, v in server["step"].items()}, {}
        return {}, {}

    def update_estimators(
        self, server: State, uploads: list[Upload], old: Mapping[str, Tensor]
    ) -> tuple[State, dict[str, float]]:
        if self.p.step_estimate == "global_step":
            return {"step": {n: old[n] - server["weights"][n] for n in server["params"]}}, {}
        return {}, {}

    def raw_eta(
        self, params: list[Tensor], grads: list[Tensor], payload: Payload, cid: int
    ) -> tuple[float, int, dict]:
        idx = range(len(grads))
        G = dot(grads, grads, idx)
        steps = [v for k, v in payload.arrays.items() if k.startswith(STEP_PREFIX)]
        a = dot(steps, grads, idx) if steps else 0.0  # mean_field: the fixed point has φ1(t+1) = φ1(t)
        eta = float(eta_fednorm(a, G, self.p.beta, self.ctx.num_clients, self.p.eta_max))
        return eta, CLOSED_FORM, {"a": a, "G": G, "clip": float(eta >= self.p.eta_max)}
