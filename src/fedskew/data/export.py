"""Hand a fedskew partition to other tools: per-client index lists as JSON.

The lists index the dataset's training / test splits in their stored order, so for a dataset loaded with
``data.dataset: hf`` they select the same rows of the Hugging Face splits: ``hf_train.select(train[i])`` is
client i's training set (Flower users can wrap this in an ``flwr_datasets`` partitioner, docs/datasets.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from fedskew.data.federated import FederatedData


def partition_indices(fd: FederatedData) -> dict[str, Any]:
    """Client index lists and provenance: ``{"clients": [{"train": [...], "val": [...], "test": [...]}]}``.

    ``train`` / ``val`` index the training split, ``test`` the test split (the client's personalized test
    set); ``partition``, ``seed`` and ``num_clients`` record how they were drawn.
    """
    val: Sequence[Tensor | None] = fd.val_idx or [None] * fd.num_clients
    clients = [
        {"train": t.tolist(), "val": [] if v is None else v.tolist(), "test": s.tolist()}
        for t, v, s in zip(fd.train_idx, val, fd.test_idx, strict=True)
    ]
    return {
        "dataset": fd.dataset.name,
        "num_clients": fd.num_clients,
        "partition": dict(fd.partition),
        "seed": fd.seed,
        "num_train": int(fd.dataset.y_train.shape[0]),
        "num_test": int(fd.dataset.y_test.shape[0]),
        "clients": clients,
    }


def write_partition_indices(fd: FederatedData, path: str | os.PathLike) -> Path:
    """Write :func:`partition_indices` as JSON to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(partition_indices(fd)))
    return path


def read_partition_indices(path: str | os.PathLike) -> dict[str, Any]:
    """Read a file written by :func:`write_partition_indices`."""
    return json.loads(Path(path).read_text())
