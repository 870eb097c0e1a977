"""``femnist``: FEMNIST from LEAF (Caldas et al. 2018), EMNIST by-class split by writer, 62 classes.

Source: https://github.com/TalwalkarLab/leaf (BSD-2-Clause code; data from NIST SD19). Generate the json
files with LEAF's ``data/femnist/preprocess.sh`` into ``<root>/femnist/{train,test}``; there is no official
checksum (the files depend on LEAF's sampling options), so they are checked by parsing.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedskew.data.arrays import channel_stats, check_labels
from fedskew.data.base import DATASETS, Dataset
from fedskew.errors import DataError

FEMNIST_NAMES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)  # LEAF order, 62


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


def _read_parts(base: Path) -> dict[str, tuple[np.ndarray, np.ndarray, list[str], np.ndarray]]:
    for part in ("train", "test"):
        if not (base / part).is_dir() or not any((base / part).glob("*.json")):
            raise DataError(
                f"dataset 'femnist': no LEAF json files (train/*.json, test/*.json) in {base}; generate them "
                "with LEAF's data/femnist/preprocess.sh (https://github.com/TalwalkarLab/leaf), "
                "or set FEDSKEW_DATA or data.root to the folder that holds femnist/"
            )
    parts = {}
    for part in ("train", "test"):
        x, y, names, widx = read_leaf(base / part)
        if x.shape[1] != 28 * 28:
            raise DataError(f"{base / part}: LEAF samples have {x.shape[1]} values, expected 784 (28x28)")
        check_labels(y, 62, base / part)
        parts[part] = (x, y, names, widx)
    return parts


@DATASETS.register("femnist")
def femnist(root: Path) -> Dataset:
    """FEMNIST (LEAF json under <root>/femnist/{train,test}), 28x28, 62 classes, writer id per sample in meta.

    LEAF stores ``x`` as 784 floats in [0, 1] (white background = 1.0, as in NIST SD19); kept as is.
    ``meta["writer_train"]`` / ``meta["writer_test"]`` index ``meta["writer_names"]`` (shared id space).
    """
    parts = _read_parts(Path(root) / "femnist")
    writer_names = sorted(set(parts["train"][2]) | set(parts["test"][2]))
    pos = {w: i for i, w in enumerate(writer_names)}

    def tensors(part: str) -> tuple[Tensor, Tensor, Tensor]:
        x, y, names, widx = parts[part]
        to_global = np.array([pos[w] for w in names], dtype=np.int64)  # one entry per writer
        img = np.rint(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8).reshape(-1, 1, 28, 28)
        return torch.from_numpy(img), torch.from_numpy(y), torch.from_numpy(to_global[widx])

    xtr, ytr, wtr = tensors("train")
    xte, yte, wte = tensors("test")
    mean, std = channel_stats(xtr)
    return Dataset(
        "femnist",
        xtr,
        ytr,
        xte,
        yte,
        62,
        mean=mean,
        std=std,
        classes=list(FEMNIST_NAMES),
        meta={"writer_train": wtr, "writer_test": wte, "writer_names": writer_names},
    )
