"""Attacks of malicious clients (simulation only), as pure functions.

Data poisoning (the malicious client trains on altered batches; its upload is what honest training on those
batches gives):

* :func:`flip_labels`: label flipping, y → C − 1 − y (Fang et al., USENIX Security 2020, §5; Tolpegin et al.
  2020);
* :func:`stamp_trigger` / :func:`poison_batch`: a pixel-pattern backdoor (Gu et al. 2017, BadNets; the
  federated setting of Bagdasaryan et al., AISTATS 2020): a square of the batch's largest value in the
  bottom-right corner of a share of each batch, relabelled to the target class.

Model poisoning (the malicious client replaces its update Δ = w_k − w by another; on flattened updates):

* :func:`sign_flip`: −s·Δ (the sign-flipping attack of Damaskinos et al. 2018 / Karimireddy et al. 2021);
* :func:`gaussian_update`: an update drawn from N(0, σ² I) (Blanchard et al. 2017 §5, "Gaussian");
* :func:`scale_update`: s·Δ, model replacement with boost γ = s (Bagdasaryan et al. 2020, Eq. 3);
* :func:`alie`: "A Little Is Enough" (Baruch et al., NeurIPS 2019, Alg. 1): every malicious client sends
  μ − z·σ, with μ, σ the coordinate-wise mean and std of the malicious clients' own honest updates of the
  round and z_max = Φ⁻¹((n − s) / n), s = ⌊n/2 + 1⌋ − f. The paper perturbs gradients by +zσ; on model
  updates Δ = −η·g that is −zσ.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
from torch import Tensor


def flip_labels(y: Tensor, num_classes: int, malicious: Tensor) -> Tensor:
    """``C − 1 − y`` where ``malicious`` (a 0-d or broadcastable 0/1 tensor) is set, else ``y``."""
    return torch.where(malicious > 0, num_classes - 1 - y, y)


def stamp_trigger(x: Tensor, size: int) -> Tensor:
    """``x`` with the bottom-right ``size × size`` square of every channel set to the batch's largest value
    (image batches ``[B, C, H, W]`` or ``[B, H, W]``); for flat inputs ``[B, D]`` the last ``size²``
    features. The batch's largest value is the brightest pixel after normalisation, whatever it is."""
    value = x.amax()
    if x.dim() >= 3:
        mask = torch.zeros(x.shape[-2:], dtype=torch.bool, device=x.device)
        mask[-size:, -size:] = True
    else:
        mask = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
        mask[-size * size :] = True
    return torch.where(mask, value, x)


def poison_batch(
    x: Tensor, y: Tensor, malicious: Tensor, target: int, size: int, share: float
) -> tuple[Tensor, Tensor]:
    """The backdoored batch of a malicious client: its first ``⌈share · B⌉`` samples stamped and relabelled
    ``target`` (batches are shuffled each epoch, so which samples is random); others unchanged."""
    b = y.shape[0]
    poisoned = (torch.arange(b, device=y.device) < math.ceil(share * b)) & (malicious > 0)
    view = poisoned.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(view, stamp_trigger(x, size), x), torch.where(poisoned, torch.full_like(y, target), y)


def sign_flip(delta: Tensor, scale: float) -> Tensor:
    return -scale * delta


def scale_update(delta: Tensor, scale: float) -> Tensor:
    return scale * delta


def gaussian_update(delta: Tensor, sigma: float, generator: torch.Generator) -> Tensor:
    noise = torch.randn(delta.shape, generator=generator, dtype=delta.dtype)
    return sigma * noise.to(delta.device)


def alie_z(n: int, f: int) -> float:
    """Baruch et al. 2019, Alg. 1: s = ⌊n/2 + 1⌋ − f, z_max = Φ⁻¹((n − s) / n) (0 when no positive value)."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    return NormalDist().inv_cdf(p) if 0 < p < 1 else 0.0


def alie(honest: Tensor, z: float) -> Tensor:
    """The one update every malicious client sends: μ − z·σ over ``honest`` ([f, d], their own updates);
    σ is the population std (one malicious client: σ = 0)."""
    mu = honest.mean(0)
    sigma = honest.std(0, unbiased=False) if honest.shape[0] > 1 else torch.zeros_like(mu)
    return mu - z * sigma
