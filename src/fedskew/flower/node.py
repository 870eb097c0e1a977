"""The node side: what a Flower ``ClientApp`` does for the clients its node owns.

A node is told the run's resolved config in every message; from it (and its own data root) it builds the
same partition as every other process, deterministically from the seed, and keeps only its own clients'
samples (client ``c`` lives on node ``c % engine.nodes``). It trains with
:func:`fedskew.engine.client.train_client`, the embedded engine's one client pipeline, and evaluates its
clients' personal models with the embedded evaluator's :func:`~fedskew.engine.evaluation.score`.

Client state never leaves the node. It is kept as versions (in Flower's ``Context.state``, or in the node's
``state-dir`` folder: :mod:`fedskew.flower.versions`): the state a
client produced in round ``r`` is version ``r`` (version 0: ``init_client``). The server only keeps, per
client, the number of the version its committed rounds produced (in its checkpoint), and names it in every
message, so a server that crashes and re-runs a round from its checkpoint trains from the same states, and
an update whose reply never reached the server is simply never referenced. A version is dropped once a
newer referenced one is at or below the server's last periodic checkpoint (no resume can name it again).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from fedskew.algorithms.base import ALGORITHMS, Payload, RoundInfo, State
from fedskew.data.base import resolve_root
from fedskew.data.federated import FederatedData
from fedskew.data.nodes import NodeManifest, spread
from fedskew.engine.assembly import ClientMeta, client_data
from fedskew.engine.client import train_client
from fedskew.engine.device import use_deterministic_algorithms
from fedskew.engine.evaluation import EVAL_BATCH, EVAL_BATCH_OTHER, load_eval_weights, score
from fedskew.engine.need_to_know import check_level, covers, node_view
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.types import tree_to
from fedskew.errors import FedskewError
from fedskew.experiment.build import algorithm_of, build_data
from fedskew.experiment.config import Config, build_config
from fedskew.experiment.silos import load_node, node_manifest
from fedskew.flower.node_cache import cache_key, node_data
from fedskew.flower.records import config, get_payload, put_payload, state_from_bytes, state_to_bytes
from fedskew.flower.silos import (
    DATA_ROOT_KEY,
    MANIFEST,
    clients_on,
    federation_from,
    manifest_reply,
    node_root,
    record_level,
)
from fedskew.flower.versions import Versions, versions_of

log = logging.getLogger("fedskew.flower")

#: node-config keys: the node's index (Flower's own convention, set by the simulation runtime too), the
#: number of nodes, and an optional data root overriding the config's ``data.root``
PARTITION_KEY, NUM_PARTITIONS_KEY = "partition-id", "num-partitions"
#: node-config key: torch threads of the node's ClientApp (0 or absent: torch's default; a local
#: deployment gives each of its nodes an equal share of the machine's cores)
THREADS_KEY = "threads"


@dataclass
class Split:
    """One client's evaluation samples: raw test images (converted per batch) and normalised validation."""

    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


@dataclass
class NodeRuntime:
    """A node's fixed part of a run: the client runtime restricted to its clients, and their eval data
    (``whole``: with node-local data, the node's whole test set and its clients' validation samples, what
    the global protocol scores)."""

    cfg: Config
    rt: ClientRuntime
    owned: list[int]
    splits: dict[int, Split]
    to_float: Any
    eval_batch: int
    whole: Split | None = None


_CACHE: dict[tuple[Any, ...], NodeRuntime] = {}


def node_index(context: Context) -> int:
    return int(context.node_config.get(PARTITION_KEY, 0))


def process_age() -> float:
    """Seconds since this process started (Linux ``/proc``; NaN elsewhere): in a deployment, Flower starts
    one ClientApp process per message, so this is the message's start-up plus handling time."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def timings(started: float, built: float) -> dict[str, float]:
    """The reply's ``seconds_*`` entries: process age, runtime build (0 when cached) and the handler's own
    time, all measured at the end of the handler that began at ``started``, and that end's wall-clock time
    (``time_replied``: the server times the way there and back around it)."""
    return {
        "seconds_process": process_age(),
        "seconds_build": built,
        "seconds_handler": time.perf_counter() - started,
        "time_replied": time.time(),
    }


def node_runtime(job: Mapping[str, Any], context: Context) -> NodeRuntime:
    """The node's runtime for the run's config (cached per process: a simulation actor serves many)."""
    return timed_node_runtime(job, context)[0]


def node_config_of(config_text: str, root: str) -> Config:
    """The run's config as this node reads it: a simulated partition's ``data.root`` replaced by the node's
    own data root (node config ``data-root``), if it has one."""
    raw = yaml.safe_load(config_text)
    if root and raw["data"].get("source", "partition") == "partition":
        raw["data"]["root"] = root
    return build_config(raw)


def timed_node_runtime(job: Mapping[str, Any], context: Context) -> tuple[NodeRuntime, float]:
    """:func:`node_runtime` of a message's job record (the config, and with node-local data the federation
    record) and the seconds spent building it (0 when it was cached in this process; a fresh process reads
    a simulated partition's node data from its disk cache, :mod:`fedskew.flower.node_cache`; node-local
    image folders come from the loader's own decoded-image cache)."""
    t0 = time.perf_counter()
    threads = int(context.node_config.get(THREADS_KEY, 0))
    if threads > 0 and torch.get_num_threads() != threads:  # nodes sharing a machine share its cores
        torch.set_num_threads(threads)
    config_text, meta = str(job["config"]), federation_from(job)
    root, index = str(context.node_config.get(DATA_ROOT_KEY, "")), node_index(context)
    record = tuple(sorted((k, str(v)) for k, v in job.items() if k.startswith("fed_")))
    key = (config_text, root, index, record)
    if key not in _CACHE:
        _CACHE.clear()
        cfg = node_config_of(config_text, root)
        data = None
        if cfg.data.source == "partition":  # a fresh process reads it from the node's disk cache
            data, _ = node_data(
                lambda: build_data(cfg),
                lambda d: clients_on(cfg, d.num_clients, index),
                cache_key(config_text, str(resolve_root(cfg.data.root).resolve()), index),
            )
        _CACHE[key] = build_node(cfg, index, root, meta, data, record_level(job))
    return _CACHE[key], time.perf_counter() - t0


def node_clients(
    cfg: Config,
    index: int,
    root: str,
    meta: ClientMeta | None,
    data: FederatedData | None = None,
    disclosed: str = "classes",
) -> tuple[FederatedData, ClientMeta, list[int]]:
    """Node ``index``'s view of the federation, the algorithm's context counts and its clients. A simulated
    partition is built from the config (every node the same) and the node keeps clients
    ``c % engine.nodes == index``; node-local data is read from the node's root alone, its clients
    ``index·k .. index·k + k - 1``, the counts the server sent (``meta``, at level ``disclosed``). Either
    way the context's counts are :func:`~fedskew.engine.need_to_know.node_view` at the method's declared
    ``federation_counts``, whatever more the node knows or was sent; a record disclosing less than the
    method needs is a one-line error. ``data``: the simulated partition, already built (or read from the
    node's cache)."""
    need = ALGORITHMS.get(cfg.algorithm.name).federation_counts
    if cfg.data.source == "partition":
        data = build_data(cfg) if data is None else data
        owned = clients_on(cfg, data.num_clients, index)
        return data, node_view(ClientMeta.of(data), owned, need), owned
    if meta is None:
        raise FedskewError("data.source=nodes: the message carries no federation record")
    if not covers(check_level(disclosed, "the federation record's fed_need"), need):
        raise FedskewError(
            f"the federation record discloses '{disclosed}' counts; {cfg.algorithm.name} needs '{need}'"
        )
    owned = clients_on(cfg, meta.num_clients, index)
    local = load_node(cfg, index, node_root(cfg, root, index))
    return spread(local, owned[0], meta.num_clients), node_view(meta, owned, need), owned


def build_node(
    cfg: Config,
    index: int,
    root: str = "",
    meta: ClientMeta | None = None,
    data: FederatedData | None = None,
    disclosed: str = "classes",
) -> NodeRuntime:
    """The runtime of node ``index``: its clients' samples (training samples as stored, normalised when
    read; evaluation splits of the owned clients only) and the algorithm, its context the node's view of
    the counts (:func:`node_clients`; ``disclosed``: the level of the record ``meta`` came in)."""
    data, meta, owned = node_clients(cfg, index, root, meta, data, disclosed)
    if cfg.engine.deterministic:  # the node trains: the switch applies here, not only on the server
        use_deterministic_algorithms()
    algorithm, models = algorithm_of(cfg, meta)  # each node resolves engine.device=auto on its own machine
    device = models.device
    rt = ClientRuntime(
        algorithm, client_data(data, device, owned), models, cfg.client, cfg.seed, cfg.rounds, device,
        cfg.engine.on_client_error, cfg.engine.precision,
    )  # fmt: skip
    ds = data.dataset
    normalise = ds.normaliser()
    val = data.val_idx or [torch.zeros(0, dtype=torch.long) for _ in range(data.num_clients)]
    splits = {
        c: Split(
            ds.x_test[data.test_idx[c]].to(device),
            ds.y_test[data.test_idx[c]].to(device),
            normalise(ds.x_train[val[c]]).to(device),
            ds.y_train[val[c]].to(device),
        )
        for c in owned
    }
    batch = cfg.eval.batch_size or EVAL_BATCH.get(device.type, EVAL_BATCH_OTHER)
    whole = None
    if cfg.data.source == "nodes":
        own_val = torch.cat([val[c] for c in owned])
        whole = Split(
            ds.x_test.to(device), ds.y_test.to(device),
            normalise(ds.x_train[own_val]).to(device), ds.y_train[own_val].to(device),
        )  # fmt: skip
    return NodeRuntime(cfg, rt, owned, splits, normalise, batch, whole)


# ---------------------------------------------------------------------- versioned client states
def load_version(node: NodeRuntime, store: Versions, cid: int, version: int) -> State:
    """Client ``cid``'s state version ``version``; a version this node does not hold (the node restarted
    and lost its memory) falls back to the initial state, with a warning."""
    if version == 0:
        return node.rt.initial_state(cid)
    blob = store.get(cid, version)
    if blob is None:
        log.warning("client %d: state of round %d lost (node restarted); re-initialised", cid, version)
        return node.rt.initial_state(cid)
    return state_from_bytes(blob)


def store_version(store: Versions, cid: int, version: int, state: State) -> None:
    store.put(cid, version, state_to_bytes(state))


def prune(store: Versions, cid: int, referenced: int, keep_from: int) -> None:
    """Drop versions older than the newest referenced version at or below ``keep_from`` (the server's last
    periodic checkpoint): no resume can name them again."""
    floor = store.floor(cid)
    if referenced <= keep_from:
        floor = max(floor, referenced)
    store.set_floor(cid, floor)
    store.drop_below(cid, floor)


# ---------------------------------------------------------------------- handlers
def _owned(node: NodeRuntime, cids: list[int]) -> None:
    stray = sorted(set(cids) - set(node.owned))
    if stray:
        raise ValueError(f"clients {stray} do not live on this node (it owns {node.owned})")


def handle_train(content: RecordDict, context: Context, secure: bool = False) -> RecordDict:
    """Train the message's clients from their payloads and referenced states; reply with the uploads
    (``secure``: a SecAgg+ round's training, :mod:`fedskew.flower.secure`, whose uploads stay on the node; a
    run whose config asks for secure aggregation refuses a plain train message, so a server that skips the
    protocol never sees an upload)."""
    started = time.perf_counter()
    job = config(content, "job")
    node, built = timed_node_runtime(job, context)
    if node.cfg.engine.secagg is not None and not secure:
        raise FedskewError("the run's config sets engine.secagg; the server asked for uploads in the clear")
    r, cids, refs = int(job["round"]), [int(c) for c in job["cids"]], [int(v) for v in job["refs"]]
    _owned(node, cids)
    store = versions_of(context, str(job.get("experiment", "")))
    reply = RecordDict()
    accepted, losses, samples, steps, passes = [], [], [], [], []
    for cid, ref in zip(cids, refs, strict=True):
        prune(store, cid, ref, int(job["keep_from"]))
        payload = get_payload(content, f"p.{cid}", node.rt.device)
        outcome = train_client(node.rt, cid, r, payload, load_version(node, store, cid, ref))
        if outcome.upload is None or outcome.state is None:
            continue
        store_version(store, cid, r, outcome.state)
        put_payload(reply, f"u.{cid}", outcome.upload.payload)
        accepted.append(cid)
        losses.append(float(outcome.loss))
        samples.append(int(outcome.upload.num_samples))
        steps.append(outcome.steps)  # the run's compute (fedskew.engine.compute)
        passes.append(outcome.passes)
    # steps and passes count the client's batches, a statistic of its data size: withheld under local DP
    work = {"steps": steps, "passes": passes} if node.rt.algorithm.discloses_client_statistics else {}
    reply["job"] = ConfigRecord(
        {"accepted": accepted, "loss": losses, "samples": samples, **work, **timings(started, built)}
    )
    return reply


@torch.no_grad()
def _stats(
    node: NodeRuntime, cid: int | None, payload: Payload, state: State | None, x: Any, y: Any, conv: Any
) -> Any:
    """``[correct per head..., loss sum]`` (float64) of ``cid``'s model (``None``: the global model; its
    weights loaded by :func:`_load`) on ``(x, y)``, and the heads."""
    alg = node.rt.algorithm
    model = node.rt.models.model_for(cid)
    dev_state = None if state is None else tree_to(state, node.rt.device)
    if y.numel() == 0:
        return None, []
    s = score(alg, model, payload, dev_state, x, y, node.eval_batch, conv, node.rt.precision)
    heads = list(s.correct)
    row = [float(s.correct[h].double().sum()) for h in heads] + [float(s.loss.double().sum())]
    return torch.tensor(row, dtype=torch.float64), heads


def _load(node: NodeRuntime, cid: int | None, round_idx: int, payload: Payload, state: State | None) -> None:
    """Load what ``cid`` is scored with, adapted on its training data on this node where the method adapts
    (:func:`fedskew.engine.evaluation.load_eval_weights`: the embedded evaluator's path)."""
    rt = node.rt
    dev_state = None if state is None else tree_to(state, rt.device)
    read = None if cid is None else partial(rt.data.view, cid)
    info = RoundInfo(round_idx, cid, rt.seed)
    load_eval_weights(rt.algorithm, rt.models.model_for(cid), payload, dev_state, info, read)


def handle_evaluate(content: RecordDict, context: Context) -> RecordDict:
    """Score what the job's ``scope`` names: ``personal``, each client's own model on its test (and
    validation) split; ``global``, the global model (payload ``p.global``) on each client's splits; ``node``,
    the global model on the node's whole test set and its clients' validation samples (the global protocol
    with node-local data). Reply with counts of correct predictions per head and loss sums per client
    (``test.<cid>``, ``val.<cid>``) or for the node (``test.node``, ``val.node``)."""
    job = config(content, "job")
    node = node_runtime(job, context)
    scope, round_idx = str(job.get("scope", "personal")), int(job["round"])
    cids = [int(c) for c in job["cids"]]
    refs = dict(zip(cids, [int(v) for v in job["refs"]], strict=True))
    _owned(node, cids)
    store = versions_of(context, str(job.get("experiment", "")))
    shared = get_payload(content, "p.global", node.rt.device) if scope != "personal" else None
    targets: list[tuple[str, int | None, Split]] = (
        [("node", None, node.whole)] if scope == "node" and node.whole is not None
        else [(str(cid), cid, node.splits[cid]) for cid in cids]
    )  # fmt: skip
    arrays: dict[str, torch.Tensor] = {}
    heads: list[str] = []
    for name, cid, sp in targets:
        who: int | None = None
        payload, state = shared, None  # the global model, as the embedded evaluator scores it
        if payload is None and cid is not None:  # the client's own model: its payload and its state
            who, payload = cid, get_payload(content, f"p.{cid}", node.rt.device)
            state = load_version(node, store, cid, refs[cid])
        assert payload is not None
        _load(node, who, round_idx, payload, state)  # once for both splits (an adaptation is costly)
        for split, x, y, conv in (
            ("test", sp.x_test, sp.y_test, node.to_float),
            ("val", sp.x_val, sp.y_val, _identity),
        ):
            row, hs = _stats(node, who, payload, state, x, y, conv)
            if row is not None:
                arrays[f"{split}.{name}"] = row
                heads = heads or hs
    return RecordDict({"scores": ArrayRecord(arrays), "job": ConfigRecord({"heads": heads})})


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def handle_query(content: RecordDict, context: Context) -> RecordDict:
    """The node's index, so the server can map clients to Flower node ids (they change on restart); asked
    for its manifest (node-local data), the node loads its own data and describes it."""
    if "job" not in content or MANIFEST not in config(content, "job"):
        return RecordDict({"node": ConfigRecord({"index": node_index(context)})})
    index, root = node_index(context), str(context.node_config.get(DATA_ROOT_KEY, ""))

    def manifest() -> NodeManifest:
        cfg = node_config_of(str(config(content, "job")["config"]), root)
        return node_manifest(cfg, index, node_root(cfg, root, index))[0]

    return manifest_reply(manifest)
