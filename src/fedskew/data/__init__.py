"""Data layer: dataset loaders, offline builders, partitioners and per-client views.

Importing this package registers every dataset (:mod:`fedskew.data.datasets`, one module per dataset) and
every partition scheme (:mod:`fedskew.data.partition`, one module per family).
"""

from fedskew.data import datasets, partition  # noqa: F401  (registers)
from fedskew.data.base import DATASETS, PARTITIONERS, Dataset, load_dataset, resolve_root
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
