"""``data.source: nodes`` on Flower: each SuperNode serves its own data root, the ServerApp reads no data.

Before the first round the server asks every node for its :class:`~fedskew.data.nodes.NodeManifest` (a
``query`` message carrying the config; the node loads its data and answers with its label space, input
shape and its clients' counts, or with the one-line error that loading gave), checks them against each
other (:func:`~fedskew.data.nodes.check_manifests`) and builds the algorithm from the counts alone
(:func:`~fedskew.experiment.silos.federation_meta`). Every later message to a node carries what of those
counts the method's client-side hooks need (the node's federation record, :func:`node_federation`: its own
clients' rows, every client's size, or every histogram; :mod:`fedskew.engine.need_to_know`), from which the
node constructs its algorithm context. Client ``c`` lives on node ``c // data.nodes.clients``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedskew.data.nodes import NodeManifest, check_manifests
from fedskew.engine.assembly import ClientMeta
from fedskew.engine.need_to_know import check_level, node_view
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


def federation_record(
    meta: ClientMeta, owned: Sequence[int] | None = None, need: str = "classes"
) -> dict[str, Any]:
    """The job-record entries a node builds its algorithm context from: :func:`node_view` of ``meta`` for
    the node owning ``owned`` at level ``need`` (``owned=None``: the whole federation). Only the rows the
    view holds travel (``fed_rows``, ``fed_counts``), every client's size only where the view has sizes
    that are not those rows' sums (``fed_sizes``), and the level (``fed_need``) the node checks."""
    view = meta if owned is None else node_view(meta, owned, need)
    counts = view.class_counts
    rows = [c for c in range(view.num_clients) if bool(counts[c].any())]
    record: dict[str, Any] = {
        "fed_classes": view.num_classes,
        "fed_shape": list(view.in_shape),
        "fed_clients": view.num_clients,
        "fed_rows": rows,
        "fed_counts": counts[rows].flatten().tolist(),
        "fed_need": check_level(need),
    }
    if not torch.equal(view.client_sizes, counts.sum(1)):
        record["fed_sizes"] = view.client_sizes.tolist()
    return record


def node_federation(meta: ClientMeta, cfg: Config, index: int, need: str) -> dict[str, Any]:
    """Node ``index``'s federation record (:func:`federation_record` for the clients living on it)."""
    return federation_record(meta, clients_on(cfg, meta.num_clients, index), need)


def node_federations(meta: ClientMeta, cfg: Config, need: str) -> dict[int, dict[str, Any]]:
    """Every node index's federation record (:func:`node_federation`), what the server's messages carry."""
    return {index: node_federation(meta, cfg, index, need) for index in range(cfg.engine.nodes)}


def record_level(job: Mapping[str, Any]) -> str:
    """The disclosure level of a message's federation record (a record naming none holds every row)."""
    return str(job.get("fed_need", "classes"))


def federation_from(job: Mapping[str, Any]) -> ClientMeta | None:
    """The :class:`ClientMeta` a message's job record carries (``None``: a simulated-partition run); a
    malformed record is a one-line error."""
    if "fed_counts" not in job:
        return None
    try:
        classes, shape = int(job["fed_classes"]), tuple(int(d) for d in job["fed_shape"])
        values = torch.tensor(list(job["fed_counts"]), dtype=torch.int64).view(-1, classes)
        n = int(job.get("fed_clients", values.shape[0]))
        rows = [int(c) for c in job.get("fed_rows", range(n))]
        sizes = job.get("fed_sizes")
        size_t = None if sizes is None else torch.tensor(list(sizes), dtype=torch.int64)
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise FedskewError(f"the federation record is malformed ({type(err).__name__}: {err})") from None
    problem = _record_problem(n, rows, values, size_t)
    if problem:
        raise FedskewError(f"the federation record is malformed: {problem}")
    counts = torch.zeros(n, classes, dtype=torch.int64)
    counts[rows] = values
    return ClientMeta(num_clients=n, num_classes=classes, in_shape=shape, class_counts=counts, sizes=size_t)


def _record_problem(n: int, rows: list[int], values: torch.Tensor, sizes: torch.Tensor | None) -> str:
    """What is wrong with a decoded record's rows, counts and sizes, or ``""``."""
    if n < 1 or len(set(rows)) != len(rows) or any(not 0 <= c < n for c in rows):
        return f"rows {rows[:8]} are not distinct clients of 0-{n - 1}"
    if values.shape[0] != len(rows):
        return f"{values.shape[0]} count rows for {len(rows)} clients"
    if sizes is not None and sizes.shape != (n,):
        return f"{sizes.numel()} sizes for {n} clients"
    if bool((values < 0).any()) or (sizes is not None and bool((sizes < 0).any())):
        return "negative counts"
    return ""


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
