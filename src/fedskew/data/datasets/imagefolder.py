"""``imagefolder``: a dataset read from a folder of images, one sub-folder per class (any source).

Two layouts (class names come from the folder names, or from the split file):

- ``FOLDER/train/<class>/<image>`` and ``FOLDER/test/<class>/<image>`` (torchvision's ``ImageFolder`` layout,
  one per split); classes are the sorted union of the class folders of both splits.
- ``FOLDER/<class>/<image>`` plus a CoOp split file (Zhou et al. 2022, "Learning to Prompt for
  Vision-Language Models", https://github.com/KaiyangZhou/CoOp: ``split_zhou_Caltech101.json`` and the
  other ``split_zhou_*.json`` of the CacheFL datasets), ``{"train": [[relpath, label, classname], ...],
  "val": [...], "test": [...]}`` with paths relative to FOLDER. ``val`` is ignored (default), appended to
  training (``val_to_train``), or kept as the dataset's validation pool (``val_split: coop``).

The split-file reader (:func:`split_file_listing`) and :func:`listing_dataset` are shared with the CoOp
loaders of :mod:`fedskew.data.datasets.coop`.

Images are decoded once with Pillow and cached as one ``uint8`` tensor file in the cache folder of the image
folder (:func:`image_cache`, under ``$FEDSKEW_CACHE``; never in the data root, which is only read; see
:mod:`fedskew.data.images`). Normalisation uses the exact per-channel statistics of the training images.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from fedskew.data.arrays import exact_norm
from fedskew.data.base import DATASETS, Dataset, FewShotSubset
from fedskew.data.cache import derived_dir
from fedskew.data.images import cached_images, check_mode, check_resize, check_size, list_images
from fedskew.errors import ConfigError, DataError

Norm = tuple[tuple[float, ...], tuple[float, ...]]
#: sub-folder of a source folder's cache folder that holds its decoded image sets
IMAGE_CACHE = "images"
_LAYOUT = "FOLDER/{train,test}/<class>/<image>, or FOLDER/<class>/<image> with data.options.split_file"
#: codes of :attr:`Listing.part`: the split an image belongs to
TRAIN, VAL, TEST = 0, 1, 2
#: the parts of a CoOp split file, by code
PARTS = ("train", "val", "test")
ValSplit = Literal["coop", "none"]


@dataclass(frozen=True)
class Listing:
    """Image files before decoding: ``paths``, ``labels`` (int64), ``part`` (int64 :data:`TRAIN` /
    :data:`VAL` / :data:`TEST` per image) and the class names by label."""

    paths: list[Path]
    labels: np.ndarray
    part: np.ndarray
    classes: list[str]

    def take(self, keep: np.ndarray) -> Listing:
        """The images at the (sorted) positions ``keep``."""
        paths = [self.paths[i] for i in keep.tolist()]
        return Listing(paths, self.labels[keep], self.part[keep], self.classes)

    def val_to_train(self) -> Listing:
        """The ``val`` images relabelled as training images."""
        return Listing(self.paths, self.labels, np.where(self.part == VAL, TRAIN, self.part), self.classes)


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


def _from_folders(base: Path) -> Listing:
    """The images of the ``train/`` + ``test/`` layout."""
    if not ((base / "train").is_dir() and (base / "test").is_dir()):
        raise DataError(
            f"dataset 'imagefolder': no train/ and test/ sub-folders in {base}; expected {_LAYOUT}"
        )
    classes = sorted(set(class_folders(base / "train")) | set(class_folders(base / "test")))
    paths: list[Path] = []
    labels: list[int] = []
    split: list[int] = []
    for part in ("train", "test"):
        for ci, c in enumerate(classes):  # per class folder, not per sample
            found = list_images(base / part / c) if (base / part / c).is_dir() else []
            paths += found
            labels += [ci] * len(found)
            split += [TRAIN if part == "train" else TEST] * len(found)
    return Listing(paths, np.asarray(labels, dtype=np.int64), np.asarray(split, dtype=np.int64), classes)


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


def check_listed(dataset: str, paths: list[Path], listed_in: Path, base: Path, layout: str) -> None:
    """``DataError`` (count, first missing file, expected layout) unless every listed image exists."""
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DataError(
            f"dataset '{dataset}': {len(missing)} images listed in {listed_in} are missing under {base} "
            f"(first: {missing[0]}); expected {layout}"
        )


def split_file_listing(base: Path, split_file: Path, dataset: str, layout: str, *, val: bool) -> Listing:
    """The images of a CoOp ``split_zhou_*.json`` over the image folder ``base``, in the file's order:
    ``train``, then ``val`` (only with ``val``; else not read), then ``test`` entries; class names by label
    from the classname column. ``DataError`` naming the file and the expected ``layout`` when it or a listed
    image is missing."""
    if not split_file.is_file():
        raise DataError(f"dataset '{dataset}': split file {split_file} not found; expected {layout}")
    try:
        table = json.loads(split_file.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read split file {split_file}: {err}") from None
    groups = [_split_entries(table, split_file, (p,)) if val or p != "val" else [] for p in PARTS]
    entries = [e for g in groups for e in g]
    paths = [base / str(e[0]) for e in entries]
    check_listed(dataset, paths, split_file, base, layout)
    labels = np.asarray([int(e[1]) for e in entries], dtype=np.int64)
    classes = _class_names(labels, [str(e[2]) for e in entries], split_file)
    part = np.repeat(np.arange(len(PARTS), dtype=np.int64), [len(g) for g in groups])
    return Listing(paths, labels, part, classes)


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
    val_pool: np.ndarray | None = None,
    subset: FewShotSubset | None = None,
    resize: str = "squash",
) -> Dataset:
    """Decode (cached) the listed images and split them into a :class:`Dataset` by ``is_train``.

    ``norm`` defaults to the exact per-channel statistics of the training images outside the validation
    pool; ``domains`` tags each image with a domain id (feature skew); ``val_pool`` (bool per listed image,
    a subset of ``is_train``) marks the training images of the validation pool (``Dataset.val_pool``);
    ``resize`` is how images reach ``size`` (:data:`fedskew.data.images.RESIZES`).
    """
    if not is_train.any() or is_train.all():
        raise DataError(f"dataset '{name}': found {len(paths)} images; need both train and test images")
    x, used_mode = cached_images(paths, size, mode, cache_dir, name, resize)
    tr, te = torch.from_numpy(np.flatnonzero(is_train)), torch.from_numpy(np.flatnonzero(~is_train))
    y = torch.from_numpy(labels)
    pool = None if val_pool is None else torch.from_numpy(val_pool[is_train].astype(bool))
    fit = tr if pool is None else tr[~pool]
    mean, std = norm if norm is not None else exact_norm(x[fit])
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
        val_pool=pool,
        subset=subset,
    )


def listing_dataset(
    name: str,
    listing: Listing,
    *,
    size: int | None,
    mode: str | None,
    cache_dir: Path | None,
    subset: FewShotSubset | None = None,
    resize: str = "squash",
) -> Dataset:
    """:func:`image_dataset` of a :class:`Listing`: ``train`` and ``val`` images form the training set (in
    listing order), ``val`` ones its validation pool when there are any; ``test`` images the test set."""
    has_val = bool((listing.part == VAL).any())
    return image_dataset(
        name,
        listing.paths,
        listing.labels,
        listing.part != TEST,
        listing.classes,
        size=size,
        mode=mode,
        cache_dir=cache_dir,
        val_pool=(listing.part == VAL) if has_val else None,
        subset=subset,
        resize=resize,
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
    val_split: ValSplit = "none",
    cache: bool = True,
    resize: str = "squash",
) -> Dataset:
    """Images in class sub-folders: ``path/{train,test}/<class>/*`` or ``path/<class>/*`` + a CoOp split file.

    ``path`` (and ``split_file``) are relative to the data root unless absolute. ``size`` resizes to a
    square side (needed when the images differ in size); ``mode`` ``L`` or ``RGB`` forces grey or colour
    (default: grey when every image is grey). The split file's ``val`` entries are ignored by default (CoOp's
    few-shot protocol draws no validation); ``val_split: coop`` keeps them as the validation pool that
    ``data.val_shots`` draws from; ``val_to_train`` appends them to training. ``cache`` keeps the decoded
    tensor in the cache (:func:`image_cache` of ``path``; ``False``: decode on every load). ``resize``:
    ``squash`` (both sides to ``size``) or ``shortest`` (CLIP's: shortest side to ``size``, centre crop).
    """
    check_mode(mode, "imagefolder")
    check_size(size, "imagefolder")
    check_resize(resize, size, "imagefolder")
    if val_to_train and val_split == "coop":
        raise ConfigError(
            "dataset 'imagefolder': val_to_train and val_split=coop both claim the val entries; allowed: one"
        )
    base = resolve(root, path, "path", "imagefolder")
    if not base.is_dir():
        raise DataError(
            f"dataset 'imagefolder': folder {base} not found (data.options.path); expected {_LAYOUT}"
        )
    if split_file is None:
        listing = _from_folders(base)
    else:
        layout = "data.options.path: the folder the split file's paths start in; " + _LAYOUT
        file = resolve(root, split_file, "split_file", "imagefolder")
        listing = split_file_listing(
            base, file, "imagefolder", layout, val=val_to_train or val_split == "coop"
        )
        listing = listing.val_to_train() if val_to_train else listing
    cache_dir = image_cache(base, cache)
    ds = listing_dataset("imagefolder", listing, size=size, mode=mode, cache_dir=cache_dir, resize=resize)
    ds.meta["path"] = str(base)
    return ds
