"""Data layer: dataset loaders, offline builders, partitioners and per-client views.

Importing this package registers every dataset and partition scheme.
"""

from fedskew.data import datasets, digit_domains, partition  # noqa: F401  (registers)
from fedskew.data.base import DATASETS, PARTITIONERS, Dataset, resolve_root
from fedskew.data.datasets import load_dataset
from fedskew.data.federated import FederatedData, build_federated

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "Dataset",
    "FederatedData",
    "build_federated",
    "load_dataset",
    "resolve_root",
]
