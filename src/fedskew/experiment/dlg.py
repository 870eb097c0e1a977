"""Gradient inversion: Deep Leakage from Gradients (DLG; Zhu, Liu & Han, NeurIPS 2019), CacheFL's Fig. 6.

An honest-but-curious server sees a client's gradient of the training loss w.r.t. some parameters,
computed on one private image and label. DLG (Zhu et al., Algorithm 1) draws a dummy image ``x'`` and a
dummy label ``y'`` and minimises the squared distance between the gradient they produce and the observed
one with L-BFGS:

    min_{x', y'} Σ_W ‖∂ℓ(F(x'), softmax(y'))/∂W − ∇W‖²,    ℓ = soft-label cross-entropy.

CacheFL (§4.2, Fig. 6) runs it against FedAvg (the gradient of every weight of a network trained from
scratch on pixels) and against CacheFL (the gradient of the cache keys W1 only, Eq. 8, behind a frozen
image encoder the attacker must invert too), 100 iterations, recording the reconstruction every 20.

A target is any function ``images -> logits`` plus the tensors whose gradient the attacker observes
(:class:`GradientTarget`; :func:`module_target` picks named parameters of a module, e.g. only the cache
keys of a CacheFL model with its frozen backbone; for state held as plain tensors, build
``GradientTarget(lambda x: logits(encoder(x), w1), (w1,))`` with ``w1.requires_grad_()``). Images are in
pixel space, float in [0, 1]; the
target's function applies any normalisation itself, so PSNR is measured on the [0, 1] scale.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew import numerics
from fedskew.errors import ConfigError


@dataclass(frozen=True)
class GradientTarget:
    """What the attacker observes: the gradient of the soft-label CE of ``logits(images)`` wrt ``params``."""

    logits: Callable[[Tensor], Tensor]
    params: tuple[Tensor, ...]


def module_target(module: nn.Module, names: Sequence[str] | None = None) -> GradientTarget:
    """``module``'s forward as the target, observing its parameters ``names`` (all trainable ones if None).

    For FedAvg pass the from-scratch network and no names; for CacheFL pass the model (frozen encoder +
    cache) and the name of the cache-key parameter W1: the gradient still flows through the frozen encoder
    to the dummy image, so the attack inverts both.
    """
    named = dict(module.named_parameters())
    if names is None:
        params = tuple(p for p in named.values() if p.requires_grad)
    else:
        unknown = [n for n in names if n not in named]
        if unknown:
            raise ConfigError(f"DLG target: no parameter {unknown[0]!r}; valid: {', '.join(named)}")
        params = tuple(named[n] for n in names)
    if not params:
        raise ConfigError("DLG target: no parameter to observe (none requires grad)")
    return GradientTarget(module, params)


def dlg_lenet(in_shape: tuple[int, int, int], num_classes: int, seed: int = 0) -> nn.Module:
    """The network Zhu et al. attack (DLG §4.1): three 5x5 convs of 12 channels (strides 2, 2, 1, padding 2)
    with sigmoid activations and a linear classifier; weights and biases uniform in [-0.5, 0.5] from ``seed``.

    Smooth activations keep the gradient an invertible function of the image, so this is the from-scratch
    network on which DLG recovers the image; ReLU / max-pool networks such as ``lenet5`` resist it far more.
    """
    c, h, w = in_shape
    convs = [nn.Conv2d(c, 12, 5, padding=2, stride=2), nn.Conv2d(12, 12, 5, padding=2, stride=2)]
    convs.append(nn.Conv2d(12, 12, 5, padding=2, stride=1))
    side = (((h + 1) // 2 + 1) // 2, ((w + 1) // 2 + 1) // 2)
    layers: list[nn.Module] = [m for conv in convs for m in (conv, nn.Sigmoid())]
    net = nn.Sequential(*layers, nn.Flatten(), nn.Linear(12 * side[0] * side[1], num_classes))
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return net


def soft_cross_entropy(logits: Tensor, soft_labels: Tensor) -> Tensor:
    """Batch mean of ``−Σ_c y_c log softmax(logits)_c`` (``F.cross_entropy`` for one-hot ``y``)."""
    return -(soft_labels * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def target_gradient(
    target: GradientTarget, images: Tensor, soft_labels: Tensor, create_graph: bool = False
) -> tuple[Tensor, ...]:
    """The gradient of the soft-label CE on ``images`` w.r.t. the observed parameters."""
    loss = soft_cross_entropy(target.logits(images), soft_labels)
    return torch.autograd.grad(loss, target.params, create_graph=create_graph)


def psnr(x: Tensor, reference: Tensor, data_range: float = 1.0) -> Tensor:
    """Per-image PSNR in dB, ``10 log10(range² / MSE)`` over all pixels of each image (inf when equal)."""
    mse = (x.float() - reference.float()).pow(2).flatten(1).mean(1)
    return 10 * numerics.log10(data_range**2 / mse)


@dataclass
class DLGResult:
    """Reconstructions (clamped to [0, 1]) at ``iterations[k]``, their PSNR, the final recovered labels."""

    iterations: list[int]
    snapshots: Tensor  # [S, B, C, H, W]
    psnr: Tensor  # [S, B] dB
    labels: Tensor  # [B] argmax of the final dummy label
    distance: list[float]  # gradient distance at the end of each iteration

    @property
    def reconstruction(self) -> Tensor:
        return self.snapshots[-1]


def dlg_attack(
    target: GradientTarget,
    images: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    iterations: int = 100,
    record_every: int = 20,
    lr: float = 1.0,
    max_iter: int = 20,
    line_search: str | None = "strong_wolfe",
    seed: int = 0,
) -> DLGResult:
    """DLG against ``target`` on the private ``images`` ([B, C, H, W] in [0, 1]) and integer ``labels``.

    ``iterations`` L-BFGS steps (each up to ``max_iter`` inner iterations, torch's default, as in the DLG
    code); the dummy image starts uniform in [0, 1] and the dummy label logits standard normal, both from
    ``seed``. Snapshots at iteration 0 and every ``record_every`` (and the last).
    """
    if iterations < 1 or record_every < 1:
        raise ConfigError(f"DLG: iterations and record_every must be >= 1, got {iterations}, {record_every}")
    observed = tuple(
        g.detach() for g in target_gradient(target, images, F.one_hot(labels, num_classes).float())
    )
    g = torch.Generator().manual_seed(int(seed))
    dummy = torch.rand(images.shape, generator=g).requires_grad_(True)
    dummy_label = torch.randn(images.shape[0], num_classes, generator=g).requires_grad_(True)
    opt = torch.optim.LBFGS([dummy, dummy_label], lr=lr, max_iter=max_iter, line_search_fn=line_search)

    last = [math.inf]  # the gradient distance of the latest evaluation

    def closure() -> Tensor:
        opt.zero_grad()
        grads = target_gradient(target, dummy, dummy_label.softmax(-1), create_graph=True)
        dist = cast(Tensor, sum(((a - b) ** 2).sum() for a, b in zip(grads, observed, strict=True)))
        dist.backward()
        last[0] = float(dist.detach())
        return dist

    def snap() -> Tensor:
        return dummy.detach().clamp(0, 1).clone()

    shots, steps, distance = [snap()], [0], []
    for it in range(1, iterations + 1):  # L-BFGS steps, not samples
        opt.step(closure)
        dist = last[0]
        distance.append(dist)
        if it % record_every == 0 or it == iterations or not math.isfinite(dist):
            shots.append(snap())
            steps.append(it)
        if not math.isfinite(dist):  # diverged: keep what was recorded
            break
    snaps = torch.stack(shots)
    quality = torch.stack([psnr(s, images) for s in snaps])
    return DLGResult(steps, snaps, quality, dummy_label.detach().argmax(-1), distance)


def save_image_grid(path: str | os.PathLike, rows: Sequence[Sequence[tuple[Tensor, str]]]) -> Path:
    """A PNG grid of ``[C, H, W]`` images in [0, 1] (grey when C = 1), one figure row per ``rows`` entry,
    each image with its title. Returns the written path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = max(len(r) for r in rows)
    fig = Figure(figsize=(1.3 * cols, 1.5 * len(rows)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), cols, squeeze=False)
    for row, cells in zip(axes, rows, strict=True):
        for ax, (x, title) in zip(row, cells, strict=False):
            pic = x.detach().float().clamp(0, 1).permute(1, 2, 0).squeeze(-1).numpy()
            ax.imshow(pic, cmap="gray" if pic.ndim == 2 else None, vmin=0, vmax=1)
            ax.set_title(title, fontsize=7)
        for ax in row:
            ax.axis("off")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def save_dlg_grid(
    path: str | os.PathLike, originals: Tensor, results: Mapping[str, DLGResult], *, image: int = 0
) -> Path:
    """A PNG grid: one row per attack (``results`` key), columns = the original and each snapshot of image
    ``image`` of the batch, titled with the iteration and its PSNR. Returns the written path."""
    rows = [
        [(originals[image], f"{name}\noriginal")]
        + [
            (snap[image], f"it {it}\n{float(q[image]):.1f} dB")
            for it, snap, q in zip(res.iterations, res.snapshots, res.psnr, strict=False)
        ]
        for name, res in results.items()
    ]
    return save_image_grid(path, rows)
