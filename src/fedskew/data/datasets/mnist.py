"""MNIST-like IDX datasets: ``mnist`` and ``fashion_mnist`` (and the IDX reader EMNIST shares).

- MNIST (LeCun, Bottou, Bengio & Haffner 1998), http://yann.lecun.com/exdb/mnist/; licence CC BY-SA 3.0.
- Fashion-MNIST (Xiao, Rasul & Vollgraf 2017), https://github.com/zalandoresearch/fashion-mnist; MIT licence.

Files: the four gzipped IDX files of each under ``<root>/mnist`` and ``<root>/fashion-mnist``, checked
against the official MD5s (or the MD5 of their decompressed payload, for re-compressed mirror copies).
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedskew.data import files
from fedskew.data.arrays import check_labels, owned_uint8
from fedskew.data.base import DATASETS, Dataset
from fedskew.data.datasets.sklearn_digits import DIGIT_NAMES
from fedskew.data.files import DatasetFiles, FileSpec
from fedskew.errors import DataError

# Standard per-channel statistics (in [0, 1] units) of the training sets, as used across the literature.
MNIST_NORM = ((0.1307,), (0.3081,))
FASHION_NORM = ((0.2860,), (0.3530,))
FASHION_NAMES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
# IDX type byte -> numpy dtype (big-endian), http://yann.lecun.com/exdb/mnist/ "THE IDX FILE FORMAT"
_IDX_TYPES: dict[int, type | str] = {
    0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"
}  # fmt: skip


def idx_files(folder: str, bases: Sequence[str], digests: dict[str, tuple[str, str]]) -> tuple[FileSpec, ...]:
    """``FileSpec`` per IDX file: ``digests[name] = (official .gz md5, decompressed payload md5)``."""
    return tuple(
        FileSpec(f"{folder}/{name}", f"md5:{gz}", f"md5:{raw}", tuple(b + name for b in bases))
        for name, (gz, raw) in digests.items()
    )


# (official .gz md5, decompressed payload md5); confirmed against the shared data root, whose .gz files are
# re-compressed (different gzip bytes) but whose payloads match the published raw-file md5s.
files.FILES["mnist"] = DatasetFiles(
    "mnist",
    idx_files(
        "mnist",
        ("http://yann.lecun.com/exdb/mnist/", "https://ossci-datasets.s3.amazonaws.com/mnist/"),
        {
            "train-images-idx3-ubyte.gz": (
                "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                "6bbc9ace898e44ae57da46a324031adb",
            ),
            "train-labels-idx1-ubyte.gz": (
                "d53e105ee54ea40749a09fcbcd1e9432",
                "a25bea736e30d166cdddb491f175f624",
            ),
            "t10k-images-idx3-ubyte.gz": (
                "9fb629c4189551a2d022fa330f9573f3",
                "2646ac647ad5339dbf082846283269ea",
            ),
            "t10k-labels-idx1-ubyte.gz": (
                "ec29112dd5afa0611ce80d1b7f02629c",
                "27ae3e4e09519cfbb04c329615203637",
            ),
        },
    ),
    "http://yann.lecun.com/exdb/mnist/",
)
files.FILES["fashion_mnist"] = DatasetFiles(
    "fashion-mnist",
    idx_files(
        "fashion-mnist",
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        {
            "train-images-idx3-ubyte.gz": (
                "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            ),
            "train-labels-idx1-ubyte.gz": (
                "25c81989df183df01b3e8a0aad5dffbe",
                "9018921c3c673c538a1fc5bad174d6f9",
            ),
            "t10k-images-idx3-ubyte.gz": (
                "bef4ecab320f06d8554ea6380940ec79",
                "8181f5470baa50b63fa0f6fddb340f0a",
            ),
            "t10k-labels-idx1-ubyte.gz": (
                "bb300cfdad3c16e7a12a480ee83cd310",
                "15d484375f8d13e6eb1aabb0c3f46965",
            ),
        },
    ),
    "https://github.com/zalandoresearch/fashion-mnist",
)


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


def _idx_split(folder: Path, images: str, labels: str, transpose: bool) -> tuple[Tensor, np.ndarray]:
    x = read_idx(folder / images)
    y = read_idx(folder / labels).astype(np.int64)
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(
            f"{folder / images} / {labels}: expected images [N, H, W] and N labels, "
            f"got {x.shape} and {y.shape}"
        )
    if transpose:  # EMNIST stores each image transposed (column-major); flip back to upright
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
    return owned_uint8(x[:, None]), y


def idx_dataset(
    name: str,
    root: Path,
    prefix: str,
    num_classes: int,
    *,
    verify: bool,
    download: bool,
    transpose: bool = False,
    label_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)`` of an IDX dataset whose files ``FILES[name]`` declares."""
    folder = files.ensure(name, root, verify_files=verify, download=download)
    out = []
    for part in ("train", "t10k") if not prefix else ("train", "test"):
        x, y = _idx_split(
            folder, f"{prefix}{part}-images-idx3-ubyte.gz", f"{prefix}{part}-labels-idx1-ubyte.gz", transpose
        )
        y = y - label_offset
        check_labels(y, num_classes, folder / f"{prefix}{part}-labels-idx1-ubyte.gz")
        out += [x, torch.from_numpy(y)]
    return out[0], out[1], out[2], out[3]


@DATASETS.register("mnist")
def mnist(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """MNIST handwritten digits, 28x28 grayscale, 10 classes, 60k/10k (gzipped IDX under <root>/mnist)."""
    xtr, ytr, xte, yte = idx_dataset("mnist", Path(root), "", 10, verify=verify, download=download)
    return Dataset("mnist", xtr, ytr, xte, yte, 10, *MNIST_NORM, classes=list(DIGIT_NAMES))


@DATASETS.register("fashion_mnist")
def fashion_mnist(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """Fashion-MNIST clothing, 28x28 grayscale, 10 classes, 60k/10k (gzipped IDX in <root>/fashion-mnist)."""
    xtr, ytr, xte, yte = idx_dataset("fashion_mnist", Path(root), "", 10, verify=verify, download=download)
    return Dataset("fashion_mnist", xtr, ytr, xte, yte, 10, *FASHION_NORM, classes=list(FASHION_NAMES))
