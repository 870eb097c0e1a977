"""A Flower node's data, cached on its disk, so that a fresh ClientApp process does not rebuild it.

Flower's deployment runtime starts one ``flwr-clientapp`` process per message, and each would rebuild the
partition from the run's config (load the dataset, partition it, draw the test and validation splits). The
node keeps the result instead, restricted to what the node needs, in one file per (config, data root, node
index, fedskew version):

* the training, validation and test rows of the clients it owns (as stored: uint8 images stay uint8), with
  their index views renumbered into those rows (the other clients: empty views);
* every client's training class histogram (``class_counts``: the algorithm's
  :class:`~fedskew.engine.assembly.ClientMeta` sees all clients, as on the server);
* the dataset's plain fields (name, number of classes, normalisation mean / std, class and domain names,
  ``meta``), and the partition's description.

:func:`compact` is that restriction, :func:`node_data` the cache around any builder of a
:class:`~fedskew.data.federated.FederatedData`. The file is ``<sha256 of the rest>\\n`` followed by
``torch.save({"key": ..., "data": ...})``; it is read with ``torch.load(weights_only=True)`` (tensors and
plain values only, never a pickle), and trusted only when the checksum and the key stored inside both
match: anything else (missing, truncated, corrupt, another key) is rebuilt and rewritten atomically. A
dataset whose fields are not all tensors and plain values is not cached (rebuilt in every process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import fedskew
from fedskew.data.base import Dataset
from fedskew.data.cache import cache_root, save_bytes_atomic
from fedskew.data.federated import FederatedData

log = logging.getLogger("fedskew.flower")

#: bump when the cached layout changes (old files then simply miss)
FORMAT = 1
#: the folder under the cache root (``$FEDSKEW_CACHE``) where nodes keep their data
FOLDER = "flower-nodes"
#: dataset fields a node never needs after partitioning (they only steer ``build_federated``)
_DROPPED = ("val_pool", "subset")


@dataclass
class NodeFederatedData(FederatedData):
    """A :class:`FederatedData` holding only a node's clients' rows; ``class_counts`` keeps every client's
    training histogram, as computed on the full data."""

    counts: Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))

    def class_counts(self) -> Tensor:
        return self.counts


def _take(x: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if x is None else x[rows].cpu()


def _renumber(idx: list[Tensor], owned: list[int], start: int = 0) -> tuple[list[Tensor], Tensor]:
    """The owned clients' views renumbered into their concatenated rows (others empty), and those rows."""
    keep = set(owned)
    empty = torch.zeros(0, dtype=torch.long)
    rows = torch.cat([idx[c].cpu() for c in owned]) if owned else empty
    views, at = [], start
    for c, t in enumerate(idx):
        n = t.numel() if c in keep else 0
        views.append(torch.arange(at, at + n) if c in keep else empty)
        at += n
    return views, rows


def compact(data: FederatedData, owned: list[int]) -> NodeFederatedData:
    """``data`` restricted to the clients ``owned``: their training and validation rows (in that order)
    and their test rows, the views renumbered; a node's runtime built from it equals one built from
    ``data`` (the same rows, views, histograms and normalisation)."""
    ds = data.dataset
    train_views, train_rows = _renumber(data.train_idx, owned)
    val_views: list[Tensor] = []
    val_rows: Tensor | None = None
    if data.val_idx:
        val_views, val_rows = _renumber(data.val_idx, owned, int(train_rows.numel()))
    test_views, test_rows = _renumber(data.test_idx, owned)
    rows = train_rows if val_rows is None else torch.cat([train_rows, val_rows])
    small = dataclasses.replace(
        ds,
        x_train=ds.x_train[rows].cpu(),
        y_train=ds.y_train[rows].cpu(),
        x_test=ds.x_test[test_rows].cpu(),
        y_test=ds.y_test[test_rows].cpu(),
        domain_train=_take(ds.domain_train, rows),
        domain_test=_take(ds.domain_test, test_rows),
        val_pool=None,
        subset=None,
    )
    return NodeFederatedData(
        small, train_views, test_views, val_views, data.partition, data.seed, data.test_info,
        counts=data.class_counts().cpu(),
    )  # fmt: skip


# ---------------------------------------------------------------------- (de)serialisation
def _plain(obj: Any) -> bool:
    """Whether ``obj`` is tensors and plain values only (what ``torch.load(weights_only=True)`` reads back
    as it was written)."""
    if obj is None or isinstance(obj, str | int | float | bool | Tensor):
        return True
    if isinstance(obj, list | tuple):
        return all(map(_plain, obj))
    if isinstance(obj, dict):
        return all(isinstance(k, str | int) for k in obj) and all(map(_plain, obj.values()))
    return False


def to_plain(data: NodeFederatedData) -> dict[str, Any] | None:
    """``data`` as a dict of tensors and plain values, or ``None`` when some field is not one (or the
    dataset is not a plain :class:`Dataset`)."""
    if type(data.dataset) is not Dataset:
        return None
    ds = {f.name: getattr(data.dataset, f.name) for f in dataclasses.fields(data.dataset)}
    out = {
        "dataset": {k: v for k, v in ds.items() if k not in _DROPPED},
        "train_idx": data.train_idx,
        "test_idx": data.test_idx,
        "val_idx": data.val_idx,
        "partition": data.partition,
        "seed": data.seed,
        "test_info": data.test_info,
        "counts": data.counts,
    }
    return out if _plain(out) else None


def from_plain(obj: dict[str, Any]) -> NodeFederatedData:
    return NodeFederatedData(
        Dataset(**obj["dataset"]), obj["train_idx"], obj["test_idx"], obj["val_idx"], obj["partition"],
        obj["seed"], obj["test_info"], counts=obj["counts"],
    )  # fmt: skip


def cache_key(config_text: str, root: str, index: int) -> str:
    """The file name of a node's data: the resolved config, the resolved data root, the node's index, the
    fedskew version and the cache format."""
    parts = [FORMAT, fedskew.__version__, config_text, root, index]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def write(path: Path, key: str, data: NodeFederatedData) -> bool:
    """Store ``data`` under ``key`` (checksummed, atomically); ``False`` when it is not plain or the folder
    is not writable."""
    obj = to_plain(data)
    if obj is None:
        return False
    buf = io.BytesIO()
    torch.save({"key": key, "data": obj}, buf)
    body = buf.getvalue()
    head = hashlib.sha256(body).hexdigest().encode() + b"\n"
    return save_bytes_atomic(path, head + body)


def read(path: Path, key: str) -> NodeFederatedData | None:
    """The data stored at ``path`` under ``key``, or ``None`` when the file is missing, corrupt (checksum),
    unreadable as tensors and plain values, or written for another key."""
    try:
        blob = path.read_bytes()
        head, body = blob[:64], blob[65:]
        if blob[64:65] != b"\n" or hashlib.sha256(body).hexdigest().encode() != head:
            return None
        obj = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
        if not isinstance(obj, dict) or obj.get("key") != key:
            return None
        return from_plain(obj["data"])
    except Exception:  # missing, truncated or foreign: rebuild
        return None


def node_data(
    build: Callable[[], FederatedData],
    owned: Callable[[FederatedData], list[int]],
    key: str,
    folder: Path | None = None,
) -> tuple[NodeFederatedData, bool]:
    """The node's data from ``folder/<key>.pt`` (default: ``$FEDSKEW_CACHE/flower-nodes``), else
    ``compact(data, owned(data))`` of ``data = build()``, written there; and whether it was read."""
    path = (folder or cache_root() / FOLDER) / f"{key}.pt"
    cached = read(path, key)
    if cached is not None:
        return cached, True
    data = build()
    small = compact(data, owned(data))
    if not write(path, key, small):
        log.debug("node data not cached at %s (not tensors and plain values, or not writable)", path)
    return small, False
