"""FedEnt's numerical core (Zheng, Yuan, Wang, Duan 2024, "Adaptive Federated Learning via New Entropy
Approach", arXiv:2303.14966v3): the step size of Proposition 1, the mean-field estimators of Algorithm 1 and
FedNorm's closed form (§6.2.3), as pure float64 functions. The algorithms live in
:mod:`fedskew.algorithms.fedent` (FedEnt, FedNorm) and :mod:`fedskew.algorithms.fedcos` (FedCos).

FedEnt solves the mean-field optimal-control problem of Eqs. (15)–(16): the cost is
``β Σ_j p̄_j log p̄_j + (1 − β) η_i²`` with ``p̄_i = θ_i ‖w_i‖² / φ2`` (Eq. 13), and Pontryagin's conditions
(Eqs. 19–22) give Proposition 1, Eq. (17)/(23):

    η = c(η) (s − η G),   c(η) = β θ_i (1 + log p̄(η)) / ((1 − β) φ2(t+1)),   p̄(η) = θ_i ‖x − η g‖² / φ2(t+1)

with ``x = φ1(t)``, ``g = ∇F_i(x)``, ``s = xᵀg``, ``G = ‖g‖²``; hence Eq. (24) ``η = max{0, c s / (1 + c G)}``
(the paper prints ``‖g‖`` for ``‖g‖²``: option ``eq24="printed"``). ``p̄`` still depends on ``η`` and the
paper gives no procedure; we solve the scalar equation by damped substitution with a bracketed-root
fallback and clip to ``[0, η_max]`` (:func:`solve_eta`; docs/decisions.md, "FedEnt: solving the implicit
Eq. (23)").

Mean-field estimators (Definition 2, Eqs. 11–12). ``φ2(t+1)`` is the scalar fixed point of Eq. (28),
``φ2(t+1) = Σ_j θ_j ‖φ1(t) − A_j(φ1(t), φ2(t+1)) g_j‖²`` (once φ1(t) and the gradients are known, the only
unknown of Algorithm 1 at step t): :func:`phi2_fixed_point`. The full forward pass of Algorithm 1 with a
gradient oracle is :func:`mean_field_trajectory`.

FedNorm (Eq. 61): FedEnt's machinery with the cost ``β Σ_j ‖w_i − w‖²`` in place of the entropy, whose
Hamiltonian solution is ``η = max{0, (φ1(t) − φ1(t+1))ᵀ g / ((1 − β)/(β N) + ‖g‖²)}`` (derived with the
steps of the proof of Proposition 1, §4.2; the paper refers to Tu et al. 2022 for it): :func:`eta_fednorm`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from fedskew import numerics

F64 = torch.float64
PBAR_FLOOR = 1e-12  # clamp p̄ to [1e-12, 1] before the log (a safeguard; not in paper)
PHI_FLOOR = 1e-30  # φ2 > 0; a zero model would divide by zero
SINGULAR = 1e-12  # |1 + cG| below this: the closed form is singular, use the root search

#: how the raw learning rate was obtained
CLOSED_FORM, BRACKETED_ROOT, SATURATED, KEPT, MINIMISED = 0, 1, 2, 3, 4


def to_f64(v: Tensor | float) -> Tensor:
    """``v`` as a float64 tensor (no copy when it already is one)."""
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
    s, G, X, theta, phi = cast(  # torch.broadcast_tensors is unannotated
        "tuple[Tensor, ...]",
        torch.broadcast_tensors(to_f64(s), to_f64(G), to_f64(X), to_f64(theta), to_f64(phi2_next)),
    )
    phi = phi.clamp_min(PHI_FLOOR)
    hi = torch.full_like(s, float(eta_max))
    if bound is not None:  # a NaN bound (degenerate inputs) leaves eta_max
        b = to_f64(bound).expand_as(s)
        hi = torch.where(torch.isnan(b), hi, torch.minimum(hi, b.clamp_min(0.0)))
    K = numerics.sqrt(G) if printed_eq24 else G
    scale = beta * theta / ((1.0 - beta) * phi)  # c = scale · (1 + log p̄)
    terms = (s, G, X, theta, phi, scale, K)
    eta, ok = _substitute(terms, hi, max_inner, tol, damping)
    branch = torch.full_like(s, CLOSED_FORM, dtype=torch.long)

    # 2) fallback (singular, non-finite or not converged): smallest root of the residual on [0, hi]
    idx = (~ok).reshape(-1).nonzero().flatten()
    if idx.numel():
        found, has = _smallest_root(terms, hi, idx, n_grid)
        eta, branch = eta.reshape(-1).clone(), branch.reshape(-1).clone()
        eta[idx] = found
        branch[idx] = torch.where(has, BRACKETED_ROOT, SATURATED)
        eta, branch = eta.reshape(ok.shape), branch.reshape(ok.shape)
    eta = torch.minimum(torch.nan_to_num(eta, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0.0), hi)
    return eta, branch


def _substitute(
    terms: tuple[Tensor, ...], hi: Tensor, max_inner: int, tol: float, damping: float
) -> tuple[Tensor, Tensor]:
    """1) damped substitution of Eq. (24) from η = 0 (not in paper): plain for 3 passes, then damped.
    Returns ``(eta, converged)``."""
    s, K = terms[0], terms[6]
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
    return eta, ok


def _smallest_root(terms: tuple[Tensor, ...], hi: Tensor, idx: Tensor, n_grid: int) -> tuple[Tensor, Tensor]:
    """The smallest root on ``[0, hi]`` of the residual of Eq. (23) for the flat entries ``idx``: grid
    bracketing, then 60 bisections. Returns ``(eta, has_root)``; without a root, the side the residual
    points to (``hi`` if it stays negative, else 0)."""
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
    return torch.where(has, root, edge), has


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
    s, G, X, theta, phi, hi = cast(  # torch.broadcast_tensors is unannotated
        "tuple[Tensor, ...]",
        torch.broadcast_tensors(
            to_f64(s), to_f64(G), to_f64(X), to_f64(theta), to_f64(phi2_next).clamp_min(PHI_FLOOR), to_f64(hi)
        ),
    )
    args = (X.reshape(-1, 1), s.reshape(-1, 1), G.reshape(-1, 1), theta.reshape(-1, 1), phi.reshape(-1, 1))
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
    numerator = 2.0 * beta * to_f64(theta) * D * numerics.sqrt(to_f64(X))
    return numerator / ((1.0 - beta) * to_f64(phi2_next).clamp_min(PHI_FLOOR))


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
    s, G, theta, weights = to_f64(s), to_f64(G), to_f64(theta), to_f64(weights)
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
    theta = to_f64(theta)
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
    mass = to_f64(theta) * to_f64(sq_norms)
    p = mass / mass.sum().clamp_min(PHI_FLOOR)
    return float(torch.xlogy(p, p).sum())


def eta_fednorm(a: Tensor | float, G: Tensor | float, beta: float, n: int, eta_max: float = 1.0) -> Tensor:
    """FedNorm's step size (Eq. 61 through the Hamiltonian steps of Proposition 1's proof; derived):
    ``max{0, a / ((1 − β)/(β N) + G)}``, ``a = (φ1(t) − φ1(t+1))ᵀ g``, ``G = ‖g‖²``, clipped to η_max."""
    a, G = to_f64(a), to_f64(G)
    if beta == 0.0:  # no distance term: the quadratic penalty alone gives η = 0
        return torch.zeros_like(a + G)
    eta = a / ((1.0 - beta) / (beta * n) + G)
    return torch.nan_to_num(eta, nan=0.0, posinf=eta_max, neginf=0.0).clamp(0.0, eta_max)


def sq_norm(state: Mapping[str, Tensor], names: list[str]) -> float:
    """``Σ_n ‖state[n]‖²`` in float64 over the named entries."""
    return float(sum(state[n].double().pow(2).sum() for n in names))


def sq_dist(a: Mapping[str, Tensor], b: Mapping[str, Tensor], names: list[str]) -> float:
    """``Σ_n ‖a[n] − b[n]‖²`` in float64 over the named entries."""
    return float(sum((a[n].double() - b[n].double()).pow(2).sum() for n in names))


def dot(a: Mapping | Sequence[Tensor], b: Mapping | Sequence[Tensor], keys: Iterable) -> float:
    """``Σ_k ⟨a[k], b[k]⟩`` in float64 over named (state dicts) or positional (parameter lists) tensors."""
    return float(sum((a[k].double() * b[k].double()).sum() for k in keys))
