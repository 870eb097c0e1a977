"""Dataset loaders, one module per dataset (or family); importing this package registers them all.

Every loader is ``loader(root: Path, **options) -> Dataset`` registered in :data:`fedskew.data.base.DATASETS`
and returns ``uint8 [N, C, H, W]`` images, ``int64`` labels and the dataset's per-channel normalisation.
Each module holds its loader, its files and checksums (:data:`fedskew.data.files.FILES`), and names its
source and licence. Adding a dataset: one module here plus one import line below (README "Add a dataset").
"""

from fedskew.data.arrays import channel_stats, stratified_split
from fedskew.data.base import load_dataset
from fedskew.data.datasets import (  # noqa: F401  (each import registers its datasets)
    cifar,
    coop,
    digit_domains,
    domainnet,
    emnist,
    femnist,
    hf,
    imagefolder,
    mnist,
    office10,
    sklearn_digits,
    svhn,
)
from fedskew.data.datasets.cifar import CIFAR10_NAMES, CIFAR10_NORM, CIFAR100_NORM
from fedskew.data.datasets.domain_folders import IMAGENET_NORM
from fedskew.data.datasets.domainnet import DOMAINNET_CLASSES, DOMAINNET_DOMAINS
from fedskew.data.datasets.mnist import FASHION_NORM, MNIST_NORM
from fedskew.data.datasets.office10 import OFFICE10_CLASSES, OFFICE10_DOMAINS
from fedskew.data.datasets.sklearn_digits import digits
from fedskew.data.datasets.svhn import SVHN_NORM

__all__ = [
    "CIFAR10_NAMES",
    "CIFAR10_NORM",
    "CIFAR100_NORM",
    "DOMAINNET_CLASSES",
    "DOMAINNET_DOMAINS",
    "FASHION_NORM",
    "IMAGENET_NORM",
    "MNIST_NORM",
    "OFFICE10_CLASSES",
    "OFFICE10_DOMAINS",
    "SVHN_NORM",
    "channel_stats",
    "digits",
    "load_dataset",
    "stratified_split",
]
