"""FedEnt (Zheng, Yuan, Wang, Duan 2024, "Adaptive Federated Learning via New Entropy Approach",
arXiv:2303.14966v3), with the distance-metric variants FedCos and FedNorm of its §6.2.3.

FedEnt is FedAvg with one scalar learning rate ``η_i(t)`` per client and round, held for all ``E`` local
epochs (Algorithm 2). It solves the mean-field optimal-control problem of Eqs. (15)–(16): the cost is
``β Σ_j p̄_j log p̄_j + (1 − β) η_i²`` with ``p̄_i = θ_i ‖w_i‖² / φ2`` (Eq. 13), and Pontryagin's conditions
(Eqs. 19–22) give Proposition 1, Eq. (17)/(23):

    η = c(η) (s − η G),   c(η) = β θ_i (1 + log p̄(η)) / ((1 − β) φ2(t+1)),   p̄(η) = θ_i ‖x − η g‖² / φ2(t+1)

with ``x = φ1(t)``, ``g = ∇F_i(x)``, ``s = xᵀg``, ``G = ‖g‖²``; hence Eq. (24) ``η = max{0, c s / (1 + c G)}``
(the paper prints ``‖g‖`` for ``‖g‖²``: option ``eq24="printed"``). ``p̄`` still depends on ``η`` and the
paper gives no procedure; we solve the scalar equation by damped substitution with a bracketed-root
fallback and clip to ``[0, η_max]`` (docs/decisions.md, "FedEnt: solving the implicit Eq. (23)"). The value
used is the EMA of Eq. (37), ``η_i(t) = γ η_i(t−1) + (1 − γ) η_raw``, seeded with ``η_i(−1) = client.lr``
(docs/decisions.md, "FedEnt: initial rate η_i(−1)"); aggregation is FedAvg's (Eq. 3).

Mean-field estimators (Definition 2, Eqs. 11–12). ``φ1(t)`` is the actual global model ``w(t)``, the
quantity it estimates (docs/decisions.md, "FedEnt: which point φ1(t) is"). ``φ2(t+1)`` is the scalar fixed
point of Eq. (28), ``φ2(t+1) = Σ_j θ_j ‖φ1(t) − A_j(φ1(t), φ2(t+1)) g_j‖²`` (once φ1(t) and the gradients
are known, the only unknown of Algorithm 1 at step t), solved by the server once per round. The paper
evaluates it before training (Algorithm 1) with every client's gradient at every ``φ1(t)``; the server
here has no client data, so it uses the statistics ``(s_j, G_j)`` that the previous round's participants
reported (see ``phi2_fixed_point``, docs/algorithms.md and docs/decisions.md,
"FedEnt: when φ2 is computed"). The full forward pass of Algorithm 1 with a gradient oracle is
:func:`mean_field_trajectory`.

FedCos (Eq. 59): FedAvg whose aggregation weights are the cosine similarities between local and global
models. FedNorm (Eq. 61): FedEnt's machinery with the cost ``β Σ_j ‖w_i − w‖²`` in place of the entropy,
whose Hamiltonian solution is ``η = max{0, (φ1(t) − φ1(t+1))ᵀ g / ((1 − β)/(β N) + ‖g‖²)}`` (derived with
the steps of the proof of Proposition 1, §4.2; the paper refers to Tu et al. 2022 for it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    Context,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    Payload,
    Phase,
    RoundInfo,
    Scratch,
    State,
    Upload,
    load_state,
    sample_weights,
    weighted_average,
)
from fedskew.seeding import derive_seed

log = logging.getLogger("fedskew.algorithms.fedent")

F64 = torch.float64
PROBE_KEY = 0xE7E7  # seed key of the mini-batch that probes ∇F_i(w(t)) (Algorithm 2, line 4)
PBAR_FLOOR = 1e-12  # clamp p̄ to [1e-12, 1] before the log (a safeguard; not in paper)
PHI_FLOOR = 1e-30  # φ2 > 0; a zero model would divide by zero
SINGULAR = 1e-12  # |1 + cG| below this: the closed form is singular, use the root search
PROBE_CHUNK = 1024  # chunk size of the full local gradient (probe="full")
STEP_PREFIX = "mf_step."  # FedNorm: payload prefix of the estimate of φ1(t) − φ1(t+1)

#: how the raw learning rate was obtained
CLOSED_FORM, BRACKETED_ROOT, SATURATED, KEPT, MINIMISED = 0, 1, 2, 3, 4


# ================================================================================================ pure math
def _f64(v: Tensor | float) -> Tensor:
    return torch.as_tensor(v, dtype=F64)


def solve_eta(
    s: Tensor | float,
    G: Tensor | float,
    X: Tensor | float,
    theta: Tensor | float,
    phi2_next: Tensor | float,
    beta: float,
    *,
    printed_eq24: bool = False,
    eta_max: float = 1.0,
    bound: Tensor | float | None = None,
    max_inner: int = 50,
    tol: float = 1e-10,
    damping: float = 0.5,
    n_grid: int = 200,
) -> tuple[Tensor, Tensor]:
    """FedEnt's raw step size (Prop. 1, Eqs. 17/23/24) for a batch of clients, vectorised, in float64.

    ``s = xᵀg``, ``G = ‖g‖²``, ``X = ‖x‖²``; all arguments broadcast together. Returns ``(eta, branch)``:
    ``eta`` in ``[0, min(eta_max, bound)]``, always finite; ``branch`` is :data:`CLOSED_FORM` (damped
    substitution of ``η = max{0, c s / (1 + c K)}`` converged), :data:`BRACKETED_ROOT` (smallest root of
    the division-free residual ``η − c(η)(s − η K)`` by grid bracketing + bisection) or :data:`SATURATED`
    (no root: the side the residual points to). ``K = G`` (the algebra of Eq. 23) or ``√G`` (``printed_eq24``:
    Eq. 24 as printed). ``bound`` is the optional Eq. (18) clip.
    """
    s, G, X, theta, phi = torch.broadcast_tensors(_f64(s), _f64(G), _f64(X), _f64(theta), _f64(phi2_next))
    phi = phi.clamp_min(PHI_FLOOR)
    hi = torch.full_like(s, float(eta_max))
    if bound is not None:  # a NaN bound (degenerate inputs) leaves eta_max
        b = _f64(bound).expand_as(s)
        hi = torch.where(torch.isnan(b), hi, torch.minimum(hi, b.clamp_min(0.0)))
    K = G.sqrt() if printed_eq24 else G
    scale = beta * theta / ((1.0 - beta) * phi)  # c = scale · (1 + log p̄)
    terms = (s, G, X, theta, phi, scale, K)

    # 1) damped substitution from η = 0 (not in paper): plain for 3 passes, then damped
    eta = torch.zeros_like(s)
    ok = torch.zeros_like(s, dtype=torch.bool)
    active = torch.ones_like(ok)
    for k in range(max_inner):
        if not bool(active.any()):
            break
        c = _c_of(eta, *terms)
        den = 1.0 + c * K
        new = torch.minimum((c * s / den).clamp_min(0.0), hi)  # paper: max{0, ·}; domain η ∈ [0, 1]
        bad = (den.abs() < SINGULAR) | ~torch.isfinite(new)
        conv = active & ~bad & ((new - eta).abs() <= tol * eta.abs().clamp_min(1.0))
        step = new if k < 3 else (1.0 - damping) * eta + damping * new
        eta = torch.where(conv, new, torch.where(active & ~bad, step, eta))
        ok |= conv
        active &= ~conv & ~bad
    branch = torch.full_like(s, CLOSED_FORM, dtype=torch.long)

    # 2) fallback (singular, non-finite or not converged): smallest root of the residual on [0, hi]
    idx = (~ok).reshape(-1).nonzero().flatten()
    if idx.numel():
        sub = [t.reshape(-1)[idx, None] for t in terms]  # [m, 1] each
        hi_m = hi.reshape(-1)[idx, None]

        def residual(e: Tensor) -> Tensor:  # Eq. (23) without division: η − c(η)(s − η K)
            return e - _c_of(e, *sub) * (sub[0] - e * sub[6])

        grid = hi_m * torch.linspace(0.0, 1.0, n_grid + 1, dtype=F64)  # [m, n_grid + 1]
        vals = residual(grid)
        fa, fb = vals[:, :-1], vals[:, 1:]
        change = (fa == 0.0) | (fa * fb < 0.0)  # NaN compares false: never a bracket
        has = change.any(1)
        first = change.int().argmax(1, keepdim=True)
        a, b, f_a = grid.gather(1, first), grid.gather(1, first + 1), vals.gather(1, first)
        exact = f_a == 0.0
        for _ in range(60):
            m = 0.5 * (a + b)
            fm = residual(m)
            left = f_a * fm <= 0.0
            b = torch.where(left, m, b)
            a, f_a = torch.where(left, a, m), torch.where(left, f_a, fm)
        root = torch.where(exact, a, 0.5 * (a + b)).squeeze(1)
        edge = torch.where(vals[:, -1] < 0.0, hi_m[:, 0], torch.zeros_like(root))
        eta, branch = eta.reshape(-1).clone(), branch.reshape(-1).clone()
        eta[idx] = torch.where(has, root, edge)
        branch[idx] = torch.where(has, BRACKETED_ROOT, SATURATED)
        eta, branch = eta.reshape(ok.shape), branch.reshape(ok.shape)
    eta = torch.minimum(torch.nan_to_num(eta, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0.0), hi)
    return eta, branch


def _c_of(
    eta: Tensor, s: Tensor, G: Tensor, X: Tensor, theta: Tensor, phi: Tensor, scale: Tensor, K: Tensor
) -> Tensor:
    """``c(η) = β θ (1 + log p̄(η)) / ((1 − β) φ2)`` with ``p̄(η) = θ ‖x − ηg‖² / φ2`` clamped to [1e-12, 1]."""
    sq = X - 2.0 * eta * s + eta * eta * G  # ‖x − ηg‖²
    p = (theta * sq / phi).clamp(PBAR_FLOOR, 1.0)
    return scale * (1.0 + torch.log(p))


def mean_field_cost(
    eta: Tensor, X: Tensor, s: Tensor, G: Tensor, theta: Tensor, phi: Tensor, beta: float
) -> Tensor:
    """Client i's share of the mean-field cost of Eqs. (15)–(16) at one step, the other clients fixed:
    ``H(η) = β p̄(η) log p̄(η) + (1 − β) η²`` with ``p̄(η) = θ ‖x − ηg‖² / φ2(t+1)`` clamped to [1e-12, 1].
    Its stationary points are the solutions of Eq. (23)."""
    p = (theta * (X - 2.0 * eta * s + eta * eta * G) / phi).clamp(PBAR_FLOOR, 1.0)
    return beta * p * torch.log(p) + (1.0 - beta) * eta * eta


def minimise_cost(
    s: Tensor | float,
    G: Tensor | float,
    X: Tensor | float,
    theta: Tensor | float,
    phi2_next: Tensor | float,
    beta: float,
    hi: Tensor | float,
    *,
    n_grid: int = 400,
    refine: int = 60,
) -> Tensor:
    """The minimiser of :func:`mean_field_cost` on ``[0, hi]`` (not in paper), vectorised in float64.

    Proposition 1 takes the stationary point of Eq. (23) as optimal because ``∂²H/∂η² > 0``, but ``H`` is
    not convex in ``η`` where ``1 + c G < 0``: there the root can be a maximum and the minimum sits on
    the boundary. Grid search over ``n_grid + 1`` points, then golden-section refinement in the bracket
    around the best grid point (the smallest ``η`` among ties)."""
    s, G, X, theta, phi, hi = torch.broadcast_tensors(
        _f64(s), _f64(G), _f64(X), _f64(theta), _f64(phi2_next).clamp_min(PHI_FLOOR), _f64(hi)
    )
    args = [t.reshape(-1, 1) for t in (X, s, G, theta, phi)]
    top = hi.reshape(-1, 1)
    grid = top * torch.linspace(0.0, 1.0, n_grid + 1, dtype=F64)  # [m, n_grid + 1]
    best = mean_field_cost(grid, *args, beta).argmin(1, keepdim=True)
    step = top / n_grid
    a = (grid.gather(1, best) - step).clamp_min(0.0)
    b = torch.minimum(grid.gather(1, best) + step, top)
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(refine):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        left = mean_field_cost(c, *args, beta) <= mean_field_cost(d, *args, beta)
        a, b = torch.where(left, a, c), torch.where(left, d, b)
    inner = 0.5 * (a + b)
    candidates = torch.cat([inner, grid.gather(1, best)], 1)  # keep the grid point if it is lower
    pick = mean_field_cost(candidates, *args, beta).argmin(1, keepdim=True)
    return candidates.gather(1, pick).reshape(s.shape)


def eq18_bound(
    theta: Tensor | float, X: Tensor | float, phi2_next: Tensor | float, beta: float, D: float
) -> Tensor:
    """The paper's upper bound, Eq. (18)/(25): ``2 β θ D ‖φ1‖ / ((1 − β) φ2(t+1))`` (rigorous only when
    ``p̄ ≥ 1/e``, i.e. ``c ≥ 0``: the step of Eq. (25) assumes ``|1 + log p| ≤ 2``, false for ``p < e^−3``)."""
    return (
        2.0 * beta * _f64(theta) * D * _f64(X).sqrt() / ((1.0 - beta) * _f64(phi2_next).clamp_min(PHI_FLOOR))
    )


@dataclass
class Phi2Solution:
    phi2: float  # φ2(t+1)
    eta: Tensor  # the clients' raw η at that φ2
    iterations: int
    converged: bool


def phi2_fixed_point(
    X: float,
    s: Tensor,
    G: Tensor,
    theta: Tensor,
    weights: Tensor,
    beta: float,
    *,
    start: float | None = None,
    tol: float = 1e-3,
    max_iter: int = 50,
    damping: float = 0.5,
    printed_eq24: bool = False,
    eta_max: float = 1.0,
) -> Phi2Solution:
    """The scalar mean-field equation (28): ``Φ = Σ_j w_j (X − 2 η_j s_j + η_j² G_j)``, ``η_j = A_j(X, Φ)``.

    ``theta`` are the population weights inside each client's η (Eq. 17); ``weights`` the weights of the
    sum (``theta`` itself over the whole population, renormalised over a subset otherwise). Substitution
    from ``start`` (default ``X``), plain for 3 passes then damped; stops when ``|ΔΦ| < tol`` (ε2 of
    Algorithm 1). Not converged after ``max_iter``: the last iterate is kept (flag ``converged``).
    """
    s, G, theta, weights = _f64(s), _f64(G), _f64(theta), _f64(weights)
    phi = float(X) if start is None else float(start)
    if s.numel() == 0:
        return Phi2Solution(float(X), s.clone(), 0, True)
    converged, k = False, 0
    for k in range(1, max_iter + 1):
        eta, _ = solve_eta(s, G, X, theta, phi, beta, printed_eq24=printed_eq24, eta_max=eta_max)
        sq = (X - 2.0 * eta * s + eta * eta * G).clamp_min(0.0)  # stale statistics may break Cauchy–Schwarz
        new = max(float((weights * sq).sum()), PHI_FLOOR)
        if abs(new - phi) < tol:
            phi, converged = new, True
            break
        phi = new if k <= 3 else (1.0 - damping) * phi + damping * new
    eta, _ = solve_eta(s, G, X, theta, phi, beta, printed_eq24=printed_eq24, eta_max=eta_max)
    return Phi2Solution(phi, eta, k, converged)


@dataclass
class MeanField:
    phi1: Tensor  # [T + 1, d]
    phi2: Tensor  # [T + 1]
    eta: Tensor  # [T, N] raw learning rates along the trajectory
    iterations: list[int]
    converged: bool


def mean_field_trajectory(
    w0: Tensor,
    grads_at: Callable[[int, Tensor], Tensor],
    theta: Tensor,
    beta: float,
    rounds: int,
    *,
    tol: float = 1e-3,
    max_iter: int = 50,
    printed_eq24: bool = False,
    eta_max: float = 1.0,
) -> MeanField:
    """Algorithm 1 as a single forward pass (its sweeps in Gauss–Seidel order, converged): for
    ``t = 0..T−1`` the only unknown is the scalar ``φ2(t+1)`` (Eq. 28), then
    ``φ1(t+1) = φ1(t) − Σ_i θ_i η_i g_i`` (Eqs. 11, 16). ``grads_at(t, x)`` returns the ``[N, d]`` client
    gradients at ``x`` (fixed mini-batches make the map deterministic). The result is a fixed point of the
    paper's map Γ (Eqs. 26–27) for the same gradients.
    """
    theta = _f64(theta)
    x = w0.detach().to(F64).reshape(-1)
    phi1, phi2, etas, iters, ok = [x], [float(x @ x)], [], [], True
    for t in range(rounds):
        g = grads_at(t, phi1[t].to(w0.dtype).view_as(w0)).detach().to(F64).reshape(theta.numel(), -1)
        X = float(phi1[t] @ phi1[t])
        sol = phi2_fixed_point(
            X,
            g @ phi1[t],
            (g * g).sum(1),
            theta,
            theta,
            beta,
            start=phi2[t] if t else X,
            tol=tol,
            max_iter=max_iter,
            printed_eq24=printed_eq24,
            eta_max=eta_max,
        )
        phi1.append(phi1[t] - (theta * sol.eta) @ g)
        phi2.append(sol.phi2)
        etas.append(sol.eta)
        iters.append(sol.iterations)
        ok &= sol.converged
    eta = torch.stack(etas) if etas else torch.zeros(0, theta.numel(), dtype=F64)
    return MeanField(torch.stack(phi1), torch.tensor(phi2, dtype=F64), eta, iters, ok)


def entropy_term(theta: Tensor, sq_norms: Tensor) -> float:
    """Definition 1, Eq. (8): ``Σ_i p_i log p_i``, ``p_i = θ_i ‖w_i‖² / Σ_j θ_j ‖w_j‖²`` (``0 log 0 = 0``)."""
    mass = _f64(theta) * _f64(sq_norms)
    p = mass / mass.sum().clamp_min(PHI_FLOOR)
    return float(torch.xlogy(p, p).sum())


def eta_fednorm(a: Tensor | float, G: Tensor | float, beta: float, n: int, eta_max: float = 1.0) -> Tensor:
    """FedNorm's step size (Eq. 61 through the Hamiltonian steps of Proposition 1's proof; derived):
    ``max{0, a / ((1 − β)/(β N) + G)}``, ``a = (φ1(t) − φ1(t+1))ᵀ g``, ``G = ‖g‖²``, clipped to η_max."""
    a, G = _f64(a), _f64(G)
    if beta == 0.0:  # no distance term: the quadratic penalty alone gives η = 0
        return torch.zeros_like(a + G)
    eta = a / ((1.0 - beta) / (beta * n) + G)
    return torch.nan_to_num(eta, nan=0.0, posinf=eta_max, neginf=0.0).clamp(0.0, eta_max)


def _sq_norm(state: Mapping[str, Tensor], names: list[str]) -> float:
    return float(sum(state[n].double().pow(2).sum() for n in names))


def _sq_dist(a: Mapping[str, Tensor], b: Mapping[str, Tensor], names: list[str]) -> float:
    return float(sum((a[n].double() - b[n].double()).pow(2).sum() for n in names))


def _dot(a: Mapping | Sequence[Tensor], b: Mapping | Sequence[Tensor], keys: Iterable) -> float:
    """``Σ_k ⟨a[k], b[k]⟩`` in float64 over named (state dicts) or positional (parameter lists) tensors."""
    return float(sum((a[k].double() * b[k].double()).sum() for k in keys))


def _cosine(
    v: Mapping[str, Tensor],
    ref: Mapping[str, Tensor],
    ref_norm: float,
    names: list[str],
    origin: Mapping[str, Tensor] | None,
) -> float:
    """``cos(v − origin, ref)`` tensor by tensor in float64 (no float64 copy of a whole model is kept)."""
    dot = sq = 0.0
    for n in names:
        x = v[n].double() if origin is None else v[n].double() - origin[n].double()
        dot += float((x * ref[n].double()).sum())
        sq += float((x * x).sum())
    return dot / max(math.sqrt(sq) * ref_norm, PHI_FLOOR)


# ================================================================================================ FedEnt
class RateParams(HyperParams):
    """Shared by FedEnt and FedNorm: the control weight, the EMA and the probe."""

    beta: float = Field(
        0.99,
        ge=0.0,
        lt=1.0,
        description="weight β of the distance term against (1 − β) η² (source: paper §6.1, β = 0.99 for "
        "FedEnt and FedNorm; β = 0 allowed as an ablation, the paper states β ∈ (0, 1))",
    )
    gamma: float = Field(
        0.99,
        ge=0.0,
        le=1.0,
        description="EMA decay γ of Eq. (37) (source: paper §6.1/§6.2.5, γ = 0.99; γ = 1 freezes η at "
        "client.lr, i.e. FedAvg — an ablation)",
    )
    eta_max: float = Field(
        1.0, gt=0.0, description="clip of the raw η (source: paper Eq. 7/§4.2, domain η ∈ [0, 1])"
    )
    probe: Literal["batch", "full"] = Field(
        "batch",
        description="gradient ∇F_i(w(t)) for η: one seeded mini-batch of client.batch_size (source: "
        "Algorithm 2 line 4) or the full local gradient (not in paper; affordable on small data)",
    )


@ALGORITHMS.register("fedent")
class FedEnt(Algorithm):
    """FedEnt (Zheng et al. 2024): per-client, per-round learning rate from the entropy mean-field control."""

    # plain cross-entropy at a per-client rate: the vectorized engine steps each client with its own η
    vectorizable = True
    loss_reads = frozenset()

    class Params(RateParams):
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

    p: Params
    #: upload values the server needs (counted as communicated); the other probe statistics are metrics
    upload_config: ClassVar[tuple[str, ...]] = ("eta", "s", "G")

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        sizes = ctx.client_sizes.to(F64)
        self.theta = sizes / sizes.sum()  # population θ_i = n_i / n, known to every process of the run

    # ------------------------------------------------------------------ server
    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        server["params"] = [n for n, _ in model.named_parameters()]  # only trainable weights enter w
        server["eta"] = torch.full((self.ctx.num_clients,), float(self.ctx.client.lr), dtype=F64)  # η(−1)
        server["diag"] = {}
        return {**server, **self.init_estimators(server)}

    def init_estimators(self, server: State) -> State:
        """φ2(1): no client has reported yet, so every η_j is taken as 0 and Eq. (28) gives ‖w(0)‖²."""
        return {"phi2_next": _sq_norm(server["weights"], server["params"])}

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

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> State:
        old = server["weights"]
        server = super().aggregate(server, uploads, info)  # FedAvg over the sampled set (Eq. 3)
        names = server["params"]
        new = server["weights"]

        reported = [{**u.payload.metrics, **u.payload.config} for u in uploads]

        def col(key: str) -> Tensor:
            return torch.tensor([values[key] for values in reported], dtype=F64)

        cids = torch.tensor([u.cid for u in uploads], dtype=torch.long)
        eta, raw, branch = col("eta"), col("eta_raw"), col("branch")
        dev = server["eta"].device  # on the training device after a resume
        etas = server["eta"].clone()
        etas[cids.to(dev)] = eta.to(dev)  # clients that were not sampled keep theirs
        states = [u.payload.model_state() for u in uploads]
        sq = torch.tensor([_sq_norm(st, names) for st in states], dtype=F64)
        # client drift ‖w_i,E(t) − w(t+1)‖ (bounded by Prop. 4)
        drift = torch.tensor([math.sqrt(_sq_dist(st, new, names)) for st in states], dtype=F64)
        pre = self.name
        diag = {
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
        estimators, more = self.update_estimators(server, uploads, old)
        return {**server, **estimators, "eta": etas, "diag": {**diag, **more}}

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
        X = _sq_norm(server["weights"], server["params"])
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

    def round_metrics(self, server: State) -> dict[str, float]:
        return dict(server.get("diag", {}))

    # ------------------------------------------------------------------ client
    def probe_gradient(
        self, model: nn.Module, payload: Payload, state: State, client: ClientView, info: RoundInfo
    ) -> list[Tensor]:
        """``∇F_i(w(t))`` in train mode (Algorithm 2 line 4) without disturbing local training: the RNG is
        forked (dropout masks of training stay those of FedAvg) and buffers are restored afterwards."""
        params = list(model.parameters())
        n = client.num_samples
        seed = derive_seed(self.ctx.seed, PROBE_KEY, info.round - 1, client.cid)
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
                loss = self.local_loss(model, Batch(client.x[idx], client.y[idx]), payload, state, Scratch())
                grads = list(torch.autograd.grad(loss, params))
            else:
                grads = [torch.zeros_like(p) for p in params]
                for start in range(0, n, PROBE_CHUNK):
                    sl = slice(start, min(start + PROBE_CHUNK, n))
                    part = self.local_loss(
                        model, Batch(client.x[sl], client.y[sl]), payload, state, Scratch()
                    )
                    share = part * ((sl.stop - sl.start) / n)
                    for g, d in zip(grads, torch.autograd.grad(share, params), strict=True):
                        g.add_(d)
        load_state(model, payload.model_state())  # undo the probe's BatchNorm statistics
        return [g.detach() for g in grads]

    def raw_eta(
        self, params: list[Tensor], grads: list[Tensor], payload: Payload, cid: int
    ) -> tuple[float, int, dict]:
        """Eq. (17) solved on ``x = w(t)``: returns ``(η_raw, branch, statistics to upload)``."""
        idx = range(len(params))
        s, G, X = _dot(params, grads, idx), _dot(grads, grads, idx), _dot(params, params, idx)
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

    def start_local(
        self, model: nn.Module, payload: Payload, state: State, client: ClientView, info: RoundInfo
    ) -> LocalPlan:
        grads = self.probe_gradient(model, payload, state, client, info)
        params = [p.detach() for p in model.parameters()]
        eta_raw, branch, stats = self.raw_eta(params, grads, payload, client.cid)
        prev = payload.config["eta_prev"]
        # Eq. (37) after clipping; "keep" skips the update on a failed closed form
        eta = prev if branch == KEPT else self.p.gamma * prev + (1.0 - self.p.gamma) * eta_raw
        probe = {"eta": eta, "eta_raw": eta_raw, "branch": float(branch), **stats}
        # one scalar η for all E epochs (Algorithm 2)
        return LocalPlan([Phase(epochs=self.ctx.client.epochs, lr=eta)], {**state, "probe": probe})

    def finish_local(
        self,
        model: nn.Module,
        payload: Payload,
        state: State,
        client: ClientView,
        scratch: Scratch,
        result: LocalResult,
        info: RoundInfo,
    ) -> LocalOutput:
        out = super().finish_local(model, payload, state, client, scratch, result, info)
        probe = state["probe"]  # η for the server's record, (s, G) for Eq. (28); the rest for the logs
        out.upload.config.update({k: v for k, v in probe.items() if k in self.upload_config})
        out.upload.metrics.update({k: v for k, v in probe.items() if k not in self.upload_config})
        return out


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

    p: Params
    upload_config: ClassVar[tuple[str, ...]] = ("eta",)

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
        G = _dot(grads, grads, idx)
        steps = [v for k, v in payload.arrays.items() if k.startswith(STEP_PREFIX)]
        a = _dot(steps, grads, idx) if steps else 0.0  # mean_field: the fixed point has φ1(t+1) = φ1(t)
        eta = float(eta_fednorm(a, G, self.p.beta, self.ctx.num_clients, self.p.eta_max))
        return eta, CLOSED_FORM, {"a": a, "G": G, "clip": float(eta >= self.p.eta_max)}


# ================================================================================================ FedCos
@ALGORITHMS.register("fedcos")
class FedCos(Algorithm):
    """FedCos (after Wu & Wang 2021, as in FedEnt Eq. 59): aggregation weights = cos(w_i, w), static lr."""

    vectorizable = True  # plain cross-entropy; only the aggregation differs
    loss_reads = frozenset()

    class Params(HyperParams):
        cosine_of: Literal["models", "updates"] = Field(
            "models",
            description="cosine between the local and global models (Eq. 59 as printed) or between the "
            "local update w_i − w(t) and the sample-weighted mean update (Wu & Wang 2021's angle)",
        )
        sample_weighted: bool = Field(
            False,
            description="multiply the cosine weights by n_i before normalising (not in paper; default: "
            "cosines clamped at 0 and normalised over the sampled clients, as Eq. 59 leaves open)",
        )

    p: Params

    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        server["params"] = [n for n, _ in model.named_parameters()]
        server["diag"] = {}
        return server

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> State:
        names, w = server["params"], server["weights"]
        states = [u.payload.model_state() for u in uploads]
        origin: Mapping[str, Tensor] | None = None  # models: cos(w_i, w); updates: cos(w_i − w, w̄ − w)
        ref: Mapping[str, Tensor] = w
        if self.p.cosine_of == "updates":
            mean = weighted_average(states, sample_weights(uploads))
            origin, ref = w, {n: mean[n] - w[n] for n in names}
        ref_norm = math.sqrt(_dot(ref, ref, names))
        cos = torch.tensor([_cosine(st, ref, ref_norm, names, origin) for st in states], dtype=F64)
        weights = cos.clamp_min(0.0)
        if self.p.sample_weighted:
            weights = weights * sample_weights(uploads)
        # all cosines ≤ 0 (or a zero update): no direction information, fall back to FedAvg's weights
        weights = weights / weights.sum() if float(weights.sum()) > 0.0 else sample_weights(uploads)
        diag = {
            "fedcos_cos_min": float(cos.min()),
            "fedcos_cos_mean": float(cos.mean()),
            "fedcos_weight_max": float(weights.max()),
        }
        return {**server, "weights": weighted_average(states, weights), "diag": diag}

    def round_metrics(self, server: State) -> dict[str, float]:
        return dict(server.get("diag", {}))
