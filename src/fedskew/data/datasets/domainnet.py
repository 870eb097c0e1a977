"""``domainnet``: the 10-class DomainNet subset of FedPCL / MP-FedCL (Peng et al. 2019, "Moment Matching").

Source: http://ai.bu.edu/M3SDA/ (research use only). Layout ``<root>/domainnet/<domain>/<class>/*`` with the
official ``<domain>_train.txt`` / ``_test.txt`` lists in ``<root>/domainnet`` (they define the split when
present); classes outside the 10-class subset are ignored. No official checksums.
"""

from __future__ import annotations

from pathlib import Path

from fedskew.data.base import DATASETS, Dataset
from fedskew.data.datasets.domain_folders import DomainFolders, load_domains

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
DOMAINNET = DomainFolders(
    "domainnet", "domainnet", DOMAINNET_DOMAINS, DOMAINNET_CLASSES, "http://ai.bu.edu/M3SDA/"
)


@DATASETS.register("domainnet")
def domainnet(
    root: Path,
    *,
    domains: list[str] | None = None,
    size: int = 256,
    train_fraction: float = 0.8,
    split_seed: int = 0,
    cache: bool = True,
) -> Dataset:
    """DomainNet 10-class subset (MP-FedCL/FedPCL): 6 domains, RGB resized to 256x256.

    Layout ``<root>/domainnet/<domain>/<class>/*``; the official ``<domain>_train.txt``/``_test.txt`` lists
    in ``<root>/domainnet`` define the split when present. 256x256 follows FedPCL's code (MP-FedCL gives no
    size); pass a smaller ``size`` to save memory (6 domains at 256 px take several GB as uint8).
    """
    return load_domains(DOMAINNET, root, domains, size, train_fraction, split_seed, cache)
