"""Dataset loaders, registered in :data:`fedskew.data.base.DATASETS` (importing this module registers them).

Every loader is ``loader(root: Path, **options) -> Dataset`` and returns ``uint8 [N, C, H, W]`` images,
``int64`` labels and the dataset's usual per-channel normalisation. ``load_dataset`` is the public entry
point. File layouts and sources: ``docs/datasets.md``.
"""

from __future__ import annotations

import inspect
import os
import string
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedskew.data import files, formats
from fedskew.data.base import DATASETS, Dataset, resolve_root
from fedskew.errors import ConfigError, DataError, did_you_mean

# Standard per-channel statistics (in [0, 1] units) of the training sets, as used across the literature.
MNIST_NORM = ((0.1307,), (0.3081,))
FASHION_NORM = ((0.2860,), (0.3530,))
CIFAR10_NORM = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_NORM = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
SVHN_NORM = ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))
# Office / DomainNet feed an ImageNet-pretrained ResNet18 encoder (MP-FedCL spec §5.3): ImageNet statistics.
IMAGENET_NORM = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

DIGIT_NAMES = [str(d) for d in range(10)]
FASHION_NAMES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
EMNIST_BALANCED_NAMES = list(string.digits + string.ascii_uppercase + "abdefghnqrt")  # 47 classes
EMNIST_LETTERS_NAMES = list(string.ascii_lowercase)  # letters split merges cases: 26 classes
FEMNIST_NAMES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)  # LEAF order, 62
CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

# MP-FedCL spec §5.1 (class lists from the FedPCL code, which the spec recommends).
OFFICE10_DOMAINS = ("amazon", "caltech", "dslr", "webcam")
OFFICE10_CLASSES = (
    "back_pack",
    "bike",
    "calculator",
    "headphones",
    "keyboard",
    "laptop_computer",
    "monitor",
    "mouse",
    "mug",
    "projector",
)
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
DOMAINNET_CLASSES = (
    "bird",
    "feather",
    "headphones",
    "ice_cream",
    "teapot",
    "tiger",
    "whale",
    "windmill",
    "wine_glass",
    "zebra",
)


# ------------------------------------------------------------------------------------------------ helpers
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
        stds.append(round(float(var.sqrt()), 4))
    return tuple(means), tuple(stds)


def _check_labels(y: np.ndarray, num_classes: int, source: Path) -> None:
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(
            f"{source}: labels span {int(y.min())}..{int(y.max())}, expected 0..{num_classes - 1}; "
            "the file is corrupted or not this dataset"
        )


def _images(arr: np.ndarray) -> Tensor:
    """Owned, writable tensor (``frombuffer`` arrays are read-only views of the decompressed bytes)."""
    return torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True))


def _idx_split(folder: Path, images: str, labels: str, transpose: bool) -> tuple[Tensor, np.ndarray]:
    x = formats.read_idx(folder / images)
    y = formats.read_idx(folder / labels).astype(np.int64)
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(
            f"{folder / images} / {labels}: expected images [N, H, W] and N labels, "
            f"got {x.shape} and {y.shape}"
        )
    if transpose:  # EMNIST stores each image transposed (column-major); flip back to upright
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
    return _images(x[:, None]), y


def _idx_dataset(
    name: str,
    root: Path,
    prefix: str,
    num_classes: int,
    *,
    verify: bool,
    download: bool,
    transpose: bool = False,
    label_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    folder = files.ensure(name, root, verify_files=verify, download=download)
    out = []
    for part in ("train", "t10k") if not prefix else ("train", "test"):
        x, y = _idx_split(
            folder, f"{prefix}{part}-images-idx3-ubyte.gz", f"{prefix}{part}-labels-idx1-ubyte.gz", transpose
        )
        y = y - label_offset
        _check_labels(y, num_classes, folder / f"{prefix}{part}-labels-idx1-ubyte.gz")
        out += [x, torch.from_numpy(y)]
    return out[0], out[1], out[2], out[3]


# ------------------------------------------------------------------------------------------------ loaders
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


@DATASETS.register("mnist")
def mnist(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """MNIST handwritten digits, 28x28 grayscale, 10 classes, 60k/10k (gzipped IDX under <root>/mnist)."""
    xtr, ytr, xte, yte = _idx_dataset("mnist", Path(root), "", 10, verify=verify, download=download)
    return Dataset("mnist", xtr, ytr, xte, yte, 10, *MNIST_NORM, classes=list(DIGIT_NAMES))


@DATASETS.register("fashion_mnist")
def fashion_mnist(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """Fashion-MNIST clothing, 28x28 grayscale, 10 classes, 60k/10k (gzipped IDX in <root>/fashion-mnist)."""
    xtr, ytr, xte, yte = _idx_dataset("fashion_mnist", Path(root), "", 10, verify=verify, download=download)
    return Dataset("fashion_mnist", xtr, ytr, xte, yte, 10, *FASHION_NORM, classes=list(FASHION_NAMES))


@DATASETS.register("emnist_balanced")
def emnist_balanced(
    root: Path, *, letters_only: bool = False, verify: bool = True, download: bool = True
) -> Dataset:
    """EMNIST Balanced, 28x28 grayscale, 47 classes, 112,800/18,800 (<root>/emnist, orientation fixed).

    ``letters_only`` keeps the 37 letter classes (labels 10..46 -> 0..36): FedEnt's "EMNIST-L"
    (37 x 2,400 / 400, FedEnt spec A13).
    """
    xtr, ytr, xte, yte = _idx_dataset(
        "emnist_balanced",
        Path(root),
        "emnist-balanced-",
        47,
        verify=verify,
        download=download,
        transpose=True,
    )
    classes = list(EMNIST_BALANCED_NAMES)
    if letters_only:
        keep_tr, keep_te = ytr >= 10, yte >= 10
        xtr, ytr, xte, yte = xtr[keep_tr], ytr[keep_tr] - 10, xte[keep_te], yte[keep_te] - 10
        classes = classes[10:]
    mean, std = channel_stats(xtr)  # no agreed constants for EMNIST: exact training-set statistics
    meta = {"subset": "letters"} if letters_only else {}
    return Dataset(
        "emnist_balanced", xtr, ytr, xte, yte, len(classes), mean=mean, std=std, classes=classes, meta=meta
    )


@DATASETS.register("emnist_letters")
def emnist_letters(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """EMNIST Letters, 28x28 grayscale, 26 classes (1..26 -> 0..25), 124,800/20,800 (<root>/emnist)."""
    xtr, ytr, xte, yte = _idx_dataset(
        "emnist_letters",
        Path(root),
        "emnist-letters-",
        26,
        verify=verify,
        download=download,
        transpose=True,
        label_offset=1,
    )
    mean, std = channel_stats(xtr)
    return Dataset(
        "emnist_letters", xtr, ytr, xte, yte, 26, mean=mean, std=std, classes=list(EMNIST_LETTERS_NAMES)
    )


@DATASETS.register("femnist")
def femnist(root: Path) -> Dataset:
    """FEMNIST (LEAF json under <root>/femnist/{train,test}), 28x28, 62 classes, writer id per sample in meta.

    LEAF stores ``x`` as 784 floats in [0, 1] (white background = 1.0, as in NIST SD19); kept as is.
    ``meta["writer_train"]`` / ``meta["writer_test"]`` index ``meta["writer_names"]`` (shared id space).
    """
    base = Path(root) / "femnist"
    for part in ("train", "test"):
        if not (base / part).is_dir() or not any((base / part).glob("*.json")):
            raise DataError(
                f"dataset 'femnist': no LEAF json files (train/*.json, test/*.json) in {base}; generate them "
                "with LEAF's data/femnist/preprocess.sh (https://github.com/TalwalkarLab/leaf), "
                "or set FEDSKEW_DATA or data.root to the folder that holds femnist/"
            )
    parts = {}
    for part in ("train", "test"):
        x, y, names, widx = formats.read_leaf(base / part)
        if x.shape[1] != 28 * 28:
            raise DataError(f"{base / part}: LEAF samples have {x.shape[1]} values, expected 784 (28x28)")
        _check_labels(y, 62, base / part)
        parts[part] = (x, y, names, widx)
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


@DATASETS.register("cifar10")
def cifar10(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """CIFAR-10, 32x32 RGB, 10 classes, 50k/10k (python pickle batches in <root>/cifar-10-batches-py)."""
    folder = files.ensure("cifar10", Path(root), verify_files=verify, download=download)
    parts = [formats.read_cifar_batch(folder / f"data_batch_{i}", "labels") for i in range(1, 6)]
    xtr, ytr = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    xte, yte = formats.read_cifar_batch(folder / "test_batch", "labels")
    _check_labels(ytr, 10, folder / "data_batch_*")
    _check_labels(yte, 10, folder / "test_batch")
    return Dataset(
        "cifar10",
        torch.from_numpy(xtr),
        torch.from_numpy(ytr),
        torch.from_numpy(xte),
        torch.from_numpy(yte),
        10,
        *CIFAR10_NORM,
        classes=formats.read_pickle_names(folder / "batches.meta", "label_names") or CIFAR10_NAMES,
    )


@DATASETS.register("cifar100")
def cifar100(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """CIFAR-100, 32x32 RGB, 100 fine classes, 50k/10k (python pickles in <root>/cifar-100-python)."""
    folder = files.ensure("cifar100", Path(root), verify_files=verify, download=download)
    xtr, ytr = formats.read_cifar_batch(folder / "train", "fine_labels")
    xte, yte = formats.read_cifar_batch(folder / "test", "fine_labels")
    _check_labels(ytr, 100, folder / "train")
    _check_labels(yte, 100, folder / "test")
    return Dataset(
        "cifar100",
        torch.from_numpy(xtr),
        torch.from_numpy(ytr),
        torch.from_numpy(xte),
        torch.from_numpy(yte),
        100,
        *CIFAR100_NORM,
        classes=formats.read_pickle_names(folder / "meta", "fine_label_names"),
    )


@DATASETS.register("svhn")
def svhn(root: Path, *, verify: bool = True, download: bool = True) -> Dataset:
    """SVHN house numbers, 32x32 RGB, 10 classes, 73,257/26,032 (<root>/svhn/{train,test}_32x32.mat)."""
    folder = files.ensure("svhn", Path(root), verify_files=verify, download=download)
    xtr, ytr = formats.read_svhn_mat(folder / "train_32x32.mat")
    xte, yte = formats.read_svhn_mat(folder / "test_32x32.mat")
    _check_labels(ytr, 10, folder / "train_32x32.mat")
    _check_labels(yte, 10, folder / "test_32x32.mat")
    return Dataset(
        "svhn",
        torch.from_numpy(xtr),
        torch.from_numpy(ytr),
        torch.from_numpy(xte),
        torch.from_numpy(yte),
        10,
        *SVHN_NORM,
        classes=list(DIGIT_NAMES),
    )


# ------------------------------------------------------------------------------------- domain image folders
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


def _domain_files(
    name: str, base: Path, domain: str, classes: tuple[str, ...]
) -> list[tuple[Path, int, bool | None]]:
    """(file, class, is_train or None when undecided) for one domain, from whichever layout is present."""
    dfolder = base / domain
    listed = _listed_split(base, domain, classes)
    if listed is not None:
        return list(listed)
    explicit = (dfolder / "train").is_dir() and (dfolder / "test").is_dir()
    splits: list[tuple[Path, bool | None]] = (
        [(dfolder / "train", True), (dfolder / "test", False)] if explicit else [(dfolder, None)]
    )
    out: list[tuple[Path, int, bool | None]] = []
    for folder, is_train in splits:
        missing = [c for c in classes if not (folder / c).is_dir()]
        if missing:
            raise DataError(
                f"dataset '{name}': class folders {', '.join(missing)} missing in {folder}; expected "
                f"{base}/<domain>/<class>/*.jpg with classes {', '.join(classes)}"
            )
        out += [(p, ci, is_train) for ci, c in enumerate(classes) for p in formats.list_images(folder / c)]
    return out


def _domain_dataset(
    name: str,
    root: Path,
    folder: str,
    all_domains: tuple[str, ...],
    classes: tuple[str, ...],
    domains: list[str] | None,
    size: int,
    train_fraction: float,
    split_seed: int,
    source: str,
) -> Dataset:
    chosen = list(all_domains) if domains is None else list(domains)
    bad = [d for d in chosen if d not in all_domains]
    if bad or not chosen:
        what = f"unknown domain '{bad[0]}'{did_you_mean(bad[0], all_domains)}" if bad else "no domains"
        raise ConfigError(f"dataset '{name}': {what}; valid: {', '.join(all_domains)}")
    if not 0.0 < train_fraction < 1.0:
        raise ConfigError(f"dataset '{name}': train_fraction must be in (0, 1), got {train_fraction}")
    if size < 1:
        raise ConfigError(f"dataset '{name}': size must be a positive pixel count, got {size}")
    base = Path(root) / folder
    layout = f"{folder}/<domain>/<class>/*.jpg for domains {', '.join(all_domains)}"
    files.require_folder(name, base, layout, source)
    paths: list[Path] = []
    labels, dom, split = [], [], []
    for di, d in enumerate(chosen):
        if not (base / d).is_dir() and _listed_split(base, d, classes) is None:
            raise DataError(
                f"dataset '{name}': domain folder {base / d} not found (expected {layout}); "
                "set FEDSKEW_DATA or data.root to the folder that holds it"
            )
        entries = _domain_files(name, base, d, classes)
        paths += [e[0] for e in entries]
        labels += [e[1] for e in entries]
        dom += [di] * len(entries)
        split += [-1 if e[2] is None else int(e[2]) for e in entries]
    y = np.asarray(labels, dtype=np.int64)
    d_ids = np.asarray(dom, dtype=np.int64)
    is_train = np.asarray(split, dtype=np.int64)
    undecided = is_train < 0
    if undecided.any():  # seeded per-(domain, class) split so every domain keeps its class balance
        groups = d_ids[undecided] * len(classes) + y[undecided]
        is_train[undecided] = stratified_split(groups, train_fraction, split_seed)
    train = is_train.astype(bool)
    if not train.any() or train.all():
        raise DataError(
            f"dataset '{name}': found {len(paths)} images under {base}; need both train and test images"
        )
    x = torch.from_numpy(formats.read_images(paths, size))
    tr, te = torch.from_numpy(np.flatnonzero(train)), torch.from_numpy(np.flatnonzero(~train))
    yt, dt = torch.from_numpy(y), torch.from_numpy(d_ids)
    return Dataset(
        name,
        x[tr],
        yt[tr],
        x[te],
        yt[te],
        len(classes),
        *IMAGENET_NORM,
        classes=list(classes),
        domain_train=dt[tr],
        domain_test=dt[te],
        domain_names=chosen,
    )


@DATASETS.register("office10")
def office10(
    root: Path,
    *,
    domains: list[str] | None = None,
    size: int = 64,
    train_fraction: float = 0.8,
    split_seed: int = 0,
) -> Dataset:
    """Office-Caltech-10: 4 domains (amazon, caltech, dslr, webcam) x 10 classes, RGB resized to 64x64.

    Layout ``<root>/office_caltech_10/<domain>/<class>/*.jpg`` (or ``<domain>/{train,test}/<class>/``);
    without explicit splits, a seeded per-(domain, class) split keeps ``train_fraction`` for training.
    64x64 follows the MP-FedCL spec §5.2.
    """
    return _domain_dataset(
        "office10",
        root,
        "office_caltech_10",
        OFFICE10_DOMAINS,
        OFFICE10_CLASSES,
        domains,
        size,
        train_fraction,
        split_seed,
        "https://github.com/med-air/FedBN (Office-Caltech-10 download)",
    )


@DATASETS.register("domainnet")
def domainnet(
    root: Path,
    *,
    domains: list[str] | None = None,
    size: int = 256,
    train_fraction: float = 0.8,
    split_seed: int = 0,
) -> Dataset:
    """DomainNet 10-class subset (MP-FedCL/FedPCL): 6 domains, RGB resized to 256x256.

    Layout ``<root>/domainnet/<domain>/<class>/*``; the official ``<domain>_train.txt``/``_test.txt`` lists
    in ``<root>/domainnet`` define the split when present. 256x256 follows MP-FedCL spec §5.2; pass a
    smaller ``size`` to save memory (6 domains at 256 px take several GB as uint8).
    """
    return _domain_dataset(
        "domainnet",
        root,
        "domainnet",
        DOMAINNET_DOMAINS,
        DOMAINNET_CLASSES,
        domains,
        size,
        train_fraction,
        split_seed,
        "http://ai.bu.edu/M3SDA/",
    )


# ------------------------------------------------------------------------------------------ public entry
def load_dataset(name: str, root: str | os.PathLike | None = None, **options: Any) -> Dataset:
    """Load a registered dataset by name from the data root (``root`` > ``$FEDSKEW_DATA`` > default).

    Unknown names raise ``ConfigError`` listing the valid ones; unknown options list the allowed options.
    """
    loader = DATASETS.get(name)
    params = list(inspect.signature(loader).parameters.values())[1:]
    allowed = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for key in options:
        if key not in allowed:
            raise ConfigError(
                f"dataset '{name}': unknown option '{key}'{did_you_mean(key, allowed)}; "
                f"allowed: {', '.join(allowed) or '(none)'}"
            )
    return loader(resolve_root(root), **options)
