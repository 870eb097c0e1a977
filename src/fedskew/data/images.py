"""Image files -> ``uint8 [N, C, H, W]`` tensors: listing, Pillow decoding, grey/RGB choice, a decode cache.

Pillow (https://python-pillow.org) is the decoder. Decoded sets are cached as one tensor file keyed by a
hash of the listing (path, size, mtime of every file) and the decode options, so a folder of JPEGs is
decoded once; a changed file changes the key, and an unreadable cache file is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedskew.data.cache import load_saved, save_atomic
from fedskew.errors import ConfigError, DataError

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
#: decoded channel count per supported mode
CHANNELS = {"L": 1, "RGB": 3}
#: Pillow modes that hold no colour: a set made only of these decodes as one grey channel
_GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})
_CACHE_VERSION = b"fedskew-images-1"


def list_images(folder: Path) -> list[Path]:
    """Image files directly in ``folder`` (sorted, so every load sees the same order)."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def check_mode(mode: str | None, dataset: str) -> None:
    """``ConfigError`` unless ``mode`` is ``None`` (decide from the images) or a supported mode."""
    if mode is not None and mode not in CHANNELS:
        raise ConfigError(f"dataset '{dataset}': mode must be one of {', '.join(CHANNELS)}, got {mode!r}")


def check_size(size: int | None, dataset: str) -> None:
    """``ConfigError`` unless ``size`` is ``None`` (keep the images' size) or a positive side length."""
    if size is not None and (not isinstance(size, int) or size < 1):
        raise ConfigError(
            f"dataset '{dataset}': size must be a positive pixel count (square side), got {size}"
        )


def choose_mode(modes: Sequence[str]) -> str:
    """``L`` when every image is grey (any grey Pillow mode), else ``RGB``."""
    return "L" if modes and all(m in _GREY_MODES for m in modes) else "RGB"


def common_shape(shapes: Sequence[tuple[int, int]], size: int | None, dataset: str) -> tuple[int, int]:
    """The output ``(H, W)``: ``size x size`` when resizing, else the one size every image shares."""
    if size is not None:
        return size, size
    distinct = sorted(set(shapes))
    if len(distinct) > 1:
        (h1, w1), (h2, w2) = distinct[0], distinct[-1]
        raise ConfigError(
            f"dataset '{dataset}': images have different sizes (e.g. {w1}x{h1} and {w2}x{h2}); "
            "set data.options.size to resize them to a square side"
        )
    return distinct[0] if distinct else (1, 1)


def _squash(im: Any, mode: str, size: int) -> Any:
    """Both sides to ``size``, bilinear (the aspect ratio is lost)."""
    from PIL import Image

    im.draft(mode, (size, size))  # JPEG: decode at a power-of-2 reduced scale first (much faster)
    return im.convert(mode).resize((size, size), Image.Resampling.BILINEAR)


def _shortest(im: Any, mode: str, size: int) -> Any:
    """CLIP's preprocessing in CLIP's order: bicubic resize of the shortest side to ``size`` (the long side
    to ``int(size * long / short)``), the centred ``size x size`` crop, then the mode conversion."""
    from PIL import Image

    w, h = im.size
    new = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    im = im.resize(new, Image.Resampling.BICUBIC) if new != (w, h) else im
    left, top = round((new[0] - size) / 2.0), round((new[1] - size) / 2.0)
    return im.crop((left, top, left + size, top + size)).convert(mode)


#: ``resize`` decode options: ``squash`` (default) or ``shortest`` (CLIP: shortest side + centre crop)
RESIZES: dict[str, Callable[[Any, str, int], Any]] = {"squash": _squash, "shortest": _shortest}


def check_resize(resize: str, size: int | None, dataset: str) -> None:
    """``ConfigError`` unless ``resize`` names a :data:`RESIZES` entry (``shortest`` needs ``size``)."""
    if resize not in RESIZES:
        raise ConfigError(f"dataset '{dataset}': resize must be one of {', '.join(RESIZES)}, got {resize!r}")
    if resize != "squash" and size is None:
        raise ConfigError(f"dataset '{dataset}': resize {resize!r} needs size (the side of the square crop)")


def to_array(im: Any, mode: str, size: int | None, resize: str = "squash") -> np.ndarray:
    """One Pillow image -> ``uint8 [H, W, C]`` in ``mode``, resized to ``size x size`` by
    ``RESIZES[resize]`` when ``size`` is given."""
    im = im.convert(mode) if size is None else RESIZES[resize](im, mode, size)
    return np.asarray(im).reshape(im.size[1], im.size[0], CHANNELS[mode])


def decode(path: Path, mode: str, size: int | None, resize: str = "squash") -> np.ndarray:
    """Decode one image file with Pillow (``DataError`` naming the file when it is not an image)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return to_array(im, mode, size, resize)
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise DataError(f"cannot decode image {path}: {err}") from None


def probe(paths: Sequence[Path]) -> tuple[list[str], list[tuple[int, int]]]:
    """Pillow modes and ``(H, W)`` sizes from the file headers (no pixel data is decoded)."""
    from PIL import Image, UnidentifiedImageError

    modes, shapes = [], []
    for p in paths:  # header reads only: I/O, not a loop over pixels
        try:
            with Image.open(p) as im:
                modes.append(im.mode)
                shapes.append((im.size[1], im.size[0]))
        except (OSError, UnidentifiedImageError, ValueError) as err:
            raise DataError(f"cannot decode image {p}: {err}") from None
    return modes, shapes


def stack(n: int, shape: tuple[int, int], mode: str, item: Callable[[int], np.ndarray]) -> np.ndarray:
    """``uint8 [n, C, H, W]`` from ``item(i) -> [H, W, C]``, decoded in a thread pool.

    Pillow releases the GIL while decoding, so threads overlap the decodes; results land in one array.
    """
    out = np.empty((n, *shape, CHANNELS[mode]), dtype=np.uint8)

    def work(i: int) -> None:
        out[i] = item(i)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(work, range(n)))
    return out.transpose(0, 3, 1, 2).copy()


def listing_key(paths: Sequence[Path], *options: object) -> str:
    """Hash of the listing (path, byte size, mtime of every file, in order) and the decode options."""
    h = hashlib.sha256(_CACHE_VERSION)
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(repr(options).encode())
    return h.hexdigest()[:24]


def _load_cache(path: Path, n: int, mode: str) -> Tensor | None:
    x = load_saved(path)
    if not (isinstance(x, Tensor) and x.dtype == torch.uint8 and x.dim() == 4):
        return None
    return x if x.shape[0] == n and x.shape[1] == CHANNELS[mode] else None


def cached_images(
    paths: Sequence[Path],
    size: int | None,
    mode: str | None,
    cache_dir: Path | None,
    dataset: str,
    resize: str = "squash",
) -> tuple[Tensor, str]:
    """Decode ``paths`` once into ``uint8 [N, C, H, W]`` (``mode`` ``None``: decided from the images;
    ``resize``: how images reach ``size x size``, :data:`RESIZES`).

    With ``cache_dir`` the tensor is stored as ``<cache_dir>/<dataset>-<listing key>.pt`` and read back on
    the next call; a read-only cache folder only disables the cache. Returns the images and the mode used.
    """
    check_resize(resize, size, dataset)
    modes, shapes = probe(paths) if mode is None or size is None else ([], [])
    mode = mode or choose_mode(modes)
    shape = common_shape(shapes, size, dataset)
    options = (size, mode) if resize == "squash" else (size, mode, resize)  # squash: the keys of before
    cache = None if cache_dir is None else cache_dir / f"{dataset}-{listing_key(paths, *options)}.pt"
    if cache is not None and (hit := _load_cache(cache, len(paths), mode)) is not None:
        return hit, mode
    x = torch.from_numpy(stack(len(paths), shape, mode, lambda i: decode(paths[i], mode, size, resize)))
    if cache is not None:
        save_atomic(cache, x)
    return x, mode
