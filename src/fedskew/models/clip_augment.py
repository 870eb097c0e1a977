"""Tip-Adapter's augmented cache keys, on image tensors (no torchvision).

Tip-Adapter (Zhang et al. 2022, §3.1; its ``build_cache_model``), which CacheFL's cache follows, encodes the
few-shot images over 10 "augment epochs" of ``RandomResizedCrop(size, scale=(0.5, 1), BICUBIC)`` +
``RandomHorizontalFlip()``, averages the raw features over the epochs and L2-normalises the mean. CacheFL
(Yi et al. 2025, Eq. 3) states plain keys: the features of the generated images themselves, which stays the
default (``data.vision_language.augment_views: 0``).

:func:`augment_view` draws, per image, a crop box as torchvision's ``RandomResizedCrop.get_params`` does
(area share U(scale), log aspect ratio U(log 3/4, log 4/3), up to 10 tries, else the centre crop of the
clamped ratio) and a flip with probability 1/2, all from one seeded generator, vectorised over the batch;
:func:`resized_crops` resizes every box to ``size x size`` with PIL's bicubic filter (antialiased when a box
is shrunk; taps only inside the box, as a crop-then-resize), as per-sample separable weight matrices, and
rounds to ``uint8`` after each of the two passes, as PIL does (equal to PIL's output to within 1 grey level).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from fedskew import numerics
from fedskew.seeding import derive_seed

SCALE = (0.5, 1.0)  # Tip-Adapter's RandomResizedCrop scale
RATIO = (3.0 / 4.0, 4.0 / 3.0)  # torchvision's default aspect-ratio range
TRIES = 10  # torchvision's attempts before the centre-crop fallback
_VIEW_TAG = 0xA06  # seed key of the augmented views
_CHUNK = 256  # images resampled at once (bounds the float copy)


@dataclasses.dataclass(frozen=True)
class Augment:
    """``views`` augmented views per image, seeded by ``seed``, resampled to ``size`` (part of the feature
    cache key: other views, seed or size give other keys)."""

    views: int
    seed: int
    size: int
    recipe: str = "random_resized_crop(0.5-1,bicubic)+hflip"


def crop_boxes(n: int, height: int, width: int, gen: torch.Generator) -> Tensor:
    """``[n, 4]`` integer boxes ``(top, left, h, w)`` drawn as torchvision's ``RandomResizedCrop``."""
    area = height * width
    share = torch.empty(n, TRIES).uniform_(*SCALE, generator=gen)
    log_ratio = torch.empty(n, TRIES).uniform_(math.log(RATIO[0]), math.log(RATIO[1]), generator=gen)
    ratio = numerics.exp(log_ratio)
    w = torch.round(numerics.sqrt(area * share * ratio)).long()
    h = torch.round(numerics.sqrt(area * share / ratio)).long()
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = ok.int().argmax(1, keepdim=True)  # the first try that fits
    h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
    u = torch.rand(n, 2, generator=gen)
    top = (u[:, 0] * (height - h + 1)).floor().long().clamp(max=height - h)
    left = (u[:, 1] * (width - w + 1)).floor().long().clamp(max=width - w)
    fh, fw = _fallback(height, width)
    fallback = torch.tensor([(height - fh) // 2, (width - fw) // 2, fh, fw])
    boxes = torch.stack([top, left, h, w], 1)
    return torch.where(ok.any(1, keepdim=True), boxes, fallback)


def _fallback(height: int, width: int) -> tuple[int, int]:
    """torchvision's centre crop when no try fits: the whole image, its aspect ratio clamped to RATIO."""
    aspect = width / height
    if aspect < RATIO[0]:
        return round(width / RATIO[0]), width
    if aspect > RATIO[1]:
        return height, round(height * RATIO[1])
    return height, width


def _cubic(d: Tensor, a: float = -0.5) -> Tensor:
    """Keys' cubic convolution kernel with PIL's ``a = -0.5`` (PIL's and torch's antialiased bicubic)."""
    d = d.abs()
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = (((d - 5) * d + 8) * d - 4) * a
    return torch.where(d < 1, near, torch.where(d < 2, far, torch.zeros_like(d)))


def resample_weights(start: Tensor, length: Tensor, in_size: int, out_size: int) -> Tensor:
    """``[B, out_size, in_size]``: row ``o`` holds the weights of input pixels for output pixel ``o`` when the
    span ``[start, start + length)`` of each sample is resized to ``out_size``, as PIL's ``resize(BICUBIC)``
    of the cropped image: output centre ``start + (o + 0.5)·scale``, the kernel widened by ``max(scale, 1)``
    (antialiasing when shrinking), only pixels inside the span, weights normalised to sum 1."""
    scale = length / out_size
    widen = scale.clamp(min=1.0)[:, None, None]
    centre = start[:, None] + (torch.arange(out_size, dtype=scale.dtype) + 0.5) * scale[:, None]
    pixel = torch.arange(in_size, dtype=scale.dtype)
    w = _cubic((pixel + 0.5 - centre[..., None]) / widen)
    inside = (pixel >= start[:, None, None]) & (pixel < (start + length)[:, None, None])
    w = w * inside
    return w / w.sum(-1, keepdim=True)


def resized_crops(images: Tensor, boxes: Tensor, flips: Tensor, size: int) -> Tensor:
    """uint8 ``[B, C, size, size]``: box ``(top, left, h, w)`` of each image resized bicubically to
    ``size x size`` (:func:`resample_weights`; PIL's two passes: columns, rounded to uint8, then rows),
    mirrored where ``flips`` (torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` on PIL images,
    to within 1 grey level)."""
    _, _, height, width = images.shape
    top, left, h, w = boxes.double().unbind(1)
    rows = resample_weights(top, h, height, size).float()  # [B, size, H]
    cols = resample_weights(left, w, width, size).float()  # [B, size, W]
    wide = (images.float() @ cols.transpose(1, 2)[:, None]).round().clamp(0, 255)  # PIL: uint8 in between
    out = rows[:, None] @ wide
    out = torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)
    return out.round().clamp(0, 255).to(torch.uint8)


def augment_view(images: Tensor, size: int, seed: int, view: int) -> Tensor:
    """View ``view`` of uint8 ``images [B, C, H, W]``: a random resized crop to ``size`` and a random
    horizontal flip per image, from a generator seeded by ``(seed, view)`` (the same call, the same view)."""
    gen = torch.Generator().manual_seed(derive_seed(seed, _VIEW_TAG, view))
    n, _, height, width = images.shape
    boxes = crop_boxes(n, height, width, gen)
    flips = torch.rand(n, generator=gen) < 0.5
    chunks = [
        resized_crops(images[i : i + _CHUNK], boxes[i : i + _CHUNK], flips[i : i + _CHUNK], size)
        for i in range(0, n, _CHUNK)
    ]
    return torch.cat(chunks) if chunks else torch.zeros(0, images.shape[1], size, size, dtype=torch.uint8)
