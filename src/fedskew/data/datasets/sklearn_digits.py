"""``digits``: scikit-learn's bundled 8x8 handwritten digits (UCI optdigits; Alpaydin & Kaynak 1998).

Source: https://archive.ics.uci.edu/dataset/80 (CC BY 4.0), shipped inside scikit-learn: offline, no download.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedskew.data.arrays import channel_stats
from fedskew.data.base import DATASETS, Dataset

DIGIT_NAMES = [str(d) for d in range(10)]


@DATASETS.register("digits")
def digits(root: Path | None = None, *, test_size: int = 360, split_seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 handwritten digits, 10 classes, 1,437/360 split: offline, no download."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    # 0..16 intensities -> 0..255 so every image dataset shares the uint8 contract
    x = np.rint(raw.data * (255.0 / 16.0)).astype(np.uint8).reshape(-1, 1, 8, 8)
    y = raw.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_size, stratify=y, random_state=split_seed)
    x_train = torch.from_numpy(xtr)
    mean, std = channel_stats(x_train)  # no community-standard constants for this set: exact train stats
    return Dataset(
        "digits",
        x_train,
        torch.from_numpy(ytr),
        torch.from_numpy(xte),
        torch.from_numpy(yte),
        10,
        mean=mean,
        std=std,
        classes=list(DIGIT_NAMES),
    )
