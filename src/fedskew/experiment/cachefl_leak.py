"""What CacheFL's key gradient reveals (Eqs. 6–8), and a feature-inversion attack beside DLG (Fig. 6).

**The analytic leak.** Let f be a client's L2-normalised image feature, k_j the cache keys (the rows of
``keys`` = W1ᵀ), c(j) the class of key j (W2, Eq. 4), a_j = exp(−β(1 − f·k_j)) (Eq. 6),
z = s·f W_textᵀ + α·a W2ᵀ (Eq. 7) and g = ∂CE(z, y)/∂z = softmax(z) − e_y. Eq. 8's gradient is

    ∂ℒ/∂k_j = α g_{c(j)} ∂a_j/∂k_j = α β a_j g_{c(j)} · f,   i.e.   ∇_{W1ᵀ} ℒ = m fᵀ,  m_j = α β a_j g_{c(j)}.

For one sample it is **rank 1** and every row is a multiple of f: the top right-singular vector v1 is ±f.
α, β, a_j > 0, so sign(m_j) = sign(g_{c(j)}): negative on the keys of the true class (p_y − 1 < 0),
positive on all others (p_c > 0). With q = ∇ v1 (= ±m), the per-class sums h_c = Σ_{j∈c} q_j therefore
have exactly one class of one sign and the others of the other sign: if one class is negative and the
rest positive, f̂ = v1; if one is positive and the rest negative, f̂ = −v1; the lone class is the label.
That needs only W2 and decides whenever N ≥ 3 and at least two p_c, c ≠ y, are non-zero. Otherwise (N = 2,
or all other probabilities underflowed to 0) both orientations look alike; then the public keys and β
decide: for the right orientation ĝ_c = mean_{j∈c} m_j / (α β a_j(f̂)) is exactly p − e_y and sums to 0.

**A batch of B samples** (mean loss) gives Σ_b m_b f_bᵀ / B: rank ≤ B, and its row space is span{f_b}.
The rows of a class no sample has are positive combinations of the f_b; a class present in the batch
gets a negative coefficient on its samples' features. Projected on a direction u with f_b·u > 0 for
every b (any non-negative u when the features are non-negative, as after ReLU and pooling; by default
the mean public key), absent classes give positive class sums, never negative: :func:`label_set_by_sign`
returns the negative ones. It can miss a present class whose samples are confident (1 − p_y small) while
the batch's other samples give that class probability; it does not count repeats. :func:`match_batch`
recovers each feature and label for small B from the whole public model (the server knows W1, W2,
W_text, α, β, s): with f_b = V φ_b in the leaked span V, the gradient is Σ_b m_b φ_bᵀ Vᵀ / B, so each
m_b lies in its B-dim column space, and m(φ, y) is computable from (φ, y) alone. Scanning unit φ × the N
labels for m(φ, y) inside that column space is one (B−1)-dim search per sample, not a joint one; its
grid grows as 4^B, so B ≤ 4 here.

**Feature inversion** (:func:`invert_features`): from a leaked unit feature, optimise the pixels through
the frozen encoder to maximise cos(normalize(encoder(x)), f̂) − λ·TV(x) (projected Adam on [0, 1]).
:func:`retrieve` is the attacker's other option: the public image whose feature is nearest to f̂.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew import numerics
from fedskew.algorithms.cachefl import affinity, cache_gradient
from fedskew.errors import DataError


@dataclass(frozen=True)
class PublicModel:
    """What the server knows of a client's classifier (Eq. 7): W1ᵀ as sent, W2 as labels, W_text, α, β, s."""

    keys: Tensor  # [N·K, C]
    labels: Tensor  # [N·K] class of each key
    text: Tensor  # [N, C]
    alpha: float
    beta: float
    scale: float

    @property
    def num_classes(self) -> int:
        return int(self.text.shape[0])

    @property
    def values(self) -> Tensor:
        """W2ᵀ ``[N·K, N]`` (one-hot)."""
        return F.one_hot(self.labels.long(), self.num_classes).to(self.keys.dtype)


def key_gradients(model: PublicModel, f: Tensor, y: Tensor) -> Tensor:
    """Each sample's own gradient of the keys (Eq. 8, batch of one) ``[B, N·K, C]``: what a client with one
    image uploads (as −η times it after one SGD step). ``f`` unit features ``[B, C]``, ``y`` ``[B]``."""
    m = model

    def one(fb: Tensor, yb: Tensor) -> Tensor:
        return cache_gradient(fb[None], yb[None], m.text, m.keys, m.values, m.alpha, m.beta, m.scale)

    return torch.func.vmap(one)(f, y.long())


def class_sums(rows: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """``[..., N·K]`` per-key numbers summed per class of the keys -> ``[..., N]``."""
    return rows @ F.one_hot(labels.long(), num_classes).to(rows.dtype)


@dataclass(frozen=True)
class SingleLeak:
    """The feature and label recovered from one-sample key gradients (one row per observed gradient)."""

    feature: Tensor  # [S, C] unit f̂
    label: Tensor  # [S]
    ratio: Tensor  # [S] σ2/σ1: ~0 for a one-sample gradient
    by_signs: Tensor  # [S] bool: the orientation came from the signs alone (else from Σ ĝ = 0)


def _sum_rule_score(q: Tensor, v: Tensor, model: PublicModel) -> Tensor:
    """|Σ_c ĝ_c| / Σ_c |ĝ_c| for the orientation f̂ = v, m = q (0 for the true one; module doc)."""
    ghat = q / affinity(v, model.keys, model.beta)  # α β only scale ĝ
    counts = class_sums(torch.ones_like(ghat[:1]), model.labels, model.num_classes)
    per_class = class_sums(ghat, model.labels, model.num_classes) / counts
    return per_class.sum(-1).abs() / per_class.abs().sum(-1)


def leak_single(grads: Tensor, model: PublicModel) -> SingleLeak:
    """f̂ and y from one-sample key gradients ``[S, N·K, C]`` (or one ``[N·K, C]``): f̂ = ±v1, the sign and
    the label from the signs of the per-class multipliers, ties broken by Σ ĝ = 0 (module doc)."""
    g = grads[None] if grads.dim() == 2 else grads
    _, sv, vh = torch.linalg.svd(g, full_matrices=False)
    if bool((sv[:, 0] == 0).any()):
        raise DataError("leak_single: a zero key gradient (p_y = 1 in floating point): nothing to recover")
    v = vh[:, 0]
    q = (g @ v[..., None]).squeeze(-1)  # [S, N·K] = ±m
    h = class_sums(q, model.labels, model.num_classes)
    neg, pos = (h < 0).sum(-1), (h > 0).sum(-1)
    plus, minus = (neg == 1) & (pos != 1), (pos == 1) & (neg != 1)
    by_sum = _sum_rule_score(q, v, model) <= _sum_rule_score(-q, -v, model)
    orient = torch.where(plus | minus, plus, by_sum).to(g.dtype) * 2 - 1
    return SingleLeak(
        feature=orient[:, None] * v,
        label=(orient[:, None] * h).argmin(-1),
        ratio=sv[:, 1] / sv[:, 0],
        by_signs=plus | minus,
    )


def singular_ratios(grad: Tensor) -> Tensor:
    """σ_i / σ_1 of a key gradient ``[N·K, C]``: how many features it mixes (rank ≤ B)."""
    sv = torch.linalg.svdvals(grad)
    return sv / sv[0]


def leaked_span(grad: Tensor, rank: int) -> Tensor:
    """An orthonormal basis ``[C, rank]`` of the top-``rank`` row space: span{f_b} for a batch of ``rank``."""
    return torch.linalg.svd(grad, full_matrices=False)[2][:rank].T


def label_set_by_sign(grad: Tensor, model: PublicModel, direction: Tensor | None = None) -> Tensor:
    """Classes whose keys' gradient rows, projected on ``direction`` (default: the mean public key), sum
    negative ``[N]`` bool: never a class outside the batch when every f_b·u > 0 (module doc)."""
    u = F.normalize(model.keys.mean(0) if direction is None else direction, dim=0)
    return class_sums(grad @ u, model.labels, model.num_classes) < 0


@dataclass(frozen=True)
class BatchMatch:
    """Features and labels that reproduce an observed batch gradient (:func:`match_batch`)."""

    features: Tensor  # [B, C] unit
    labels: Tensor  # [B] (the order of the batch is not recoverable)
    residual: float  # ‖predicted − observed‖² / ‖observed‖² of the whole batch gradient


def _multipliers(phi: Tensor, coords: tuple[Tensor, Tensor], model: PublicModel) -> Tensor:
    """m(φ, y) / (α β) ``[P, N(y), N·K]`` for unit span coordinates φ ``[P, r]`` and every label y: a_j·g_c(j)
    with g = softmax(z) − e_y (Eqs. 6–8); ``coords`` are the keys and W_text in span coordinates."""
    keys, text = coords
    a = numerics.exp(-model.beta * (1.0 - phi @ keys.T))
    p = (model.scale * phi @ text.T + model.alpha * a @ model.values).softmax(-1)
    g = p[:, None, :] - torch.eye(model.num_classes, dtype=p.dtype)
    return (g @ model.values.T) * a[:, None, :]


def _misfit(phi: Tensor, left: Tensor, coords: tuple[Tensor, Tensor], model: PublicModel) -> Tensor:
    """1 − ‖Uᵀ m‖² / ‖m‖² ``[P, N]``: how far m(φ, y) lies from the gradient's column space U."""
    m = _multipliers(phi, coords, model)
    return 1.0 - (m @ left).pow(2).sum(-1) / m.pow(2).sum(-1)


def _distinct(phi: Tensor, order: Tensor, k: int, cos_max: float) -> list[int]:
    """The first ``k`` of ``order`` whose φ is not within ``cos_max`` of one already taken."""
    taken: list[int] = []
    for i in order.tolist():  # candidates, not samples
        if all(float(phi[i] @ phi[j]) < cos_max for j in taken):
            taken.append(i)
        if len(taken) == k:
            break
    return taken


def match_batch(
    grad: Tensor, model: PublicModel, batch: int, *, grid: int | None = None, seed: int = 0
) -> BatchMatch:
    """Each sample's multipliers m_b lie in the B-dim column space of the gradient (module doc): scan
    ``grid`` unit φ in the leaked span (default 2048·4^(B−2); evenly on the circle for B = 2, seeded random
    otherwise) × every label, refine the 2B best distinct φ of each label by L-BFGS, keep the ``batch``
    best-fitting distinct features (float64)."""
    grid = grid or 2048 * 4 ** max(batch - 2, 0)
    g = grad.double()
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    left, basis = u[:, :batch], vh[:batch].T
    m = replace(model, keys=model.keys.double(), text=model.text.double())
    coords = (m.keys @ basis, m.text @ basis)
    if batch == 2:
        t = torch.arange(grid, dtype=torch.float64) * (2 * torch.pi / grid)
        phi = torch.stack([numerics.cos(t), numerics.sin(t)], 1)
    else:
        gen = torch.Generator().manual_seed(int(seed))
        phi = F.normalize(torch.randn(grid, batch, generator=gen, dtype=torch.float64), dim=1)
    misfit = torch.cat([_misfit(part, left, coords, m) for part in phi.split(4096)])  # [grid, N]
    starts = [
        (i, c) for c in range(m.num_classes) for i in _distinct(phi, misfit[:, c].argsort(), 2 * batch, 0.99)
    ]
    index = torch.tensor(starts)
    theta, y = phi[index[:, 0]].clone().requires_grad_(), index[:, 1]
    opt = torch.optim.LBFGS([theta], max_iter=200, line_search_fn="strong_wolfe", tolerance_change=1e-15)

    def closure() -> Tensor:
        opt.zero_grad()
        out = _misfit(F.normalize(theta, dim=1), left, coords, m).gather(1, y[:, None]).sum()
        out.backward()
        return out

    opt.step(closure)
    with torch.no_grad():
        phi = F.normalize(theta, dim=1)
        fit = _misfit(phi, left, coords, m).gather(1, y[:, None]).squeeze(1)
        keep = torch.tensor(_distinct(phi, fit.argsort(), batch, 0.999))
        feats, ys = phi[keep] @ basis.T, y[keep]
        pred = key_gradients(m, feats, ys).mean(0)
        residual = float((pred - g).pow(2).sum() / g.pow(2).sum())
    return BatchMatch(feats.to(grad.dtype), ys, residual)


def total_variation(x: Tensor) -> Tensor:
    """Anisotropic TV per image ``[B]``: mean |horizontal| + mean |vertical| neighbour difference."""
    return (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1) + (
        x[..., 1:, :] - x[..., :-1, :]
    ).abs().flatten(1).mean(1)


@dataclass(frozen=True)
class Inversion:
    """Images (in [0, 1]) at ``steps[k]`` and their cos(normalize(encoder(x)), f̂) ``[S, B]``."""

    steps: list[int]
    snapshots: Tensor  # [S, B, C, H, W]
    cosine: Tensor  # [S, B]

    @property
    def images(self) -> Tensor:
        return self.snapshots[-1]


def invert_features(
    encode: Callable[[Tensor], Tensor],
    target: Tensor,
    start: Tensor,
    *,
    steps: int = 300,
    lr: float = 0.05,
    tv: float = 0.02,
    record_every: int = 50,
) -> Inversion:
    """Feature inversion: maximise cos(normalize(encode(x)), f̂) − ``tv``·TV(x) over the pixels x, from
    ``start`` ``[B, C, H, W]`` in [0, 1], with Adam (``lr``) projected back onto [0, 1] after every step.
    ``encode`` maps [0, 1] images to features (it applies the encoder's preprocessing itself); ``target``
    ``[B, D]`` is the leaked f̂ (normalised here). Snapshots at 0, every ``record_every`` and the end."""
    goal = F.normalize(target.detach().to(start.dtype), dim=-1)
    x = start.detach().clone().clamp(0, 1).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    shots, cos, taken = [], [], []
    for step in range(steps + 1):  # optimisation steps, not samples
        c = (F.normalize(encode(x), dim=-1) * goal).sum(-1)
        if step % record_every == 0 or step == steps:
            shots.append(x.detach().clone())
            cos.append(c.detach())
            taken.append(step)
        if step == steps:
            break
        opt.zero_grad()
        (1 - c + tv * total_variation(x)).sum().backward()
        opt.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    return Inversion(taken, torch.stack(shots), torch.stack(cos))


def retrieve(features: Tensor, pool: Tensor) -> Tensor:
    """Index ``[B]`` of the ``pool`` feature ``[P, D]`` most cosine-similar to each of ``features``
    ``[B, D]``: the attacker's nearest public image (its label, its pixels)."""
    return (F.normalize(features, dim=-1) @ F.normalize(pool, dim=-1).T).argmax(-1)
