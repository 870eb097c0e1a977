"""``hf``: a local Hugging Face dataset (``save_to_disk`` folder or parquet files), read offline.

Hugging Face ``datasets`` (Lhoest et al. 2021, https://github.com/huggingface/datasets, Apache-2.0) is the
format of the Flower ecosystem (``flwr-datasets`` builds on it). Nothing is downloaded: a ``save_to_disk``
folder is opened with ``datasets.load_from_disk``, parquet files with ``load_dataset("parquet",
data_files=...)`` into a temporary cache that is removed afterwards. The sample order of each split is kept,
so fedskew's client indices select the same rows with ``Dataset.select`` (see :mod:`fedskew.data.export`).
Needs the optional extra: ``pip install 'fedskew[hf]'``.
"""

from __future__ import annotations

import glob
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.data.arrays import exact_norm
from fedskew.data.base import DATASETS, Dataset
from fedskew.data.datasets.imagefolder import resolve
from fedskew.data.images import CHANNELS, check_mode, check_size, choose_mode, common_shape, stack, to_array
from fedskew.errors import ConfigError, DataError


def _hf() -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "dataset 'hf' needs the Hugging Face 'datasets' package: pip install 'fedskew[hf]'"
        ) from None
    return datasets


def _is_glob(path: Path) -> bool:
    return any(c in str(path) for c in "*?[")


def _parquet_files(base: Path, split: str) -> list[str]:
    """Parquet files of ``split`` under ``base`` (a folder or a glob): ``<split>.parquet``,
    ``<split>-*.parquet`` (the Hub's ``data/train-00000-of-00001.parquet``) or ``<split>/*.parquet``."""
    found = [Path(p) for p in glob.glob(str(base), recursive=True)] if _is_glob(base) else base.rglob("*")

    def of_split(p: Path) -> bool:
        named = p.stem == split or p.name.startswith(f"{split}-") or p.parent.name == split
        return p.suffix == ".parquet" and named

    return sorted(str(p) for p in found if of_split(p))


def _open_splits(base: Path, splits: tuple[str, str], tmp: str) -> dict[str, Any]:
    """``{split: datasets.Dataset}`` for the train and test split names, read from disk only."""
    hf = _hf()
    if not _is_glob(base) and ((base / "dataset_dict.json").is_file() or (base / "state.json").is_file()):
        loaded = hf.load_from_disk(str(base), keep_in_memory=True)
        table = loaded if isinstance(loaded, hf.DatasetDict) else {"train": loaded}
    else:
        data_files = {s: f for s in splits if (f := _parquet_files(base, s))}
        if not data_files:
            raise DataError(
                f"dataset 'hf': no save_to_disk folder or parquet files for {', '.join(splits)} in {base}"
            )
        table = hf.load_dataset("parquet", data_files=data_files, cache_dir=tmp, keep_in_memory=True)
    missing = [s for s in splits if s not in table]
    if missing:
        raise ConfigError(
            f"dataset 'hf': split '{missing[0]}' not in {base}; available: {', '.join(table)} "
            "(set data.options.train_split / test_split)"
        )
    return {s: table[s] for s in splits}


def _column(ds: Any, name: str, option: str) -> None:
    if name not in ds.column_names:
        raise ConfigError(
            f"dataset 'hf': column '{name}' not found (data.options.{option}); "
            f"columns: {', '.join(ds.column_names)}"
        )


def _pil_images(col: Any, size: int | None, mode: str | None) -> Tensor:
    """Decoded PIL images -> ``uint8 [N, C, H, W]`` (grey when every image is grey, unless ``mode``)."""
    images = list(col)
    mode = mode or choose_mode([im.mode for im in images])
    shape = common_shape([(im.size[1], im.size[0]) for im in images], size, "hf")
    return torch.from_numpy(stack(len(images), shape, mode, lambda i: to_array(images[i], mode, size)))


def _array_images(arr: np.ndarray, size: int | None, mode: str | None) -> Tensor:
    """Stored arrays ``[N, H, W]``, ``[N, H, W, C]`` or ``[N, C, H, W]`` -> ``uint8 [N, C, H, W]``."""
    if arr.dtype == object:
        raise DataError("dataset 'hf': stored image arrays differ in shape; store them as an Image feature")
    if arr.dtype.kind == "f" and arr.size and arr.max() <= 1.0:
        arr = arr * 255.0  # floats in [0, 1]
    x = torch.from_numpy(np.clip(np.rint(arr), 0, 255).astype(np.uint8))
    if x.dim() == 3:
        x = x[:, None]
    elif x.dim() == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3):
        x = x.permute(0, 3, 1, 2)
    if x.dim() != 4 or x.shape[1] not in (1, 3, 4):
        raise DataError(
            f"dataset 'hf': image arrays must be [N, H, W(, C)] or [N, C, H, W], got {tuple(arr.shape)}"
        )
    x = x[:, :3]  # drop alpha
    if mode is not None and x.shape[1] != CHANNELS[mode]:
        x = (
            x.float().mean(1, keepdim=True).round().to(torch.uint8)
            if mode == "L"
            else x.expand(-1, 3, -1, -1)
        )
    if size is not None:
        x = F.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True).round().clamp(0, 255)
    return x.to(torch.uint8).contiguous()


def _images(ds: Any, column: str, size: int | None, mode: str | None) -> Tensor:
    hf = _hf()
    if isinstance(ds.features[column], hf.Image):
        return _pil_images(ds[column], size, mode)
    return _array_images(np.asarray(ds.with_format("numpy")[column]), size, mode)


def _labels(ds: Any, column: str) -> Tensor:
    y = np.asarray(ds.with_format("numpy")[column])
    if y.ndim != 1 or y.dtype.kind not in "iu" or (y.size and y.min() < 0):
        raise DataError(f"dataset 'hf': label column '{column}' must hold non-negative integers")
    return torch.from_numpy(y.astype(np.int64))


def _class_names(ds: Any, column: str, num_classes: int) -> list[str]:
    names = getattr(ds.features[column], "names", None)  # a ClassLabel feature names its classes
    return list(names) if names else [str(c) for c in range(num_classes)]


@DATASETS.register("hf")
def hf(
    root: Path,
    *,
    path: str | None = None,
    image_column: str = "image",
    label_column: str = "label",
    train_split: str = "train",
    test_split: str = "test",
    size: int | None = None,
    mode: str | None = None,
) -> Dataset:
    """A local Hugging Face dataset (``save_to_disk`` folder or parquet), offline; needs ``fedskew[hf]``.

    ``path`` is relative to the data root unless absolute. Images may be an ``Image`` feature (decoded with
    Pillow) or stored arrays; labels are integers, named by the label feature when it is a ``ClassLabel``.
    ``size`` resizes to a square side; ``mode`` ``L`` / ``RGB`` forces grey / colour.
    """
    check_mode(mode, "hf")
    check_size(size, "hf")
    base = resolve(root, path, "path", "hf")
    if not (base.exists() or _is_glob(base)):
        raise DataError(
            f"dataset 'hf': {base} not found (data.options.path: a save_to_disk folder or parquet files)"
        )
    with tempfile.TemporaryDirectory(prefix="fedskew-hf-") as tmp:
        splits = _open_splits(base, (train_split, test_split), tmp)
        train, test = splits[train_split], splits[test_split]
        for ds in (train, test):
            _column(ds, image_column, "image_column")
            _column(ds, label_column, "label_column")
        x_train = _images(train, image_column, size, mode)
        x_test = _images(test, image_column, size, mode or ("L" if x_train.shape[1] == 1 else "RGB"))
        y_train, y_test = _labels(train, label_column), _labels(test, label_column)
        both = torch.cat([y_train, y_test])
        classes = _class_names(train, label_column, int(both.max()) + 1 if both.numel() else 0)
    mean, std = exact_norm(x_train)
    meta = {"path": str(base), "splits": [train_split, test_split]}
    num_classes = max(len(classes), int(both.max()) + 1 if both.numel() else 0)
    return Dataset(
        "hf", x_train, y_train, x_test, y_test, num_classes, mean=mean, std=std, classes=classes, meta=meta
    )
