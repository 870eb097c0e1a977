"""``digits``: scikit-learn's bundled 8x8 handwritten digits (UCI optdigits; Alpaydin & Kaynak 1998).

Source: https://archive.ics.uci.edu/dataset/80 (CC BY 4.0), shipped inside scikit-learn: offline, no download.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedskew.data.arrays import channel_stats
from fedskew.data.base import DATASETS, Dataset
from fedskew.data.cache import cache_root, load_saved, save_atomic

DIGIT_NAMES = [str(d) for d in range(10)]


@DATASETS.register("digits")
def digits(root: Path | None = None, *, test_size: int = 360, split_seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 handwritten digits, 10 classes, 1,437/360 split: offline, no download."""
    x_train, y_train, x_test, y_test = _split(test_size, split_seed)
    mean, std = channel_stats(x_train)  # no community-standard constants for this set: exact train stats
    return Dataset(
        "digits", x_train, y_train, x_test, y_test, 10, mean=mean, std=std, classes=list(DIGIT_NAMES)
    )


def _split(test_size: int, split_seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The stratified train/test split, made by scikit-learn once per (version, options) and read back from
    the cache afterwards: importing scikit-learn takes ~3 s, paid by every fresh process that loads the set
    (each Flower ClientApp, each sweep worker)."""
    key = f"digits-sklearn{version('scikit-learn')}-{test_size}-{split_seed}.pt"
    saved = load_saved(cache_root() / key)
    if isinstance(saved, dict) and all(isinstance(saved.get(k), Tensor) for k in _PARTS):
        return tuple(saved[k] for k in _PARTS)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    # 0..16 intensities -> 0..255 so every image dataset shares the uint8 contract
    x = np.rint(raw.data * (255.0 / 16.0)).astype(np.uint8).reshape(-1, 1, 8, 8)
    y = raw.target.astype(np.int64)
    parts = train_test_split(x, y, test_size=test_size, stratify=y, random_state=split_seed)
    xtr, xte, ytr, yte = (torch.from_numpy(a) for a in parts)
    save_atomic(cache_root() / key, dict(zip(_PARTS, (xtr, ytr, xte, yte), strict=True)))
    return xtr, ytr, xte, yte


_PARTS = ("x_train", "y_train", "x_test", "y_test")
