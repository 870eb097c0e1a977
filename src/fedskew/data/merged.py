"""A federation over the merged train+test pool, each client's test set cut from its own samples (PFLlib).

PFLlib's benchmark (TsingZ0/PFLlib ``dataset/generate_FashionMNIST.py``, ``dataset/utils/dataset_utils.py``)
merges the dataset's train and test images, partitions the pool, and gives each client ``floor(0.75·n)`` of
its own samples to train on and the rest as its test set. :func:`build_merged` builds that federation as a
:class:`~fedskew.data.federated.FederatedData`: the new dataset's training split holds the clients' training
samples, its test split the clients' test sets one after another (client 0's first). So the ``global``
protocol scores the union of the clients' test sets, which is PFLlib's accuracy of a global model (correct
over all test samples), and ``personalized`` scores each client on its own test set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedskew.data.base import Dataset
from fedskew.data.federated import FederatedData
from fedskew.data.partition import child_seed, merged_client_split, validation_split
from fedskew.errors import ConfigError

#: the validation draw's sub-seed tag, as in build_federated
_VAL_TAG = 102


def _cat(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return None if a is None or b is None else torch.cat([a, b])


def _rows(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _merged_dataset(
    ds: Dataset, train_rows: np.ndarray, test_rows: np.ndarray, train_share: float
) -> Dataset:
    """``ds`` with its splits replaced by the given rows of the merged pool (train rows, then test rows)."""
    x = torch.cat([ds.x_train, ds.x_test])
    y = torch.cat([ds.y_train, ds.y_test])
    dom = _cat(ds.domain_train, ds.domain_test)
    tr, te = torch.from_numpy(train_rows), torch.from_numpy(test_rows)
    return dataclasses.replace(
        ds,
        x_train=x[tr],
        y_train=y[tr],
        x_test=x[te],
        y_test=y[te],
        domain_train=None if dom is None else dom[tr],
        domain_test=None if dom is None else dom[te],
        meta={**ds.meta, "split": {"merged": True, "train_share": train_share}},
    )


def build_merged(
    dataset: Dataset,
    num_clients: int,
    partition: Mapping[str, Any],
    seed: int,
    *,
    train_share: float = 0.75,
    val_fraction: float = 0.0,
) -> FederatedData:
    """Partition ``dataset``'s train+test pool with ``partition`` and cut every client ``train_share`` /
    rest (:func:`~fedskew.data.partition.merged_client_split`: PFLlib's draws for ``pfllib_pat`` /
    ``pfllib_dir``); then ``val_fraction`` of each client's training samples is held out for validation,
    from the training share only, so the test sets stay PFLlib's. Test sets are disjoint from every
    training and validation set and from each other. A client left without a training sample (fewer than
    ``1 / train_share`` samples) is a :class:`~fedskew.errors.DataError`."""
    if num_clients < 1:
        raise ConfigError(f"config key 'data.num_clients' must be >= 1, got {num_clients}")
    if dataset.val_pool is not None or dataset.subset is not None:
        raise ConfigError(
            f"config key 'data.split.merged': dataset '{dataset.name}' has a validation pool or a decoded "
            "few-shot subset, which a merged pool would mix into training; allowed: data.split.merged false"
        )
    y = np.concatenate([dataset.y_train.cpu().numpy(), dataset.y_test.cpu().numpy()]).astype(np.int64)
    dom = _cat(dataset.domain_train, dataset.domain_test)
    train, test = merged_client_split(
        partition,
        y,
        num_clients,
        seed,
        num_classes=dataset.num_classes,
        train_share=train_share,
        domains=None if dom is None else dom.cpu().numpy(),
    )
    train_rows, test_rows = np.sort(_rows(train)), _rows(test)
    local_train = [np.searchsorted(train_rows, t) for t in train]
    local_test = np.split(np.arange(len(test_rows), dtype=np.int64), np.cumsum([len(t) for t in test])[:-1])
    fit, val = validation_split(local_train, val_fraction, child_seed(seed, _VAL_TAG))
    as_tensors = [
        [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in g] for g in (fit, local_test, val)
    ]
    return FederatedData(
        dataset=_merged_dataset(dataset, train_rows, test_rows, train_share),
        train_idx=as_tensors[0],
        test_idx=as_tensors[1],
        val_idx=as_tensors[2],
        partition=dict(partition),
        seed=seed,
        test_info={
            "disjoint": True,
            "shared_classes": [],
            "fraction": None,
            "rule": f"merged train+test pool, each client's own samples: train_share={train_share}",
        },
    )
