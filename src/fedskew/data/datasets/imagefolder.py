"""``imagefolder``: a dataset read from a folder of images, one sub-folder per class (any source).

Two layouts (class names come from the folder names, or from the split file):

- ``FOLDER/train/<class>/<image>`` and ``FOLDER/test/<class>/<image>`` (torchvision's ``ImageFolder`` layout,
  one per split); classes are the sorted union of the class folders of both splits.
- ``FOLDER/<class>/<image>`` plus a CoOp split file (Zhou et al. 2022, "Learning to Prompt for
  Vision-Language Models", https://github.com/KaiyangZhou/CoOp: ``split_zhou_Caltech101.json`` and the
  other ``split_zhou_*.json`` of the CacheFL datasets), ``{"train": [[relpath, label, classname], ...],
  "val": [...], "test": [...]}`` with paths relative to FOLDER. ``val`` is ignored unless ``val_to_train``.

Images are decoded once with Pillow and cached as one ``uint8`` tensor file in the cache folder of the image
folder (:func:`image_cache`, under ``$FEDSKEW_CACHE``; never in the data root, which is only read; see
:mod:`fedskew.data.images`). Normalisation uses the exact per-channel statistics of the training images.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedskew.data.arrays import exact_norm
from fedskew.data.base import DATASETS, Dataset
from fedskew.data.cache import derived_dir
from fedskew.data.images import cached_images, check_mode, check_size, list_images
from fedskew.errors import ConfigError, DataError

Norm = tuple[tuple[float, ...], tuple[float, ...]]
#: sub-folder of a source folder's cache folder that holds its decoded image sets
IMAGE_CACHE = "images"
_LAYOUT = "FOLDER/{train,test}/<class>/<image>, or FOLDER/<class>/<image> with data.options.split_file"


def resolve(root: Path, value: str | None, option: str, dataset: str) -> Path:
    """``data.options.<option>`` as a path: absolute as given, relative under the data root."""
    if value is None or str(value) == "":
        raise ConfigError(
            f"dataset '{dataset}' needs data.options.{option} (a folder, relative to data.root)"
        )
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path(root) / path


def image_cache(folder: Path, cache: bool = True) -> Path | None:
    """Where decoded images of ``folder`` are cached (``None`` with ``cache=False``): keyed by the folder's
    resolved path under the cache root, so the data root is never written and two roots never collide."""
    return derived_dir(folder, IMAGE_CACHE) if cache else None


def class_folders(folder: Path) -> list[str]:
    """Sorted names of the visible sub-folders of ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _from_folders(base: Path) -> tuple[list[Path], np.ndarray, np.ndarray, list[str]]:
    """(paths, labels, is_train, classes) of the ``train/`` + ``test/`` layout."""
    if not ((base / "train").is_dir() and (base / "test").is_dir()):
        raise DataError(
            f"dataset 'imagefolder': no train/ and test/ sub-folders in {base}; expected {_LAYOUT}"
        )
    classes = sorted(set(class_folders(base / "train")) | set(class_folders(base / "test")))
    paths: list[Path] = []
    labels: list[int] = []
    split: list[bool] = []
    for part in ("train", "test"):
        for ci, c in enumerate(classes):  # per class folder, not per sample
            found = list_images(base / part / c) if (base / part / c).is_dir() else []
            paths += found
            labels += [ci] * len(found)
            split += [part == "train"] * len(found)
    return paths, np.asarray(labels, dtype=np.int64), np.asarray(split, dtype=bool), classes


def _split_entries(table: object, split_file: Path, parts: tuple[str, ...]) -> list[list]:
    """The ``[relpath, label, classname]`` entries of the named parts of a CoOp split file."""
    try:
        entries = [e for p in parts for e in table[p]]  # type: ignore[index]
    except (KeyError, TypeError) as err:
        entries, missing = [], f"{type(err).__name__}: {err}"
    else:
        ok = all(isinstance(e, list) and len(e) == 3 and isinstance(e[1], int) for e in entries)
        missing = "" if ok else "an entry is not [relpath, integer label, classname]"
    if missing:
        raise DataError(
            f"{split_file}: not a CoOp split file ({missing}); expected "
            '{"train": [[relpath, label, classname], ...], "val": [...], "test": [...]}'
        )
    return entries


def _class_names(labels: np.ndarray, names: list[str], split_file: Path) -> list[str]:
    """Class names ordered by label, from the split file's classname column (one name per label)."""
    num = int(labels.max(initial=-1)) + 1
    pairs = sorted(set(zip(labels.tolist(), names, strict=True)))
    if [label for label, _ in pairs] != list(range(num)):
        raise DataError(
            f"{split_file}: labels must be 0..{num - 1} with one class name each, got {len(pairs)} "
            "distinct (label, classname) pairs"
        )
    return [name for _, name in pairs]


def _from_split_file(
    base: Path, split_file: Path, val_to_train: bool
) -> tuple[list[Path], np.ndarray, np.ndarray, list[str]]:
    """(paths, labels, is_train, classes) from a CoOp ``split_zhou_*.json`` over the image folder ``base``."""
    try:
        table = json.loads(split_file.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read split file {split_file}: {err}") from None
    train = _split_entries(table, split_file, ("train", "val") if val_to_train else ("train",))
    test = _split_entries(table, split_file, ("test",))
    entries = train + test
    paths = [base / str(e[0]) for e in entries]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DataError(
            f"dataset 'imagefolder': {len(missing)} images listed in {split_file} are missing under {base} "
            f"(first: {missing[0]}); data.options.path must name the folder the split file's paths start in"
        )
    labels = np.asarray([int(e[1]) for e in entries], dtype=np.int64)
    classes = _class_names(labels, [str(e[2]) for e in entries], split_file)
    is_train = np.arange(len(entries)) < len(train)
    return paths, labels, is_train, classes


def image_dataset(
    name: str,
    paths: list[Path],
    labels: np.ndarray,
    is_train: np.ndarray,
    classes: list[str],
    *,
    size: int | None,
    mode: str | None,
    cache_dir: Path | None,
    norm: Norm | None = None,
    domains: np.ndarray | None = None,
    domain_names: list[str] | None = None,
) -> Dataset:
    """Decode (cached) the listed images and split them into a :class:`Dataset` by ``is_train``.

    ``norm`` defaults to the exact per-channel statistics of the training images; ``domains`` tags each
    image with a domain id (feature skew).
    """
    if not is_train.any() or is_train.all():
        raise DataError(f"dataset '{name}': found {len(paths)} images; need both train and test images")
    x, used_mode = cached_images(paths, size, mode, cache_dir, name)
    tr, te = torch.from_numpy(np.flatnonzero(is_train)), torch.from_numpy(np.flatnonzero(~is_train))
    y = torch.from_numpy(labels)
    mean, std = norm if norm is not None else exact_norm(x[tr])
    d: Tensor | None = None if domains is None else torch.from_numpy(domains)
    return Dataset(
        name,
        x[tr],
        y[tr],
        x[te],
        y[te],
        len(classes),
        mean=mean,
        std=std,
        classes=list(classes),
        domain_train=None if d is None else d[tr],
        domain_test=None if d is None else d[te],
        domain_names=domain_names,
        meta={"mode": used_mode},
    )


@DATASETS.register("imagefolder")
def imagefolder(
    root: Path,
    *,
    path: str | None = None,
    split_file: str | None = None,
    size: int | None = None,
    mode: str | None = None,
    val_to_train: bool = False,
    cache: bool = True,
) -> Dataset:
    """Images in class sub-folders: ``path/{train,test}/<class>/*`` or ``path/<class>/*`` + a CoOp split file.

    ``path`` (and ``split_file``) are relative to the data root unless absolute. ``size`` resizes to a
    square side (needed when the images differ in size); ``mode`` ``L`` or ``RGB`` forces grey or colour
    (default: grey when every image is grey). ``val_to_train`` appends the split file's ``val`` entries to
    training (default: ignored, as CoOp's few-shot protocol). ``cache`` keeps the decoded tensor in the
    cache (:func:`image_cache` of ``path``; ``False``: decode on every load).
    """
    check_mode(mode, "imagefolder")
    check_size(size, "imagefolder")
    base = resolve(root, path, "path", "imagefolder")
    if not base.is_dir():
        raise DataError(
            f"dataset 'imagefolder': folder {base} not found (data.options.path); expected {_LAYOUT}"
        )
    if split_file is None:
        paths, labels, is_train, classes = _from_folders(base)
    else:
        paths, labels, is_train, classes = _from_split_file(
            base, resolve(root, split_file, "split_file", "imagefolder"), val_to_train
        )
    cache_dir = image_cache(base, cache)
    ds = image_dataset(
        "imagefolder", paths, labels, is_train, classes, size=size, mode=mode, cache_dir=cache_dir
    )
    ds.meta["path"] = str(base)
    return ds
