"""Node-local data (``data.source: nodes``): every node (a Flower SuperNode, a silo) reads only its own data
root, and serves it as one client or as ``k`` clients split locally.

* :func:`node_federation`: one node's dataset, its labels mapped onto the federation's label space, stored
  normalised with the node's own statistics (what the node's loader computes from its own training
  images: nothing about another node's data is needed), partitioned over the node's ``k`` clients.
* :class:`NodeManifest`: what a node tells the server before training: its label space, input shape and
  its clients' sample and class counts (never a sample). :func:`check_manifests` compares them and names
  the first node that differs, in one line.
* :func:`combine_nodes`: the nodes' federations side by side as one :class:`FederatedData` (client ``c`` of
  node ``i`` is global client ``i·k + c``; the node index is each sample's domain tag): the embedded
  engine's reading of the same folders, a domain-like natural partition.
* :func:`spread`: a node's federation as a view over the whole federation's client ids (other nodes'
  clients hold nothing): what a node's client runtime indexes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from fedskew.data.base import Dataset
from fedskew.data.federated import FederatedData, build_federated
from fedskew.data.partition import child_seed
from fedskew.errors import DataError

#: sub-seed tag of node ``i``'s local partition: ``child_seed(seed, NODE_TAG + i)``
NODE_TAG = 1_000


def node_label_space(dataset: Dataset, classes: Sequence[str] | None, where: str) -> Dataset:
    """``dataset`` with its labels mapped by name onto the declared label space ``classes`` (a node may hold
    a subset of it; a class outside it is an error naming ``where``); unchanged without a declaration."""
    if classes is None:
        return dataset
    own = dataset.class_names
    index = {name: i for i, name in enumerate(classes)}
    unknown = [name for name in own if name not in index]
    if unknown:
        raise DataError(
            f"{where}: classes {unknown} are not in the label space data.nodes.classes; "
            f"allowed: {list(classes)}"
        )
    lookup = torch.tensor([index[name] for name in own], dtype=torch.int64)
    return replace(
        dataset,
        y_train=lookup[dataset.y_train.long()],
        y_test=lookup[dataset.y_test.long()],
        num_classes=len(classes),
        classes=list(classes),
    )


def stored_normalised(dataset: Dataset) -> Dataset:
    """``dataset`` with both splits converted once by its own normaliser (per-channel mean and std of the
    node's training images) and stored as float32, so nodes with other statistics can share one tensor."""
    norm = dataset.normaliser()
    channels = len(dataset.mean)
    return replace(
        dataset,
        x_train=norm(dataset.x_train),
        x_test=norm(dataset.x_test),
        mean=(0.0,) * channels,
        std=(1.0,) * channels,
    )


def node_federation(
    dataset: Dataset,
    index: int,
    clients: int,
    partition: Mapping[str, Any],
    seed: int,
    *,
    test: Mapping[str, Any] | None = None,
    **options: Any,
) -> FederatedData:
    """Node ``index``'s ``clients`` clients over its own (label-mapped) ``dataset``, partitioned with the
    run's scheme from the node's own sub-seed. A node that is one client is tested on its whole test set
    unless ``test`` (``data.test``) says otherwise; ``options``: :func:`build_federated`'s keywords."""
    own_test = dict(test or {}) or ({"whole": True} if clients == 1 else {})
    return build_federated(
        stored_normalised(dataset), clients, partition, child_seed(seed, NODE_TAG + index),
        test=own_test or None, **options,
    )  # fmt: skip


@dataclass(frozen=True)
class NodeManifest:
    """What node ``index`` says about its data (``where``: how errors name it, e.g. its data root)."""

    index: int
    where: str
    classes: tuple[str, ...]
    in_shape: tuple[int, ...]
    class_counts: Tensor  # [k, C] int64 training samples per local client and class
    test_sizes: tuple[int, ...]
    val_sizes: tuple[int, ...]
    test_total: int

    @classmethod
    def of(cls, data: FederatedData, index: int, where: str) -> NodeManifest:
        ds = data.dataset
        val = data.val_idx or [torch.zeros(0, dtype=torch.long)] * data.num_clients
        return cls(
            index, where, tuple(ds.class_names), ds.in_shape, data.class_counts(),
            tuple(len(t) for t in data.test_idx), tuple(len(t) for t in val), len(ds.y_test),
        )  # fmt: skip

    def to_record(self) -> dict[str, Any]:
        """Flat values a Flower ``ConfigRecord`` holds (lists of ints and strings)."""
        return {
            "index": self.index,
            "where": self.where,
            "classes": list(self.classes),
            "in_shape": list(self.in_shape),
            "clients": int(self.class_counts.shape[0]),
            "class_counts": self.class_counts.flatten().tolist(),
            "test_sizes": list(self.test_sizes),
            "val_sizes": list(self.val_sizes),
            "test_total": self.test_total,
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> NodeManifest:
        k, classes = int(rec["clients"]), tuple(str(c) for c in rec["classes"])
        counts = torch.tensor(list(rec["class_counts"]), dtype=torch.int64).view(k, len(classes))
        return cls(
            int(rec["index"]), str(rec["where"]), classes, tuple(int(d) for d in rec["in_shape"]), counts,
            tuple(int(n) for n in rec["test_sizes"]), tuple(int(n) for n in rec["val_sizes"]),
            int(rec["test_total"]),
        )  # fmt: skip


def check_manifests(manifests: Sequence[NodeManifest], clients: int) -> None:
    """Before any training: every node holds training samples, ``clients`` clients, and the label space and
    input shape of the first node. The first difference is a one-line :class:`DataError` naming the node."""
    if not manifests:
        raise DataError("data.source=nodes: no node reported its data")
    first = manifests[0]
    for m in manifests:
        name = f"node {m.index} ({m.where})"
        if int(m.class_counts.sum()) == 0:
            raise DataError(f"{name} has no training samples")
        if m.class_counts.shape[0] != clients:
            raise DataError(f"{name} serves {m.class_counts.shape[0]} clients, data.nodes.clients={clients}")
        if m.classes != first.classes:
            extra = sorted(set(m.classes) - set(first.classes))
            missing = sorted(set(first.classes) - set(m.classes))
            raise DataError(
                f"{name} has the label space {list(m.classes)}, node {first.index} {list(first.classes)} "
                f"(extra {extra}, missing {missing}); declare data.nodes.classes to map subsets by name"
            )
        if m.in_shape != first.in_shape:
            raise DataError(
                f"{name} has inputs of shape {m.in_shape}, node {first.index} {first.in_shape}; "
                "give every node the same image size (data.options.size)"
            )


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def combine_nodes(parts: Sequence[FederatedData]) -> FederatedData:
    """The nodes' federations (checked by :func:`check_manifests`) as one: samples concatenated in node
    order, each node's clients' index views shifted onto them, the node index as the domain tag."""
    sets = [p.dataset for p in parts]
    train_at = _offsets([len(d.y_train) for d in sets])
    test_at = _offsets([len(d.y_test) for d in sets])

    def shifted(views: list[list[Tensor]], at: list[int]) -> list[Tensor]:
        return [t + off for v, off in zip(views, at, strict=True) for t in v]

    first = sets[0]
    dataset = replace(
        first,
        name="nodes",
        x_train=torch.cat([d.x_train for d in sets]),
        y_train=torch.cat([d.y_train for d in sets]),
        x_test=torch.cat([d.x_test for d in sets]),
        y_test=torch.cat([d.y_test for d in sets]),
        domain_train=torch.cat([torch.full((len(d.y_train),), i) for i, d in enumerate(sets)]),
        domain_test=torch.cat([torch.full((len(d.y_test),), i) for i, d in enumerate(sets)]),
        domain_names=[f"node{i}" for i in range(len(sets))],
        meta={},
    )
    return FederatedData(
        dataset=dataset,
        train_idx=shifted([p.train_idx for p in parts], train_at),
        test_idx=shifted([p.test_idx for p in parts], test_at),
        val_idx=shifted([p.val_idx for p in parts], train_at) if all(p.val_idx for p in parts) else [],
        partition={"name": "nodes", "clients": parts[0].num_clients, "local": parts[0].partition},
        seed=parts[0].seed,
        test_info={"nodes": [p.test_info for p in parts]},
    )


def spread(local: FederatedData, offset: int, num_clients: int) -> FederatedData:
    """``local`` (one node's ``k`` clients) as clients ``offset .. offset + k - 1`` of ``num_clients``: the
    other clients are empty views (they live on other nodes)."""
    empty = torch.zeros(0, dtype=torch.long)
    k = local.num_clients

    def place(views: list[Tensor]) -> list[Tensor]:
        return [empty] * offset + list(views) + [empty] * (num_clients - offset - k)

    return replace(
        local,
        train_idx=place(local.train_idx),
        test_idx=place(local.test_idx),
        val_idx=place(local.val_idx) if local.val_idx else [],
    )
