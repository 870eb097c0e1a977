"""The 11 few-shot datasets of CoOp (Zhou et al. 2022, "Learning to Prompt for Vision-Language Models", IJCV;
https://github.com/KaiyangZhou/CoOp, ``DATASETS.md``) in CoOp's folder layouts under the data root.

CacheFL (Yi et al. 2025, Section 4.1) and Tip-Adapter evaluate on these sets with 16 shots per class. Nine
ship a fixed CoOp split file ``split_zhou_<Name>.json`` (``{"train"|"val"|"test": [[relpath, label,
classname], ...]}``, paths relative to the image folder; read by
:func:`~fedskew.data.datasets.imagefolder.split_file_listing`); FGVCAircraft uses its own
``images_variant_{train,val,test}.txt`` lists; ImageNet is ``images/{train,val}/<wnid>/`` with
``classnames.txt`` and, as in CoOp and Tip-Adapter, its official ``val`` set is the test set (no separate
validation split: ``data.val_shots`` then holds out seeded training images outside the shots).

Every loader takes ``size`` (square side, default 224: CLIP RN50's input), ``mode`` (default ``RGB``),
``cache`` and ``resize`` as ``imagefolder``; ``resize`` defaults to ``shortest`` (CLIP's preprocessing:
bicubic resize of the shortest side, centre crop). ``val_split`` (not for ImageNet): ``coop`` (default)
keeps CoOp's ``val`` split as the dataset's validation pool (:attr:`~fedskew.data.base.Dataset.val_pool`:
never partitioned, ``data.val_shots`` draws from it, never from the shots or the test split); ``none``
drops it.

Memory: a decoded image takes ``3·size²`` bytes (150,528 at 224 px) and decoding holds two copies at the
peak, so a whole ImageNet training split (1.28 M images) cannot be decoded. ``shots_per_class=K`` (with
``val_per_class=V``, ``subset_seed=S``) decodes only the rows that ``build_federated(shots=K, val_shots=V,
seed=S)`` uses (:func:`~fedskew.data.federated.few_shot_rows`) plus the test split, its validation draw as
the decoded set's validation pool (ImageNet's too); the clients are then the same as with the whole split
decoded, and ``build_federated`` refuses other ``shots`` / ``val_shots`` / ``seed`` values
(:class:`~fedskew.data.base.FewShotSubset`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedskew.data.base import DATASETS, Dataset, FewShotSubset
from fedskew.data.datasets.imagefolder import (
    PARTS,
    TEST,
    TRAIN,
    VAL,
    Listing,
    ValSplit,
    check_listed,
    class_folders,
    image_cache,
    listing_dataset,
    split_file_listing,
)
from fedskew.data.federated import few_shot_rows
from fedskew.data.images import check_mode, check_resize, check_size, list_images
from fedskew.errors import ConfigError, DataError

#: CoOp's DATASETS.md, where each layout and its split file come from
SOURCE = "https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"


@dataclass(frozen=True)
class SplitLayout:
    """A CoOp dataset with a split file: ``<root>/<folder>/<images>/`` holds the images (the split file's
    paths start there) and ``<root>/<folder>/<split>`` the split file."""

    title: str
    folder: str
    images: str
    split: str

    def describe(self) -> str:
        images = f"{self.folder}/{self.images}/" if self.images else f"{self.folder}/ (its image folders)"
        return f"<data root>/{images} and <data root>/{self.folder}/{self.split} (CoOp's layout, {SOURCE})"


#: the nine CoOp datasets read through a ``split_zhou_*.json`` (folder names as in CoOp's DATASETS.md)
SPLIT_LAYOUTS: dict[str, SplitLayout] = {
    "caltech101": SplitLayout(
        "Caltech101", "caltech-101", "101_ObjectCategories", "split_zhou_Caltech101.json"
    ),
    "oxford_pets": SplitLayout("OxfordPets", "oxford_pets", "images", "split_zhou_OxfordPets.json"),
    "stanford_cars": SplitLayout("StanfordCars", "stanford_cars", "", "split_zhou_StanfordCars.json"),
    "oxford_flowers": SplitLayout("Flowers102", "oxford_flowers", "jpg", "split_zhou_OxfordFlowers.json"),
    "food101": SplitLayout("Food101", "food-101", "images", "split_zhou_Food101.json"),
    "sun397": SplitLayout("SUN397", "sun397", "SUN397", "split_zhou_SUN397.json"),
    "dtd": SplitLayout("DTD", "dtd", "images", "split_zhou_DescribableTextures.json"),
    "eurosat": SplitLayout("EuroSAT", "eurosat", "2750", "split_zhou_EuroSAT.json"),
    "ucf101": SplitLayout("UCF101", "ucf101", "UCF-101-midframes", "split_zhou_UCF101.json"),
}
AIRCRAFT_LAYOUT = (
    "<data root>/fgvc_aircraft/images/<id>.jpg, variants.txt and images_variant_{train,val,test}.txt "
    f"(the data/ folder of fgvc-aircraft-2013b, renamed; CoOp's layout, {SOURCE})"
)
IMAGENET_LAYOUT = (
    "<data root>/imagenet/images/{train,val}/<wnid>/*.JPEG and <data root>/imagenet/classnames.txt "
    f"('<wnid> <class name>' per line; CoOp's layout, {SOURCE})"
)


def read_lines(file: Path, dataset: str, layout: str) -> list[str]:
    """The non-blank lines of a text file (stripped); ``DataError`` naming it and the layout if absent."""
    if not file.is_file():
        raise DataError(f"dataset '{dataset}': {file} not found; expected {layout}")
    return [line.strip() for line in file.read_text().splitlines() if line.strip()]


def id_and_name(lines: list[str], file: Path, dataset: str) -> tuple[list[str], list[str]]:
    """``"<id> <name with spaces>"`` lines -> (ids, names); ``DataError`` on a line without a name."""
    pairs = [line.split(" ", 1) for line in lines]
    bad = [line for line, pair in zip(lines, pairs, strict=True) if len(pair) != 2]
    if bad:
        raise DataError(f"dataset '{dataset}': {file}: line {bad[0]!r} is not '<id> <name>'")
    return [p[0] for p in pairs], [p[1].strip() for p in pairs]


def few_shot_listing(listing: Listing, shots: int, val_shots: int | None, seed: int) -> Listing:
    """Only the training images :func:`~fedskew.data.federated.build_federated` uses with ``shots``,
    ``val_shots`` and ``seed`` (the validation draw marked ``val``: the decoded set's validation pool, also
    where the full set has none, e.g. ImageNet), plus every test image."""
    trainable = np.flatnonzero(listing.part != TEST)
    is_val = listing.part[trainable] == VAL
    pool = torch.from_numpy(is_val) if is_val.any() else None
    shot_rows, val_rows = few_shot_rows(
        listing.labels[trainable], pool, len(listing.classes), seed, shots, val_shots
    )
    part = listing.part.copy()
    part[trainable] = TRAIN
    part[trainable[val_rows]] = VAL
    keep = np.concatenate([trainable[shot_rows], trainable[val_rows], np.flatnonzero(listing.part == TEST)])
    return Listing(listing.paths, listing.labels, part, listing.classes).take(np.sort(keep))


def coop_dataset(
    name: str,
    base: Path,
    listing: Listing,
    *,
    size: int | None,
    mode: str | None,
    cache: bool,
    resize: str,
    shots_per_class: int | None,
    val_per_class: int | None,
    subset_seed: int,
) -> Dataset:
    """Decode ``listing`` (only its few-shot draw with ``shots_per_class``) into a :class:`Dataset`."""
    check_mode(mode, name)
    check_size(size, name)
    check_resize(resize, size, name)
    subset = None
    if shots_per_class is not None:
        subset = FewShotSubset(shots_per_class, val_per_class, subset_seed)
        listing = few_shot_listing(listing, shots_per_class, val_per_class, subset_seed)
    elif val_per_class is not None:
        raise ConfigError(
            f"dataset '{name}': val_per_class needs shots_per_class (the few-shot draw to decode)"
        )
    cache_dir = image_cache(base, cache)
    ds = listing_dataset(
        name, listing, size=size, mode=mode, cache_dir=cache_dir, subset=subset, resize=resize
    )
    ds.meta["path"] = str(base)
    return ds


def _drop_val(listing: Listing, val_split: ValSplit) -> Listing:
    """``val`` images kept as the validation pool (``coop``) or dropped (``none``)."""
    return listing if val_split == "coop" else listing.take(np.flatnonzero(listing.part != VAL))


def coop_loader(
    name: str, folder: str, listing_of: Callable[[Path], Listing], doc: str
) -> Callable[..., Dataset]:
    """The registered loader of a CoOp dataset with a validation split: ``listing_of(<root>/<folder>)`` lists
    its images, decoded by :func:`coop_dataset` with the options every such dataset shares."""

    def load(
        root: Path,
        *,
        size: int | None = 224,
        mode: str | None = "RGB",
        val_split: ValSplit = "coop",
        cache: bool = True,
        resize: str = "shortest",
        shots_per_class: int | None = None,
        val_per_class: int | None = None,
        subset_seed: int = 0,
    ) -> Dataset:
        base = Path(root) / folder
        return coop_dataset(
            name,
            base,
            _drop_val(listing_of(base), val_split),
            size=size,
            mode=mode,
            cache=cache,
            resize=resize,
            shots_per_class=shots_per_class,
            val_per_class=val_per_class,
            subset_seed=subset_seed,
        )

    load.__name__ = load.__qualname__ = name
    load.__doc__ = doc
    return load


def split_loader(name: str, layout: SplitLayout) -> Callable[..., Dataset]:
    """The registered loader of one :data:`SPLIT_LAYOUTS` dataset."""

    def listing_of(base: Path) -> Listing:
        images = base / layout.images if layout.images else base
        return split_file_listing(images, base / layout.split, name, layout.describe(), val=True)

    images = f"{layout.folder}/{layout.images}" if layout.images else layout.folder
    doc = (
        f"{layout.title} with CoOp's train / val / test split: <root>/{images}/ + {layout.split}.\n\n"
        f"Layout: {layout.describe()}. Options: size, mode, resize, val_split (coop: the val split is the "
        "validation pool; none), cache, shots_per_class / val_per_class / subset_seed (decode only one "
        "few-shot draw; module doc)."
    )
    return coop_loader(name, layout.folder, listing_of, doc)


for _name, _layout in SPLIT_LAYOUTS.items():
    DATASETS.register(_name)(split_loader(_name, _layout))


def aircraft_listing(base: Path) -> Listing:
    """FGVCAircraft's variant lists: classes in ``variants.txt`` order, ``<id> <variant>`` per image."""
    name = "fgvc_aircraft"
    classes = read_lines(base / "variants.txt", name, AIRCRAFT_LAYOUT)
    index = {c: i for i, c in enumerate(classes)}
    paths: list[Path] = []
    labels: list[int] = []
    part: list[int] = []
    for code, split in enumerate(PARTS):  # three list files, not a loop over samples
        file = base / f"images_variant_{split}.txt"
        ids, names = id_and_name(read_lines(file, name, AIRCRAFT_LAYOUT), file, name)
        unknown = sorted(set(names) - set(index))
        if unknown:
            raise DataError(f"dataset '{name}': {file} names variant {unknown[0]!r}, not in variants.txt")
        found = [base / "images" / f"{i}.jpg" for i in ids]
        check_listed(name, found, file, base / "images", AIRCRAFT_LAYOUT)
        paths += found
        labels += [index[n] for n in names]
        part += [code] * len(ids)
    return Listing(paths, np.asarray(labels, dtype=np.int64), np.asarray(part, dtype=np.int64), classes)


DATASETS.register("fgvc_aircraft")(
    coop_loader(
        "fgvc_aircraft",
        "fgvc_aircraft",
        aircraft_listing,
        "FGVCAircraft (100 variants) with its official train / val / test lists: "
        "<data root>/fgvc_aircraft/.\n\n"
        "Options as the other CoOp datasets (module doc); the layout is ``AIRCRAFT_LAYOUT``.",
    )
)


def imagenet_listing(base: Path) -> Listing:
    """ImageNet's ``train`` (training) and ``val`` (test) class folders; labels by sorted wnid (as CoOp),
    class names from ``classnames.txt``."""
    name = "imagenet"
    file = base / "classnames.txt"
    wnids, names = id_and_name(read_lines(file, name, IMAGENET_LAYOUT), file, name)
    named = dict(zip(wnids, names, strict=True))
    folders = {split: base / "images" / split for split in ("train", "val")}
    for folder in folders.values():
        if not folder.is_dir():
            raise DataError(f"dataset '{name}': folder {folder} not found; expected {IMAGENET_LAYOUT}")
    classes = class_folders(folders["train"])
    stray = sorted(set(class_folders(folders["val"])) - set(classes))
    unnamed = [w for w in classes if w not in named]
    problems = [f"no class folders in {folders['train']}"] * (not classes)
    problems += [f"val class {w} has no train folder" for w in stray[:1]]
    problems += [f"{file} does not name class {w}" for w in unnamed[:1]]
    if problems:
        raise DataError(f"dataset '{name}': {problems[0]}; expected {IMAGENET_LAYOUT}")
    paths: list[Path] = []
    labels: list[int] = []
    part: list[int] = []
    for code, split in ((TRAIN, "train"), (TEST, "val")):
        for label, wnid in enumerate(classes):  # per class folder, not per sample
            folder = folders[split] / wnid
            found = list_images(folder) if folder.is_dir() else []
            paths += found
            labels += [label] * len(found)
            part += [code] * len(found)
    labels_arr, part_arr = np.asarray(labels, dtype=np.int64), np.asarray(part, dtype=np.int64)
    return Listing(paths, labels_arr, part_arr, [named[w] for w in classes])


@DATASETS.register("imagenet")
def imagenet(
    root: Path,
    *,
    size: int | None = 224,
    mode: str | None = "RGB",
    cache: bool = True,
    resize: str = "shortest",
    shots_per_class: int | None = None,
    val_per_class: int | None = None,
    subset_seed: int = 0,
) -> Dataset:
    """ImageNet-1k in CoOp's layout (<data root>/imagenet/): the official val set is the test set.

    There is no validation split: ``data.val_shots`` holds out seeded training images outside the shots.
    Decode only one few-shot draw with ``shots_per_class`` (+ ``val_per_class``, ``subset_seed``): the
    whole training split (1.28 M images) needs ~190 GB at 224 px (module doc).
    """
    base = Path(root) / "imagenet"
    return coop_dataset(
        "imagenet",
        base,
        imagenet_listing(base),
        size=size,
        mode=mode,
        cache=cache,
        resize=resize,
        shots_per_class=shots_per_class,
        val_per_class=val_per_class,
        subset_seed=subset_seed,
    )
