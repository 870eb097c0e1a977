"""Frozen backbones for vision-language methods: images (and class prompts) -> embeddings.

A backbone is registered in :data:`BACKBONES` as ``factory(root, **options) -> Backbone`` (``root``: the
data root, against which relative weight paths resolve). It is frozen: nothing of it is trained or
communicated, so its features are computed once per dataset (CacheFL §3, Algorithm 1 lines 11–12 encode
the same images every epoch; with no augmentation that is the same function each time).

Images arrive as the datasets' ``uint8 [B, C, H, W]``; :func:`to_backbone_input` turns them into the
backbone's float input (grey -> RGB, resize, per-channel mean/std).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.errors import ConfigError
from fedskew.registry import Registry

#: name -> ``factory(root: Path, **options) -> Backbone``
BACKBONES: Registry[Callable[..., Backbone]] = Registry("backbone")


def squash(x: Tensor, size: int) -> Tensor:
    """``[B, C, H, W]`` in [0, 1] -> ``[B, C, size, size]``: bicubic resize of both sides with antialiasing
    (the aspect ratio is not kept), clamped to [0, 1]."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    return F.interpolate(x, size=(size, size), mode="bicubic", antialias=True, align_corners=False).clamp(
        0, 1
    )


def shortest_side(x: Tensor, size: int) -> Tensor:
    """CLIP's preprocessing (Radford et al. 2021; Tip-Adapter's ``Resize(size, BICUBIC)`` +
    ``CenterCrop(size)``): bicubic resize (antialiased) of the shortest side to ``size``, the long side to
    ``int(size * long / short)``, then the centred ``size x size`` crop (offsets ``round((side - size) / 2)``,
    as torchvision's). A square image is resized as by :func:`squash`."""
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if h == w:
        return squash(x, size)
    short, long = min(h, w), max(h, w)
    new = (size, int(size * long / short)) if h < w else (int(size * long / short), size)
    if new != (h, w):
        x = F.interpolate(x, size=new, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = round((new[0] - size) / 2.0), round((new[1] - size) / 2.0)
    return x[..., top : top + size, left : left + size]


#: ``resize`` option of the backbones -> how images reach the input size
RESIZES: dict[str, Callable[[Tensor, int], Tensor]] = {"squash": squash, "shortest": shortest_side}


def check_resize(resize: str, backbone: str) -> str:
    """``resize`` when it names a :data:`RESIZES` entry, else a one-line ``ConfigError``."""
    if resize not in RESIZES:
        raise ConfigError(f"backbone '{backbone}': resize {resize!r}; allowed: {', '.join(RESIZES)}")
    return resize


def to_backbone_input(
    images: Tensor, size: int, mean: Sequence[float], std: Sequence[float], resize: str = "squash"
) -> Tensor:
    """uint8 (or [0, 1] float) ``[B, C, H, W]`` -> float32 ``[B, 3, size, size]``: grey images repeated to
    three channels, resized by ``RESIZES[resize]`` (default ``squash``: both sides, bicubic with
    antialiasing; ``shortest``: CLIP's shortest-side resize + centre crop), then ``(x - mean) / std``."""
    x = images.float().div(255.0) if images.dtype == torch.uint8 else images.float()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = RESIZES[resize](x, size)
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m) / s


class Backbone:
    """A frozen encoder. ``encode_images`` maps images to ``[B, embed_dim]`` float32 (not normalised: the
    vision-language pipeline L2-normalises); ``encode_texts`` maps prompts to ``[N, embed_dim]``, or is
    ``None`` for an image-only backbone (then a generated-prototype text head stands in).

    ``split`` and ``rows`` say which images are encoded (``"train"`` rows of the training set, ``"test"``,
    ``"synthetic"``, ``"prototypes"``): image encoders ignore them, :mod:`precomputed features
    <fedskew.models.backbones.features>` look the rows up in a file. ``fingerprint()`` identifies the
    backbone for the on-disk feature cache (``None``: never cache).
    """

    embed_dim: int
    image_size: int
    encode_texts: Callable[[Sequence[str]], Tensor] | None = None

    def encode_images(self, images: Tensor, split: str, rows: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any] | None:
        return None


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Identity of a weights file for cache keys: path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}


def resolve_path(root: Path, path: str | Path) -> Path:
    """``path`` as given when absolute, else under the data root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(root) / p


def _register_builtins() -> None:
    from fedskew.models.backbones import efficientnet_lite, features, open_clip_backbone, random_cnn  # noqa: F401


_register_builtins()
