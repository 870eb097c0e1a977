"""``svhn``: Street View House Numbers (Netzer et al. 2011), the cropped-digits ``*_32x32.mat`` files.

Source: http://ufldl.stanford.edu/housenumbers/ (non-commercial use). The two ``.mat`` files are downloaded
into ``<root>/svhn`` and checked against the MD5s torchvision lists.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from fedskew.data import files
from fedskew.data.arrays import check_labels
from fedskew.data.base import DATASETS, Dataset
from fedskew.data.datasets.sklearn_digits import DIGIT_NAMES
from fedskew.data.files import DatasetFiles, FileSpec
from fedskew.errors import DataError

SVHN_NORM = ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))
_URL = "http://ufldl.stanford.edu/housenumbers/"

files.FILES["svhn"] = DatasetFiles(
    "svhn",
    (
        FileSpec(
            "svhn/train_32x32.mat", "md5:e26dedcc434d2e4c54c9b2d4a06d8373", urls=(_URL + "train_32x32.mat",)
        ),
        FileSpec(
            "svhn/test_32x32.mat", "md5:eb5a983be6a315427106f1b164d9cef3", urls=(_URL + "test_32x32.mat",)
        ),
    ),
    _URL,
)


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


@DATASETS.register("svhn")
def svhn(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """SVHN house numbers, 32x32 RGB, 10 classes, 73,257/26,032 (<root>/svhn/{train,test}_32x32.mat)."""
    folder = files.ensure("svhn", Path(root), verify_files=verify, download=download)
    xtr, ytr = read_svhn_mat(folder / "train_32x32.mat")
    xte, yte = read_svhn_mat(folder / "test_32x32.mat")
    check_labels(ytr, 10, folder / "train_32x32.mat")
    check_labels(yte, 10, folder / "test_32x32.mat")
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in (xtr, ytr, xte, yte))
    return Dataset("svhn", x_train, y_train, x_test, y_test, 10, *SVHN_NORM, classes=list(DIGIT_NAMES))
