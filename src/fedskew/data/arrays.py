"""Small array helpers shared by the dataset loaders: exact channel statistics, label checks, splits."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedskew.errors import DataError


def channel_stats(x: Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std (in [0, 1] units) of ``uint8 [N, C, H, W]`` images.

    Computed from a 256-bin histogram per channel, so no float copy of the dataset is made.
    """
    levels = torch.arange(256, dtype=torch.float64) / 255.0
    means, stds = [], []
    for c in range(x.shape[1]):
        hist = torch.bincount(x[:, c].reshape(-1), minlength=256).double()
        n = hist.sum()
        mean = (hist * levels).sum() / n
        var = (hist * (levels - mean) ** 2).sum() / n
        means.append(round(float(mean), 4))
        stds.append(round(math.sqrt(float(var)), 4))
    return tuple(means), tuple(stds)


def exact_norm(x: Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` of the images for :meth:`Dataset.to_float`; a constant channel keeps std 1."""
    mean, std = channel_stats(x)
    return mean, tuple(s if s > 0 else 1.0 for s in std)


def check_labels(y: np.ndarray, num_classes: int, source: Path | str) -> None:
    """``DataError`` naming ``source`` when a label falls outside ``0..num_classes-1``."""
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(
            f"{source}: labels span {int(y.min())}..{int(y.max())}, expected 0..{num_classes - 1}; "
            "the file is corrupted or not this dataset"
        )


def owned_uint8(arr: np.ndarray) -> Tensor:
    """Owned, writable tensor (``frombuffer`` arrays are read-only views of the decompressed bytes)."""
    return torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True))


def stratified_split(groups: np.ndarray, train_fraction: float, seed: int) -> np.ndarray:
    """Boolean train mask: within every group, a seeded random ``round(fraction * size)`` go to train.

    Groups of two or more keep at least one sample on each side, so every (domain, class) is tested.
    """
    n = groups.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    idx = order[np.argsort(groups[order], kind="stable")]  # grouped, random order inside each group
    g = groups[idx]
    counts = np.bincount(g)
    starts = np.cumsum(counts) - counts
    rank = np.arange(n) - starts[g]
    mask = np.empty(n, dtype=bool)
    n_train = np.rint(counts * train_fraction).astype(np.int64)
    n_train = np.where(counts >= 2, np.clip(n_train, 1, counts - 1), counts)
    mask[idx] = rank < n_train[g]
    return mask
