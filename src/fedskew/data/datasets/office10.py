"""``office10``: Office-Caltech-10 (Gong et al. 2012, "Geodesic Flow Kernel"), 4 domains x 10 classes.

Source: the FedBN download (https://github.com/med-air/FedBN), which packs Office-31 (Saenko et al. 2010)
and Caltech-256 (Griffin et al. 2007) images of the 10 shared classes; research use only. Layout
``<root>/office_caltech_10/<domain>/<class>/*.jpg``; no official checksums (hand-assembled folders).
"""

from __future__ import annotations

from pathlib import Path

from fedskew.data.base import DATASETS, Dataset
from fedskew.data.datasets.domain_folders import DomainFolders, load_domains

# Class lists from the FedPCL code: MP-FedCL uses 10 classes (Table II) but does not list them.
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
OFFICE10 = DomainFolders(
    "office10",
    "office_caltech_10",
    OFFICE10_DOMAINS,
    OFFICE10_CLASSES,
    "https://github.com/med-air/FedBN (Office-Caltech-10 download)",
)


@DATASETS.register("office10")
def office10(
    root: Path,
    *,
    domains: list[str] | None = None,
    size: int = 64,
    train_fraction: float = 0.8,
    split_seed: int = 0,
    cache: bool = True,
) -> Dataset:
    """Office-Caltech-10: 4 domains (amazon, caltech, dslr, webcam) x 10 classes, RGB resized to 64x64.

    Layout ``<root>/office_caltech_10/<domain>/<class>/*.jpg`` (or ``<domain>/{train,test}/<class>/``);
    without explicit splits, a seeded per-(domain, class) split keeps ``train_fraction`` for training.
    64x64 follows FedPCL's code (MP-FedCL gives no size). ``cache`` keeps the decoded images in the
    cache (``$FEDSKEW_CACHE``), never in the data root.
    """
    return load_domains(OFFICE10, root, domains, size, train_fraction, split_seed, cache)
