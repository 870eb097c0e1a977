"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009), the python pickle distribution.

Source: https://www.cs.toronto.edu/~kriz/cifar.html (free for research, no explicit licence). The official
``*-python.tar.gz`` archives are downloaded, checked against their MD5 and only the batch files extracted;
the batches themselves are checked against the MD5s torchvision lists.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.data import files
from fedskew.data.arrays import check_labels
from fedskew.data.base import DATASETS, Dataset
from fedskew.data.files import Archive, DatasetFiles, FileSpec
from fedskew.errors import DataError

CIFAR10_NORM = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_NORM = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
_PICKLE_ERRORS = (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError, AttributeError)
_SOURCE = "https://www.cs.toronto.edu/~kriz/cifar.html"

files.FILES["cifar10"] = DatasetFiles(
    "cifar-10-batches-py",
    tuple(
        FileSpec(f"cifar-10-batches-py/{n}", f"md5:{d}")
        for n, d in (
            ("data_batch_1", "c99cafc152244af753f735de768cd75f"),
            ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
            ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"),
            ("data_batch_4", "634d18415352ddfa80567beed471001a"),
            ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb"),
            ("test_batch", "40351d587109b95175f43aff81a1287e"),
        )
    ),
    _SOURCE,
    Archive(
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "md5:c58f30108f718f92721af3b95e74349a"
    ),
)
files.FILES["cifar100"] = DatasetFiles(
    "cifar-100-python",
    (
        FileSpec("cifar-100-python/train", "md5:16019d7e3df5f24257cddd939b257f8d"),
        FileSpec("cifar-100-python/test", "md5:f0ef6b0ae62326f3e7ffdfab6717acfc"),
    ),
    _SOURCE,
    Archive(
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "md5:eb9058c3a382ffc7106e4002c42a8d85"
    ),
)


#: the only globals a CIFAR batch pickle references (numpy arrays, bytes); anything else is refused
_PICKLE_GLOBALS = {
    (module, name)
    for module in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name in ("_reconstruct", "scalar")
} | {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}  # bytes in protocol-2 pickles


class _ArraysOnly(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a pickle can otherwise run any code it names."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refused to load {module}.{name} (a CIFAR batch holds arrays only)")
        return super().find_class(module, name)


def _load_pickle(path: Path) -> object:
    with open(path, "rb") as f:
        return _ArraysOnly(f, encoding="bytes").load()


def read_cifar_batch(path: str | os.PathLike, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """A CIFAR python pickle batch: images ``uint8 [N, 3, 32, 32]`` and labels ``int64 [N]``.

    ``label_key`` is ``labels`` (CIFAR-10) or ``fine_labels`` (CIFAR-100). The pickle is read with an
    unpickler that accepts containers and numpy arrays only, so a tampered file cannot run code.
    """
    path = Path(path)
    try:
        batch: Any = _load_pickle(path)
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
        meta: Any = _load_pickle(Path(path))
        return [n.decode() if isinstance(n, bytes) else str(n) for n in meta[key.encode()]]
    except _PICKLE_ERRORS:
        return None


def _dataset(
    name: str,
    arrays: tuple[np.ndarray, ...],
    num_classes: int,
    norm: tuple[tuple[float, ...], tuple[float, ...]],
    classes: list[str] | None,
) -> Dataset:
    xtr, ytr, xte, yte = (torch.from_numpy(a) for a in arrays)
    return Dataset(name, xtr, ytr, xte, yte, num_classes, *norm, classes=classes)


@DATASETS.register("cifar10")
def cifar10(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """CIFAR-10, 32x32 RGB, 10 classes, 50k/10k (python pickle batches in <root>/cifar-10-batches-py)."""
    folder = files.ensure("cifar10", Path(root), verify_files=verify, download=download)
    parts = [read_cifar_batch(folder / f"data_batch_{i}", "labels") for i in range(1, 6)]
    xtr, ytr = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    xte, yte = read_cifar_batch(folder / "test_batch", "labels")
    check_labels(ytr, 10, folder / "data_batch_*")
    check_labels(yte, 10, folder / "test_batch")
    names = read_pickle_names(folder / "batches.meta", "label_names") or CIFAR10_NAMES
    return _dataset("cifar10", (xtr, ytr, xte, yte), 10, CIFAR10_NORM, names)


@DATASETS.register("cifar100")
def cifar100(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """CIFAR-100, 32x32 RGB, 100 fine classes, 50k/10k (python pickles in <root>/cifar-100-python)."""
    folder = files.ensure("cifar100", Path(root), verify_files=verify, download=download)
    xtr, ytr = read_cifar_batch(folder / "train", "fine_labels")
    xte, yte = read_cifar_batch(folder / "test", "fine_labels")
    check_labels(ytr, 100, folder / "train")
    check_labels(yte, 100, folder / "test")
    names = read_pickle_names(folder / "meta", "fine_label_names")
    return _dataset("cifar100", (xtr, ytr, xte, yte), 100, CIFAR100_NORM, names)
