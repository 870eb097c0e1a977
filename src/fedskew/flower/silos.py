"""``data.source: nodes`` on Flower: each SuperNode serves its own data root, the ServerApp reads no data.

Before the first round the server asks every node for its :class:`~fedskew.data.nodes.NodeManifest` (a
``query`` message carrying the config; the node loads its data and answers with its label space, input
shape and its clients' counts, or with the one-line error that loading gave), checks them against each
other (:func:`~fedskew.data.nodes.check_manifests`) and builds the algorithm from the counts alone
(:func:`~fedskew.experiment.silos.federation_meta`). Every later message carries those counts (the
federation record), so every node constructs the same algorithm context as the server. Client ``c`` lives
on node ``c // data.nodes.clients``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedskew.data.nodes import NodeManifest, check_manifests
from fedskew.engine.assembly import ClientMeta
from fedskew.errors import DataError, FedskewError
from fedskew.experiment.config import Config, dump_config
from fedskew.flower.records import config

#: node-config key of a node's own data root (a simulated partition's data.root; node-local data's root)
DATA_ROOT_KEY = "data-root"
MANIFEST = "manifest"


def home_of(cfg: Config) -> Callable[[int], int]:
    """The node index a client lives on: ``c // data.nodes.clients`` for node-local data, else
    ``c % engine.nodes`` (the simulated partition's round robin)."""
    if cfg.data.source == "nodes":
        per_node = cfg.data.nodes.clients
        return lambda cid: cid // per_node
    nodes = cfg.engine.nodes
    return lambda cid: cid % nodes


def clients_on(cfg: Config, num_clients: int, index: int) -> list[int]:
    """The clients living on node ``index`` (:func:`home_of`), in ascending order."""
    home = home_of(cfg)
    return [c for c in range(num_clients) if home(c) == index]


def node_root(cfg: Config, own: str, index: int) -> str:
    """Node ``index``'s data root for node-local data: its node config's ``data-root``, else
    ``data.nodes.roots[index]``; a one-line error when it has neither."""
    if own:
        return own
    roots = cfg.data.nodes.roots
    if index < len(roots):
        return roots[index]
    raise DataError(
        f"node {index} has no data root: start its SuperNode with --node-config \"data-root='/path'\" or "
        "list it in data.nodes.roots"
    )


def federation_record(meta: ClientMeta) -> dict[str, Any]:
    """The counts every node needs to construct the server's algorithm context (job-record entries)."""
    return {
        "fed_classes": meta.num_classes,
        "fed_shape": list(meta.in_shape),
        "fed_counts": meta.class_counts.flatten().tolist(),
    }


def federation_from(job: Mapping[str, Any]) -> ClientMeta | None:
    """The :class:`ClientMeta` a message's job record carries (``None``: a simulated-partition run)."""
    if "fed_counts" not in job:
        return None
    classes = int(job["fed_classes"])
    counts = torch.tensor(list(job["fed_counts"]), dtype=torch.int64).view(-1, classes)
    shape = tuple(int(d) for d in job["fed_shape"])
    return ClientMeta(
        num_clients=int(counts.shape[0]), num_classes=classes, in_shape=shape, class_counts=counts
    )


def manifest_reply(build: Callable[[], NodeManifest]) -> RecordDict:
    """A node's answer to a manifest query: its manifest, or the one-line error loading its data gave."""
    try:
        record: dict[str, Any] = build().to_record()
    except FedskewError as err:
        record = {"error": str(err)}
    return RecordDict({MANIFEST: ConfigRecord(record)})


def ask_manifests(
    nodes: Mapping[int, int],
    ask: Callable[[dict[int, Message]], dict[int, Message]],
    cfg: Config,
    timeout: float,
) -> list[NodeManifest]:
    """Every node's manifest (``nodes``: node index -> Flower node id, every index present; ``ask``
    exchanges messages by Flower node id), in node order, checked against each other; raises the first
    node's error."""
    job = ConfigRecord({"config": dump_config(cfg), MANIFEST: True})
    messages = {
        nodes[i]: Message(
            RecordDict({"job": job}), dst_node_id=nodes[i], message_type=MessageType.QUERY, ttl=timeout
        )
        for i in range(cfg.engine.nodes)
    }
    replies = ask(messages)
    manifests = []
    for i in range(cfg.engine.nodes):
        reply = replies.get(nodes[i])
        if reply is None or reply.has_error() or MANIFEST not in reply.content:
            why = (
                "no reply" if reply is None else (reply.error.reason if reply.has_error() else "no manifest")
            )
            raise FedskewError(f"node {i} did not report its data ({why})")
        record = config(reply.content, MANIFEST)
        if "error" in record:
            raise DataError(str(record["error"]))
        manifests.append(NodeManifest.from_record(record))
    check_manifests(manifests, cfg.data.nodes.clients)
    return manifests
