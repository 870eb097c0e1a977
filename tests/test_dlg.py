"""Deep Leakage from Gradients: PSNR by hand, exact recovery through a linear model, the CacheFL W1 target."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.experiment.dlg import (
    GradientTarget,
    dlg_attack,
    dlg_lenet,
    module_target,
    psnr,
    save_dlg_grid,
    soft_cross_entropy,
    target_gradient,
)


def _image(seed: int = 0) -> Tensor:
    """A smooth 1x8x8 blob image in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    ax = torch.linspace(-1, 1, 8)
    cx, cy = (torch.rand(2, generator=g) - 0.5).tolist()
    return torch.exp(-((ax[None, :] - cx) ** 2 + (ax[:, None] - cy) ** 2) * 3)[None, None]


class TinyCache(nn.Module):
    """A CacheFL-shaped model for the attack: frozen random conv encoder, cache keys w1 (trainable), values
    w2 and text features as buffers; logits = 100·f Tᵀ + exp(−(1 − f w1)) w2 (Eqs. 5–7, α = β = 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        )
        self.encoder.requires_grad_(False)
        self.w1 = nn.Parameter(F.normalize(torch.randn(16, 30), dim=0))
        self.register_buffer("w2", F.one_hot(torch.arange(30) % 10, 10).float())
        self.register_buffer("text", F.normalize(torch.randn(10, 16), dim=1))

    def forward(self, x: Tensor) -> Tensor:
        f = F.normalize(self.encoder(x).flatten(1), dim=1)
        return 100 * f @ self.text.T + torch.exp(-(1 - f @ self.w1)) @ self.w2


def test_psnr_by_hand():
    ref = torch.full((2, 1, 4, 4), 0.1)
    x = torch.zeros(2, 1, 4, 4)
    x[1, :, :2] = 0.6  # image 1: half the pixels off by 0.5, half by 0.1 -> MSE (0.25 + 0.01) / 2
    got = psnr(x, ref)
    assert got[0].item() == pytest.approx(20.0)  # MSE 0.01 -> 10 log10(100)
    assert got[1].item() == pytest.approx(10 * math.log10(1 / 0.13))
    assert psnr(x * 255, ref * 255, data_range=255.0)[0].item() == pytest.approx(20.0)
    assert math.isinf(psnr(ref, ref)[0].item())


def test_soft_cross_entropy_is_cross_entropy_on_one_hot():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 3, 1, 1, 2])
    assert torch.allclose(soft_cross_entropy(logits, F.one_hot(y, 4).float()), F.cross_entropy(logits, y))


def test_dlg_recovers_the_image_through_a_linear_model():
    """A linear layer's gradient is (softmax − y) xᵀ: the image is in it, and DLG finds it and the label."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = _image(), torch.tensor([7])
    res = dlg_attack(module_target(model), x, y, 10, iterations=4, record_every=2)
    assert res.iterations == [0, 2, 4] and res.snapshots.shape == (3, 1, 1, 8, 8)
    assert res.psnr[0, 0] < 15 and res.psnr[-1, 0] > 40  # from noise to (numerically) the image
    assert res.labels.tolist() == [7]
    assert res.distance[-1] < 1e-8
    again = dlg_attack(module_target(model), x, y, 10, iterations=4, record_every=2)
    assert torch.equal(res.snapshots, again.snapshots)  # deterministic for a seed


def test_cachefl_target_observes_only_w1_and_leaks_far_less():
    """Only W1's gradient is observed (the encoder is frozen); inverting it through the encoder's global
    pooling gives a far worse reconstruction than the linear model's."""
    model = TinyCache()
    target = module_target(model, ["w1"])
    x, y = _image(), torch.tensor([3])
    (g,) = target_gradient(target, x, F.one_hot(y, 10).float())
    assert g.shape == (16, 30) and g.abs().sum() > 0
    before = [p.clone() for p in model.encoder.parameters()]
    cache = dlg_attack(target, x, y, 10, iterations=6, record_every=3)
    assert all(torch.equal(a, b) for a, b in zip(before, model.encoder.parameters(), strict=True))
    assert all(p.grad is None for p in model.encoder.parameters())
    torch.manual_seed(0)
    linear = dlg_attack(module_target(nn.Sequential(nn.Flatten(), nn.Linear(64, 10))), x, y, 10, iterations=6)
    assert cache.psnr[-1, 0] < 15 < linear.psnr[-1, 0]


def test_dlg_recovers_the_image_through_the_sigmoid_lenet():
    """DLG's own from-scratch network (the FedAvg target): the whole-network gradient leaks the image."""
    net = dlg_lenet((1, 12, 12), 10)
    assert net(torch.zeros(2, 1, 12, 12)).shape == (2, 10)
    x = F.interpolate(_image(2), size=(12, 12), mode="bilinear")
    res = dlg_attack(module_target(net), x, torch.tensor([4]), 10, iterations=4, record_every=2)
    assert res.psnr[-1, 0] > 30 and res.labels.tolist() == [4]


def test_functional_target_matches_the_module_target():
    """Cache state held as plain tensors: a closure over W1 gives the same observed gradient."""
    model = TinyCache()
    w1 = model.w1.detach().clone().requires_grad_()

    def logits(x: Tensor) -> Tensor:
        f = F.normalize(model.encoder(x).flatten(1), dim=1)
        return 100 * f @ model.text.T + torch.exp(-(1 - f @ w1)) @ model.w2

    x, soft = _image(), F.one_hot(torch.tensor([2]), 10).float()
    (a,) = target_gradient(GradientTarget(logits, (w1,)), x, soft)
    (b,) = target_gradient(module_target(model, ["w1"]), x, soft)
    assert torch.allclose(a, b)


def test_module_target_errors():
    with pytest.raises(ConfigError, match="no parameter 'W1'; valid: .*w1"):
        module_target(TinyCache(), ["W1"])
    with pytest.raises(ConfigError, match="none requires grad"):
        module_target(nn.Linear(2, 2).requires_grad_(False))


def test_grid_png(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = _image(), torch.tensor([1])
    res = dlg_attack(module_target(model), x, y, 10, iterations=2, record_every=1)
    out = save_dlg_grid(tmp_path / "sub" / "dlg.png", x, {"FedAvg": res, "CacheFL": res})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
