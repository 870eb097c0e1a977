"""EMNIST (Cohen, Afshar, Tapson & van Schaik 2017): ``emnist_balanced`` and ``emnist_letters`` (IDX files).

Source: https://www.nist.gov/itl/products-and-services/emnist-dataset (NIST, public domain in the US). The
official ``gzip.zip`` archive is downloaded, checked against its MD5 and only the needed members extracted
into ``<root>/emnist``; NIST publishes no per-file checksums, so the members are checked by parsing.
"""

from __future__ import annotations

import string
from pathlib import Path

from fedskew.data import files
from fedskew.data.arrays import channel_stats
from fedskew.data.base import DATASETS, Dataset
from fedskew.data.datasets.mnist import idx_dataset
from fedskew.data.files import Archive, DatasetFiles, FileSpec

EMNIST_BALANCED_NAMES = list(string.digits + string.ascii_uppercase + "abdefghnqrt")  # 47 classes
EMNIST_LETTERS_NAMES = list(string.ascii_lowercase)  # letters split merges cases: 26 classes
_ARCHIVE = Archive(
    "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
    "md5:58c8d27c78d21e728a6bc7b3cc06412e",
    strip="gzip/",
    into="emnist",
)


def _files(split: str) -> DatasetFiles:
    names = [
        f"emnist-{split}-{p}-{k}"
        for p in ("train", "test")
        for k in ("images-idx3-ubyte.gz", "labels-idx1-ubyte.gz")
    ]
    return DatasetFiles(
        "emnist",
        tuple(FileSpec(f"emnist/{n}") for n in names),
        "https://www.nist.gov/itl/products-and-services/emnist-dataset",
        _ARCHIVE,
    )


files.FILES["emnist_balanced"] = _files("balanced")
files.FILES["emnist_letters"] = _files("letters")


@DATASETS.register("emnist_balanced")
def emnist_balanced(
    root: Path, *, letters_only: bool = False, verify: bool = True, download: bool = True
) -> Dataset:
    """EMNIST Balanced, 28x28 grayscale, 47 classes, 112,800/18,800 (<root>/emnist, orientation fixed).

    ``letters_only`` keeps the 37 letter classes (labels 10..46 -> 0..36): FedEnt's "EMNIST-L"
    (37 x 2,400 / 400, the counts of FedEnt §6.1.1; docs/methods/fedent.md, "FedEnt: EMNIST-L").
    """
    xtr, ytr, xte, yte = idx_dataset(
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
    xtr, ytr, xte, yte = idx_dataset(
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
