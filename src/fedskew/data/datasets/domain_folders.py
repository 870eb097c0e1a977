"""Multi-domain image folders (``<base>/<domain>/<class>/*``), read through :mod:`.imagefolder`.

Shared by Office-Caltech-10 and DomainNet: each domain is an image folder with a fixed class list, split
by ``<domain>/{train,test}/`` folders, by DomainNet-style ``<domain>_train.txt`` / ``_test.txt`` lists, or
else by a seeded per-(domain, class) split. Images are resized to a square side, RGB, and normalised with
ImageNet statistics (the encoders these datasets feed are ImageNet-pretrained). Decoded images are cached
under the cache root (``image_cache`` of the dataset folder), never in the data root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedskew.data import files
from fedskew.data.arrays import stratified_split
from fedskew.data.base import Dataset
from fedskew.data.datasets.imagefolder import image_cache, image_dataset
from fedskew.data.images import list_images
from fedskew.errors import ConfigError, DataError, did_you_mean

# The frozen ResNet18 encoder used here is ImageNet-pretrained (docs/decisions.md, "MP-FedCL: pre-trained
# encoder"), so ImageNet statistics.
IMAGENET_NORM = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@dataclass(frozen=True)
class DomainFolders:
    """A multi-domain dataset: registry name, folder under the root, domains, classes, where to get it."""

    name: str
    folder: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    source: str

    @property
    def layout(self) -> str:
        return f"{self.folder}/<domain>/<class>/*.jpg for domains {', '.join(self.domains)}"


def _listed_split(base: Path, domain: str, classes: tuple[str, ...]) -> list[tuple[Path, int, bool]] | None:
    """DomainNet's official ``<domain>_train.txt`` / ``_test.txt`` lists (``clipart/bird/x.jpg 19``)."""
    lists = {True: base / f"{domain}_train.txt", False: base / f"{domain}_test.txt"}
    if not all(p.is_file() for p in lists.values()):
        return None
    index = {c: i for i, c in enumerate(classes)}
    out = []
    for is_train, path in lists.items():
        for line in path.read_text().splitlines():
            rel = line.split(" ")[0].strip()
            parts = Path(rel).parts
            if len(parts) >= 2 and parts[-2] in index:
                out.append((base / rel, index[parts[-2]], is_train))
    return out


def _domain_files(spec: DomainFolders, base: Path, domain: str) -> list[tuple[Path, int, bool | None]]:
    """(file, class, is_train or None when undecided) for one domain, from whichever layout is present."""
    listed = _listed_split(base, domain, spec.classes)
    if listed is not None:
        return list(listed)
    dfolder = base / domain
    explicit = (dfolder / "train").is_dir() and (dfolder / "test").is_dir()
    splits: list[tuple[Path, bool | None]] = (
        [(dfolder / "train", True), (dfolder / "test", False)] if explicit else [(dfolder, None)]
    )
    out: list[tuple[Path, int, bool | None]] = []
    for folder, is_train in splits:
        missing = [c for c in spec.classes if not (folder / c).is_dir()]
        if missing:
            raise DataError(
                f"dataset '{spec.name}': class folders {', '.join(missing)} missing in {folder}; expected "
                f"{base}/<domain>/<class>/*.jpg with classes {', '.join(spec.classes)}"
            )
        out += [(p, ci, is_train) for ci, c in enumerate(spec.classes) for p in list_images(folder / c)]
    return out


def _check_options(spec: DomainFolders, chosen: list[str], size: int, train_fraction: float) -> None:
    bad = [d for d in chosen if d not in spec.domains]
    if bad or not chosen:
        what = f"unknown domain '{bad[0]}'{did_you_mean(bad[0], spec.domains)}" if bad else "no domains"
        raise ConfigError(f"dataset '{spec.name}': {what}; valid: {', '.join(spec.domains)}")
    if not 0.0 < train_fraction < 1.0:
        raise ConfigError(f"dataset '{spec.name}': train_fraction must be in (0, 1), got {train_fraction}")
    if size < 1:
        raise ConfigError(f"dataset '{spec.name}': size must be a positive pixel count, got {size}")


def _collect(
    spec: DomainFolders, base: Path, chosen: list[str]
) -> tuple[list[Path], np.ndarray, np.ndarray, np.ndarray]:
    """(paths, labels, domain ids, split: 1 train / 0 test / -1 undecided) over the chosen domains."""
    paths: list[Path] = []
    labels, dom, split = [], [], []
    for di, d in enumerate(chosen):
        if not (base / d).is_dir() and _listed_split(base, d, spec.classes) is None:
            raise DataError(
                f"dataset '{spec.name}': domain folder {base / d} not found (expected {spec.layout}); "
                "set FEDSKEW_DATA or data.root to the folder that holds it"
            )
        entries = _domain_files(spec, base, d)
        paths += [e[0] for e in entries]
        labels += [e[1] for e in entries]
        dom += [di] * len(entries)
        split += [-1 if e[2] is None else int(e[2]) for e in entries]
    as_int = [np.asarray(v, dtype=np.int64) for v in (labels, dom, split)]
    return paths, as_int[0], as_int[1], as_int[2]


def load_domains(
    spec: DomainFolders,
    root: Path,
    domains: list[str] | None,
    size: int,
    train_fraction: float,
    split_seed: int,
    cache: bool = True,
) -> Dataset:
    """The chosen domains of ``spec`` as one :class:`Dataset` with per-sample domain tags."""
    chosen = list(spec.domains) if domains is None else list(domains)
    _check_options(spec, chosen, size, train_fraction)
    base = Path(root) / spec.folder
    files.require_folder(spec.name, base, spec.layout, spec.source)
    paths, y, d_ids, is_train = _collect(spec, base, chosen)
    undecided = is_train < 0
    if undecided.any():  # seeded per-(domain, class) split so every domain keeps its class balance
        groups = d_ids[undecided] * len(spec.classes) + y[undecided]
        is_train[undecided] = stratified_split(groups, train_fraction, split_seed)
    return image_dataset(
        spec.name,
        paths,
        y,
        is_train.astype(bool),
        list(spec.classes),
        size=size,
        mode="RGB",
        cache_dir=image_cache(base, cache),
        norm=IMAGENET_NORM,
        domains=d_ids,
        domain_names=chosen,
    )
