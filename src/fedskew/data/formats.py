"""Parsers for the standard distribution formats: IDX (gzipped), CIFAR pickles, SVHN ``.mat``, LEAF json and
image folders. Each returns numpy arrays and raises ``DataError`` naming the file when it is unreadable.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fedskew.errors import DataError

# IDX type byte -> numpy dtype (big-endian), http://yann.lecun.com/exdb/mnist/ "THE IDX FILE FORMAT"
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_PICKLE_ERRORS = (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError, AttributeError)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"})


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (gzipped when the name ends in ``.gz``) as a numpy array of its declared shape.

    One ``gzip.decompress`` plus ``np.frombuffer``: no per-item parsing (MNIST's 47 MB in ~0.2 s).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"cannot read {path}: {err}; the file is truncated or corrupted") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number {data[:4].hex()})")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path} is truncated: header needs {header} bytes, file has {len(data)}")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_TYPES[data[2]])
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) != header + count * dtype.itemsize:
        raise DataError(
            f"{path} is truncated or corrupted: header declares shape {shape} "
            f"({header + count * dtype.itemsize} bytes), file holds {len(data)} bytes"
        )
    return np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(shape)


def read_cifar_batch(path: str | os.PathLike, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """A CIFAR python pickle batch: images ``uint8 [N, 3, 32, 32]`` and labels ``int64 [N]``.

    ``label_key`` is ``labels`` (CIFAR-10) or ``fine_labels`` (CIFAR-100). Pickles can execute code: only
    load files whose checksum was verified or that you made yourself.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        x = np.asarray(batch[b"data"], dtype=np.uint8)
        y = np.asarray(batch[label_key.encode()], dtype=np.int64)
    except _PICKLE_ERRORS as err:
        raise DataError(f"cannot read CIFAR batch {path}: {type(err).__name__}: {err}") from None
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: expected data [N, 3072] and N labels, got {x.shape} and {y.shape}")
    return x.reshape(-1, 3, 32, 32), y


def read_pickle_names(path: str | os.PathLike, key: str) -> list[str] | None:
    """Class names from a CIFAR ``meta`` / ``batches.meta`` pickle, or ``None`` when absent or unreadable."""
    try:
        with open(path, "rb") as f:
            meta = pickle.load(f, encoding="bytes")
        return [n.decode() if isinstance(n, bytes) else str(n) for n in meta[key.encode()]]
    except _PICKLE_ERRORS:
        return None


def read_svhn_mat(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """An SVHN ``*_32x32.mat``: ``X`` ``[H, W, C, N]`` -> ``uint8 [N, C, H, W]``; label 10 means digit 0."""
    from scipy.io import loadmat

    path = Path(path)
    try:
        mat = loadmat(path, variable_names=["X", "y"])
        x, y = mat["X"], mat["y"]
    except (OSError, ValueError, TypeError, KeyError, NotImplementedError) as err:
        raise DataError(f"cannot read SVHN file {path}: {type(err).__name__}: {err}") from None
    if x.ndim != 4 or x.shape[3] != y.size:
        raise DataError(f"{path}: expected X [H, W, C, N] and N labels, got {x.shape} and {y.shape}")
    y = y.reshape(-1).astype(np.int64)
    y[y == 10] = 0
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1), dtype=np.uint8), y


def read_leaf(folder: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:
    """All LEAF json files in ``folder`` (``users``, ``num_samples``, ``user_data{user: {x, y}}``).

    Returns ``x`` as stored (``float32 [N, D]``), ``y`` ``int64 [N]``, the writer names in file order,
    and the per-sample index into those names. Loops run per writer, never per sample.
    """
    folder = Path(folder)
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    writers: list[str] = []
    counts: list[int] = []
    for path in sorted(folder.glob("*.json")):
        try:
            with open(path) as f:
                blob = json.load(f)
            users, data = blob["users"], blob["user_data"]
            for u in users:
                x = np.asarray(data[u]["x"], dtype=np.float32)
                y = np.asarray(data[u]["y"], dtype=np.int64)
                if x.ndim != 2 or x.shape[0] != y.shape[0]:
                    raise ValueError(f"user {u}: x {x.shape} does not match y {y.shape}")
                xs.append(x)
                ys.append(y)
                writers.append(str(u))
                counts.append(len(y))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"cannot read LEAF file {path}: {type(err).__name__}: {err}") from None
    if not xs:
        raise DataError(f"no LEAF .json files in {folder}")
    writer_idx = np.repeat(np.arange(len(writers), dtype=np.int64), counts)
    return np.concatenate(xs), np.concatenate(ys), writers, writer_idx


def list_images(folder: Path) -> list[Path]:
    """Image files directly in ``folder`` (sorted, so every load sees the same order)."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _decode(path: Path, size: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.draft("RGB", (size, size))  # JPEG: decode at a power-of-2 reduced scale first (much faster)
            return np.asarray(im.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise DataError(f"cannot decode image {path}: {err}") from None


def read_images(paths: Sequence[Path], size: int, workers: int | None = None) -> np.ndarray:
    """Decode and resize image files into ``uint8 [N, 3, size, size]`` (RGB).

    One decode per file is unavoidable; Pillow releases the GIL while decoding, so a thread pool
    overlaps them. Results land in one preallocated array.
    """
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    workers = workers or min(8, os.cpu_count() or 1)

    def work(i: int) -> None:
        out[i] = _decode(paths[i], size)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(work, range(len(paths))))
    return out.transpose(0, 3, 1, 2).copy()
