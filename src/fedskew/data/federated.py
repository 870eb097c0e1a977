"""Per-client views of one dataset: :class:`FederatedData` and its builder :func:`build_federated`.

The dataset's tensors are held once; a client is three ``int64`` index tensors (train / validation into the
training set, test into the test set). The partition depends only on ``(dataset, num_clients, partition,
seed)``, never on the algorithm, so every method of a comparison trains on the same clients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedskew.data.base import Dataset
from fedskew.data.partition import (
    apply_partition,
    child_seed,
    client_test_split,
    few_shot_indices,
    validation_split,
)
from fedskew.errors import ConfigError, DataError
from fedskew.registry import check_options, option_names

#: ``client_test_split`` arguments filled in by :func:`build_federated` (not settable under ``data.test``)
_TEST_RESERVED = frozenset({"num_classes", "train_domains_per_client", "test_domains"})
#: sub-seed tags: the test and validation draws never share the partition's stream
_TEST_TAG, _VAL_TAG, _SHOTS_TAG, _VAL_SHOTS_TAG = 101, 102, 103, 104


def personal_test_options() -> list[str]:
    """Options accepted under ``data.test`` (the keyword options of :func:`client_test_split`)."""
    return option_names(client_test_split, 3, _TEST_RESERVED)


def _histogram(labels: Tensor, idx: list[Tensor], num_classes: int) -> Tensor:
    """``[N, C]`` int64 counts of ``labels[idx[i]]`` (one bincount, no per-client loop)."""
    n = len(idx)
    sizes = torch.tensor([len(t) for t in idx], dtype=torch.int64)
    if n == 0:
        return torch.zeros(0, num_classes, dtype=torch.int64)
    flat = torch.cat(idx).to(labels.device)
    owner = torch.repeat_interleave(torch.arange(n, device=labels.device), sizes.to(labels.device))
    key = owner * num_classes + labels[flat].long()
    return torch.bincount(key, minlength=n * num_classes).view(n, num_classes).cpu()


@dataclass
class FederatedData:
    """A dataset split over clients by index views.

    ``train_idx[i]`` / ``val_idx[i]`` index ``dataset.x_train``; ``test_idx[i]`` indexes ``dataset.x_test``
    (the client's personalized test split). ``test_info`` says how the test splits were drawn (``disjoint``
    is False when some class had to be sampled independently per client).
    """

    dataset: Dataset
    train_idx: list[Tensor]
    test_idx: list[Tensor]
    val_idx: list[Tensor] = field(default_factory=list)
    partition: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    test_info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def client_sizes(self) -> Tensor:
        """``[N]`` int64 training samples per client (validation excluded)."""
        return torch.tensor([len(t) for t in self.train_idx], dtype=torch.int64)

    def class_counts(self) -> Tensor:
        """``[N, C]`` int64 training histogram: samples of class c held by client i."""
        return _histogram(self.dataset.y_train, self.train_idx, self.num_classes)

    def test_class_counts(self) -> Tensor:
        """``[N, C]`` int64 histogram of the per-client test splits."""
        return _histogram(self.dataset.y_test, self.test_idx, self.num_classes)

    def summary_table(self, top: int = 3) -> list[dict[str, Any]]:
        """One row per client: sizes, number of classes, the ``top`` largest classes, domains if any."""
        counts = self.class_counts()
        order = torch.argsort(counts, dim=1, descending=True, stable=True)[:, :top]
        val = [len(v) for v in self.val_idx] if self.val_idx else [0] * self.num_clients
        doms = self.dataset.domain_train
        rows = []
        for i in range(self.num_clients):
            row: dict[str, Any] = {
                "client": i,
                "train": int(counts[i].sum()),
                "val": val[i],
                "test": len(self.test_idx[i]),
                "classes": int((counts[i] > 0).sum()),
                "top_classes": [(int(c), int(counts[i, c])) for c in order[i] if counts[i, c] > 0],
            }
            if doms is not None:
                row["domains"] = torch.unique(doms[self.train_idx[i]]).tolist()
            rows.append(row)
        return rows

    def __repr__(self) -> str:
        sizes = self.client_sizes.tolist() or [0]
        return (
            f"FederatedData({self.dataset.name!r}, clients={self.num_clients}, partition={self.partition}, "
            f"seed={self.seed}, train sizes {min(sizes)}..{max(sizes)})"
        )


def _personal_tests(
    dataset: Dataset,
    labels: np.ndarray,
    domains: np.ndarray | None,
    parts: list[np.ndarray],
    seed: int,
    opts: dict[str, Any],
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Per-client test splits (``data.test`` options checked first), matching the (domain, class) mix when
    both splits carry domain tags."""
    check_options(client_test_split, opts, "config key 'data.test.{key}': unknown option", 3, _TEST_RESERVED)
    test_domains = None if dataset.domain_test is None else dataset.domain_test.cpu().numpy()
    if domains is None or test_domains is None:
        train_domains, test_domains = None, None
    else:
        train_domains = [domains[p] for p in parts]
    return client_test_split(
        [labels[p] for p in parts],
        dataset.y_test.cpu().numpy(),
        child_seed(seed, _TEST_TAG),
        num_classes=dataset.num_classes,
        train_domains_per_client=train_domains,
        test_domains=test_domains,
        **opts,
    )


def _training_subset(labels: np.ndarray, shots: int | None, num_classes: int, seed: int) -> np.ndarray:
    """The training indices the partition splits: all of ``labels``, or ``shots`` per class of them."""
    if shots is None:
        return np.arange(len(labels))
    return few_shot_indices(labels, shots, num_classes, child_seed(seed, _SHOTS_TAG))


def _candidate_rows(val_pool: Tensor | None, limit: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(rows the partition may use, rows of the validation pool) among the first ``limit`` training rows:
    all rows and ``None`` without a pool; else the rows outside and inside it."""
    if val_pool is None:
        return np.arange(limit), None
    mask = val_pool.cpu().numpy()[:limit]
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def _shots_and_outside(
    labels: np.ndarray, val_pool: Tensor | None, limit: int, num_classes: int, seed: int, shots: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """(rows the partition splits: all candidates or ``shots`` per class of them, rows ``val_shots`` are
    drawn from: the validation pool, else the candidates outside the shots)."""
    candidates, pool = _candidate_rows(val_pool, limit)
    subset = candidates[_training_subset(labels[candidates], shots, num_classes, seed)]
    return subset, np.setdiff1d(candidates, subset) if pool is None else pool


def _validation_draw(
    labels: np.ndarray, outside: np.ndarray, val_shots: int, num_classes: int, seed: int
) -> np.ndarray:
    """``val_shots`` seeded rows per class of the rows ``outside`` (sorted)."""
    draw = few_shot_indices(labels[outside], val_shots, num_classes, child_seed(seed, _VAL_SHOTS_TAG))
    return outside[draw]


def few_shot_rows(
    labels: np.ndarray,
    val_pool: Tensor | None,
    num_classes: int,
    seed: int,
    shots: int,
    val_shots: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(shot rows, validation rows), sorted: the training rows :func:`build_federated` uses with ``shots``
    / ``val_shots`` / ``seed`` (no ``train_limit``): the seeded shots outside the validation pool, and the
    validation draw (from the pool, else from outside the shots; empty without ``val_shots``). Loaders
    decode only these rows of huge sets (ImageNet), the validation rows as the decoded set's pool; the
    clients built on the decoded rows are then the same as on the whole set."""
    subset, outside = _shots_and_outside(labels, val_pool, len(labels), num_classes, seed, shots)
    if val_shots is None:
        return subset, np.zeros(0, dtype=np.int64)
    return subset, _validation_draw(labels, outside, val_shots, num_classes, seed)


def _few_shot_validation(
    labels: np.ndarray,
    parts: list[np.ndarray],
    outside: np.ndarray,
    val_shots: int,
    num_classes: int,
    seed: int,
) -> list[np.ndarray]:
    """``val_shots`` samples per class from the training indices ``outside`` the shots (or the dataset's
    validation pool), dealt to the clients in proportion to their training class mix (the default rule of
    ``client_test_split``)."""
    pool = _validation_draw(labels, outside, val_shots, num_classes, seed)
    train_labels = [labels[p] for p in parts]
    val, _ = client_test_split(
        train_labels, labels[pool], child_seed(seed, _VAL_TAG), num_classes=num_classes
    )
    return [pool[v] for v in val]


def _check_sizes(num_clients: int, shots: int | None, val_shots: int | None, val_fraction: float) -> None:
    """One-line errors for a federation without clients and for val_shots without shots."""
    if num_clients < 1:
        raise ConfigError(f"config key 'data.num_clients' must be >= 1, got {num_clients}")
    if val_shots is not None and (shots is None or val_fraction > 0):
        raise ConfigError(
            "config key 'data.val_shots' needs data.shots and replaces data.val_fraction (set it 0)"
        )


def _check_subset(dataset: Dataset, shots: int | None, val_shots: int | None, seed: int) -> None:
    """A dataset that decoded only one few-shot draw must be split with that draw's settings."""
    sub = dataset.subset
    if sub is not None and (sub.shots, sub.val_shots, sub.seed) != (shots, val_shots, seed):
        raise ConfigError(
            f"dataset '{dataset.name}' decoded only the rows of shots={sub.shots}, "
            f"val_shots={sub.val_shots}, seed={sub.seed} (data.options shots_per_class / val_per_class / "
            f"subset_seed), but the run asks for shots={shots}, val_shots={val_shots}, seed={seed}; "
            "set them equal"
        )


def _index_tensors(arrays: list[np.ndarray]) -> list[Tensor]:
    """Index arrays as int64 tensors."""
    return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]


def _check_no_empty_client(parts: list[np.ndarray], partition: Mapping[str, Any]) -> None:
    """Clients without training samples are allowed only where the partition asks for them (``min_size:
    0``: cross-device federations where many devices hold nothing)."""
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty and partition.get("min_size") != 0:
        shown = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
        raise DataError(
            f"partition {dict(partition)} left {len(empty)} client(s) without training samples ({shown}); "
            "use fewer clients or a partition option such as min_size"
        )


def build_federated(
    dataset: Dataset,
    num_clients: int,
    partition: Mapping[str, Any],
    seed: int,
    *,
    test: Mapping[str, Any] | None = None,
    val_fraction: float = 0.0,
    train_limit: int | None = None,
    shots: int | None = None,
    val_shots: int | None = None,
) -> FederatedData:
    """Partition ``dataset`` over ``num_clients`` with the scheme ``partition = {"name": ..., **options}``.

    Steps, each with its own sub-seed of ``seed``: the partition (the registered scheme, given
    ``dataset.domain_train`` as ``domains``); per-client test splits from the test set matching each client's
    training distribution (``test`` = options of :func:`~fedskew.data.partition.client_test_split`, e.g.
    ``{"per_class": 40}``; with domain tags on both splits the (domain, class) mix is matched); then
    ``val_fraction`` of each client's training indices held out for validation. ``train_limit=n`` partitions
    only the first ``n`` training samples (MP-FedCL uses 2,000 MNIST images). ``shots=K`` partitions only a
    seeded choice of ``K`` training samples per class (the 16-shot protocol of CoOp / CacheFL), drawn before
    the partition from its own sub-seed of ``seed`` (within the first ``train_limit`` when both are set), so
    every partition scheme and algorithm of one seed sees the same few-shot set. ``val_shots=V`` (with
    ``shots``, instead of ``val_fraction``) draws ``V`` further samples per class from outside the shots and
    gives each client a validation split in proportion to its training class mix. A dataset with a validation
    pool (``dataset.val_pool``, CoOp's ``val`` split) never partitions the pool's rows: the shots (or all
    rows) come from outside it and ``val_shots`` from inside it. Unknown options raise
    :class:`ConfigError` with a did-you-mean; a client left without training samples raises
    :class:`DataError`.
    """
    _check_sizes(num_clients, shots, val_shots, val_fraction)
    _check_subset(dataset, shots, val_shots, seed)
    labels = dataset.y_train.cpu().numpy().astype(np.int64, copy=False)
    domains = None if dataset.domain_train is None else dataset.domain_train.cpu().numpy()
    # the partition sees the subset only; its parts are mapped back to indices of the full training set
    limit = len(labels) if train_limit is None else min(train_limit, len(labels))
    subset, outside = _shots_and_outside(labels, dataset.val_pool, limit, dataset.num_classes, seed, shots)
    sub_domains = None if domains is None else domains[subset]
    parts = apply_partition(
        partition, labels[subset], num_clients, seed, num_classes=dataset.num_classes, domains=sub_domains
    )
    parts = [subset[p] for p in parts]
    _check_no_empty_client(parts, partition)

    test_parts, info = _personal_tests(dataset, labels, domains, parts, seed, dict(test or {}))
    if val_shots is None:
        train, val = validation_split(parts, val_fraction, child_seed(seed, _VAL_TAG))
    else:
        train, val = parts, _few_shot_validation(labels, parts, outside, val_shots, dataset.num_classes, seed)
    return FederatedData(
        dataset=dataset,
        train_idx=_index_tensors(train),
        test_idx=_index_tensors(test_parts),
        val_idx=_index_tensors(val),
        partition=dict(partition),
        seed=seed,
        test_info=info,
    )
