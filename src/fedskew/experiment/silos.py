"""``data.source: nodes`` in a run: each node's own data root read as its clients (:mod:`fedskew.data.nodes`).

The embedded and ``flower-simulation`` runtimes read ``data.nodes.roots`` (one data root per node) and join
the nodes' federations into one (:func:`build_node_data`); a deployed SuperNode reads only its own root
(:func:`load_node`) and tells the server its :class:`~fedskew.data.nodes.NodeManifest`, from which the server
builds the algorithm's view of the clients (:func:`federation_meta`) without any sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fedskew.data.base import DATASETS, Dataset
from fedskew.data.federated import FederatedData
from fedskew.data.nodes import (
    NodeManifest,
    check_manifests,
    combine_nodes,
    node_federation,
    node_label_space,
    stored_normalised,
)
from fedskew.engine.assembly import ClientMeta
from fedskew.engine.evaluation import EVAL_BATCH, EVAL_BATCH_OTHER, EvalData, Evaluator, RoundEvaluator
from fedskew.engine.probes import CentralProbe
from fedskew.errors import DataError, FedskewError

if TYPE_CHECKING:
    from fedskew.algorithms.base import Algorithm
    from fedskew.engine.runtime import ModelCache
    from fedskew.experiment.config import Config


def labelled_dataset(cfg: Config, root: str | Path, where: str) -> Dataset:
    """``cfg.data.dataset`` read from ``root`` with ``cfg.data.options`` and mapped onto the declared label
    space; a loading error is prefixed with ``where`` (the node or the server)."""
    try:
        dataset = DATASETS.get(cfg.data.dataset)(Path(root).expanduser(), **cfg.data.options)
    except FedskewError as err:
        raise type(err)(f"{where}: {err}") from None
    return node_label_space(dataset, cfg.data.nodes.classes, where)


def load_node(cfg: Config, index: int, root: str | Path) -> FederatedData:
    """Node ``index``'s clients from its data root alone (``cfg.data.dataset`` with ``cfg.data.options``);
    a loading error names the node."""
    where = f"node {index} (data root {root})"
    dataset = labelled_dataset(cfg, root, where)
    if len(dataset.y_train) == 0:
        raise DataError(f"{where} has no training samples")
    d = cfg.data
    try:
        return node_federation(
            dataset, index, d.nodes.clients, d.partition, cfg.seed, test=d.test, val_fraction=d.val_fraction,
            train_limit=d.train_limit, shots=d.shots, val_shots=d.val_shots,
        )  # fmt: skip
    except FedskewError as err:
        raise type(err)(f"{where}: {err}") from None


def node_manifest(cfg: Config, index: int, root: str | Path) -> tuple[NodeManifest, FederatedData]:
    """Node ``index``'s manifest and clients."""
    data = load_node(cfg, index, root)
    return NodeManifest.of(data, index, f"data root {root}"), data


def build_node_data(cfg: Config) -> FederatedData:
    """Every node's clients from ``data.nodes.roots``, checked against each other, as one federation."""
    parts = [node_manifest(cfg, i, root) for i, root in enumerate(cfg.data.nodes.roots)]
    check_manifests([m for m, _ in parts], cfg.data.nodes.clients)
    return combine_nodes([data for _, data in parts])


def with_central(
    cfg: Config,
    inner: RoundEvaluator,
    algorithm: Algorithm,
    models: ModelCache,
    classes: list[str],
    in_shape: tuple[int, ...],
) -> RoundEvaluator:
    """``inner`` plus the global model scored on the test split of ``data.nodes.server_root`` (read with the
    nodes' loader and options, mapped onto their label space ``classes``, normalised with its own training
    statistics), if the server is given one (:class:`~fedskew.engine.probes.CentralProbe`)."""
    root = cfg.data.nodes.server_root
    if cfg.data.source != "nodes" or root is None:
        return inner
    where = f"the server (data root {root})"
    dataset = stored_normalised(labelled_dataset(cfg, root, where))
    if dataset.class_names != classes or dataset.in_shape != in_shape:
        raise DataError(
            f"{where} has the label space {dataset.class_names} and inputs {dataset.in_shape}, the nodes "
            f"{classes} and {in_shape}"
        )
    held = FederatedData(dataset=dataset, train_idx=[], test_idx=[])
    batch = cfg.eval.batch_size or EVAL_BATCH.get(models.device.type, EVAL_BATCH_OTHER)
    central = Evaluator(
        algorithm, models, EvalData.of(held, models.device), "global", batch, cfg.seed, cfg.engine.precision
    )
    return CentralProbe(inner, central)


def federation_meta(manifests: Sequence[NodeManifest]) -> ClientMeta:
    """The algorithm's view of the federation from the nodes' manifests (in node order): counts and shapes."""
    counts = torch.cat([m.class_counts for m in manifests])
    first = manifests[0]
    return ClientMeta(
        num_clients=int(counts.shape[0]),
        num_classes=len(first.classes),
        in_shape=first.in_shape,
        class_counts=counts,
    )
