"""The server side: the embedded round transaction with its clients trained on Flower nodes.

:func:`serve` is the body of the ``ServerApp``: it runs :func:`fedskew.experiment.runner.run_experiment`
(checkpoints, ``metrics.jsonl``, ``summary.json``, ``--resume``) with an assembler,
:func:`server_simulation`, that builds the round transaction from the Flower parts: a
:class:`FlowerExecutor`, which sends each round one ``train`` message per node holding sampled clients
(their broadcast payloads, the round, and references to their states on that node) through Flower's
``Grid`` and turns the replies into the :class:`~fedskew.engine.types.ClientOutcome` list the round loop
expects; a :class:`FlowerEvaluator`, which asks the nodes to score their clients' personal models; and a
client-state store of references (the version number of each client's state on its node). The server
holds the algorithm, the global test set, the validation samples and the clients' counts, never their
training samples (docs/deployment.md).

Faults: a node that does not reply within ``engine.round_timeout`` seconds, or that Flower reports lost
(no heartbeat: ``NODE_UNAVAILABLE``; an expired message), loses its clients for that round (``dropped`` in
the metrics record; the round goes on with the others). A ClientApp that fails (an error reply) and a
non-finite upload follow ``engine.on_client_error`` exactly as a client that raises or diverges in the
embedded engine (:mod:`fedskew.engine.policy`). No reply is trusted: client ids, sample counts, losses and
each upload's arrays are checked against the request and the method's layout before any is used
(:mod:`fedskew.engine.replies`); a refused client follows ``engine.on_client_error`` as a non-finite one.
Which Flower node serves which node index is bound for the run (:mod:`fedskew.flower.identity`): by the
deployment's authenticated node ids, or by first claim without authentication.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedskew.algorithms.base import Algorithm, RoundInfo
from fedskew.engine.assembly import initial_server
from fedskew.engine.compute import adapted_clients
from fedskew.engine.evaluation import Evaluator
from fedskew.engine.folding import FoldedRound
from fedskew.engine.loop import Simulation
from fedskew.engine.policy import client_raised, reply_refused
from fedskew.engine.replies import check_reply
from fedskew.engine.runtime import ModelCache
from fedskew.engine.states import SpillingStates
from fedskew.engine.table_store import TableStore
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.errors import FedskewError
from fedskew.experiment.build import algorithm_of, build_algorithm, build_data, evaluator, probed, round_plan
from fedskew.experiment.config import Config, dump_config
from fedskew.experiment.runner import run_experiment
from fedskew.experiment.silos import federation_meta, with_central
from fedskew.flower.evaluation import FlowerEvaluator
from fedskew.flower.identity import LOST, Timeline, exchange, format_node_ids, node_map, parse_node_ids
from fedskew.flower.records import REF_KEY, config, get_payload, put_payload, ref_of
from fedskew.flower.silos import ask_manifests, home_of, node_federations

log = logging.getLogger("fedskew.flower")

#: per-round transport figures of a Flower run, next to ``metrics.jsonl`` (see ``FlowerExecutor.log_round``)
ROUNDS_FILE = "flower_rounds.jsonl"


def wire_bytes(message: Message) -> int:
    """The bytes Flower transfers for ``message``: the serialized sizes of all its objects (the message,
    its record dict, records and array chunks), each of which is pushed or pulled as one blob."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def experiment_key(config_text: str, out: Path | None) -> str:
    """What names an experiment to the nodes' state folders: its resolved config and output folder (the
    same on a resume, different for two experiments sharing the nodes)."""
    where = str(out.resolve()) if out is not None else ""
    return hashlib.sha256(f"{config_text}\0{where}".encode()).hexdigest()[:20]


class FlowerExecutor:
    """Trains a round's clients on the Flower nodes that own them (an engine executor)."""

    name = "flower"

    def __init__(
        self,
        algorithm: Algorithm,
        grid: Grid,
        cfg: Config,
        device: torch.device,
        out: Path | None = None,
        federation: Mapping[int, dict[str, Any]] | None = None,
        bound: Mapping[int, int] | None = None,
    ) -> None:
        self.algorithm, self.cfg, self.device = algorithm, cfg, device
        self.log_path = out / ROUNDS_FILE if out is not None else None
        self.config_text = dump_config(cfg)
        self.experiment = experiment_key(self.config_text, out)
        self.federation = dict(federation or {})  # node-local data: node index -> its federation record
        self.home = home_of(cfg)
        self.map = node_map(grid, cfg.engine.nodes, cfg.engine.round_timeout, bound)
        self.map.wait_all()

    def ask(self, messages: dict[int, Message], timeline: Timeline | None = None) -> dict[int, Message]:
        """Push ``messages`` (by Flower node id) and collect the replies within ``engine.round_timeout``."""
        return exchange(self.map.grid, messages, self.cfg.engine.round_timeout, timeline)

    def keep_from(self, r: int) -> int:
        """The server's last periodic checkpoint before round ``r`` (what a resume can restart from)."""
        every = self.cfg.checkpoint.every
        return ((r - 1) // every) * every if every else 0

    def content(
        self, node: int, job: dict[str, Any], payloads: dict[int, Any], extra: dict[str, Any] | None = None
    ) -> RecordDict:
        """The content of a message to Flower node ``node``: the job record (with the run's config and that
        node's federation record: the counts its method lets it see, :mod:`fedskew.engine.need_to_know`) and
        the clients' payloads (``p.<cid>``)."""
        index = self.map.index_of(node)
        own = self.federation.get(index, {}) if index is not None else {}
        job = {**job, "config": self.config_text, "experiment": self.experiment, **own, **(extra or {})}
        content = RecordDict({"job": ConfigRecord(job)})
        for cid, payload in payloads.items():
            put_payload(content, f"p.{cid}", payload)
        return content

    def message(self, node: int, kind: str, job: dict[str, Any], payloads: dict[int, Any]) -> Message:
        content = self.content(node, job, payloads)
        return Message(content, dst_node_id=node, message_type=kind, ttl=self.cfg.engine.round_timeout)

    def train_job(self, r: int, cids: list[int], job: RoundJob) -> dict[str, Any]:
        """The job record of round ``r``'s training of ``cids`` on one node (their states by reference)."""
        refs = [ref_of(job.states[c]) for c in cids]
        return {"round": r, "cids": cids, "refs": refs, "keep_from": self.keep_from(r)}

    def by_node(self, cids: list[int]) -> tuple[dict[int, list[int]], list[int]]:
        """The sampled clients grouped by the node id serving them, and those whose node is missing."""
        self.map.refresh()
        groups: dict[int, list[int]] = {}
        missing = []
        for cid in cids:
            node = self.map.node_of(self.home(cid))
            if node is None:
                missing.append(cid)
            else:
                groups.setdefault(node, []).append(cid)
        return groups, missing

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        alg, seed = self.algorithm, self.cfg.seed
        payloads = {cid: alg.broadcast(job.server, RoundInfo(job.round, cid, seed)) for cid in job.cids}
        groups, missing = self.by_node(job.cids)
        messages = {
            node: self.message(
                node, MessageType.TRAIN, self.train_job(job.round, cids, job), {c: payloads[c] for c in cids}
            )
            for node, cids in groups.items()
        }
        t0, timeline = time.perf_counter(), Timeline()
        replies = self.ask(messages, timeline)
        self.log_round(job.round, messages, replies, time.perf_counter() - t0, timeline)
        outcomes: dict[int, ClientOutcome] = {}
        for node, cids in groups.items():
            outcomes.update(self.outcomes(job.round, cids, payloads, replies.get(node)))
        for cid in missing:
            outcomes[cid] = ClientOutcome(cid=cid, bytes_down=0, dropped=True)
        return [outcomes[c] for c in job.cids]

    def log_round(
        self,
        r: int,
        messages: dict[int, Message],
        replies: dict[int, Message],
        seconds: float,
        timeline: Timeline,
    ) -> None:
        """Append round ``r``'s transport figures to ``flower_rounds.jsonl``: messages, wire bytes each way,
        the exchange's wall time and, of the node whose reply came last, its ClientApp process's age,
        runtime build and handler time (see :func:`fedskew.flower.node.timings`), the wait from the push to
        that process's start (``node_seconds_waiting``: the SuperNode's poll and the process launch) and
        from its handler's end to the reply's arrival (``node_seconds_returning``: serialisation, the
        SuperNode's hand-over, transport)."""
        if self.log_path is None:
            return
        keys = ("seconds_process", "seconds_build", "seconds_handler")
        figures = {
            node: config(m.content, "job")
            for node, m in replies.items()
            if m.has_content() and "job" in m.content
        }
        usable = {
            n: f for n, f in figures.items() if all(k in f and not math.isnan(float(f[k])) for k in keys)
        }
        last = max(usable, key=lambda n: timeline.arrived.get(n, 0.0), default=None)
        slowest = usable.get(last) if last is not None else None
        row: dict[str, Any] = {
            "round": r,
            "messages": len(messages),
            "replies": len(replies),
            "wire_bytes_down": sum(wire_bytes(m) for m in messages.values()),
            "wire_bytes_up": sum(wire_bytes(m) for m in replies.values()),
            "seconds_exchange": seconds,
            **{f"node_{k}": None if slowest is None else float(slowest[k]) for k in keys},
        }
        if slowest is not None and last is not None and "time_replied" in slowest:
            started = float(slowest["time_replied"]) - float(slowest["seconds_process"])
            row["node_seconds_waiting"] = started - timeline.pushed
            row["node_seconds_returning"] = timeline.arrived[last] - float(slowest["time_replied"])
        with open(self.log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def outcomes(
        self, r: int, cids: list[int], payloads: dict[int, Any], reply: Message | None
    ) -> dict[int, ClientOutcome]:
        """The outcomes of one node's clients: dropped (no reply), rejected (error reply, client not
        accepted on the node, or refused by the reply's checks: :mod:`fedskew.engine.replies`) or
        accepted."""
        if reply is None or (reply.has_error() and reply.error.code in LOST):
            why = f"within {self.map.timeout:.0f} s" if reply is None else f"({reply.error.reason})"
            log.warning("round %d: no reply for clients %s %s: dropped", r, cids, why)
            return {c: ClientOutcome(cid=c, bytes_down=payloads[c].nbytes(), dropped=True) for c in cids}
        out = {c: ClientOutcome.received(c, payloads[c]) for c in cids}
        if reply.has_error():  # the ClientApp failed: the embedded engine's rule for a client that raises
            what = f"round {r}: clients {cids} failed on their node: {reply.error.reason}"
            client_raised(self.cfg.engine.on_client_error, what)
            return out
        content = reply.content
        job = config(content, "job") if "job" in content.config_records else None
        checked = check_reply(
            self.algorithm, RoundInfo(r, None, self.cfg.seed), cids, job,
            lambda cid: get_payload(content, f"u.{cid}", self.device), payloads,
        )  # fmt: skip
        self.refuse(r, cids, reply, checked.refused)
        for entry in checked.accepted:
            o = out[entry.upload.cid]
            o.accept(entry.upload)
            o.state, o.loss = {REF_KEY: r}, entry.loss
            o.steps, o.passes = entry.steps, entry.passes
        return out

    def refuse(self, r: int, cids: list[int], reply: Message, refused: dict[int, str]) -> None:
        """One line per problem of a node's reply, naming the node, the clients and the problem, under
        ``engine.on_client_error`` (the round fails, or the clients are rejected from it)."""
        by_problem: dict[str, list[int]] = {}
        for cid, problem in refused.items():
            by_problem.setdefault(problem, []).append(cid)
        node = f"node {self.home(cids[0])} (Flower node {reply.metadata.src_node_id})"
        for problem, which in by_problem.items():
            who = f"client {which[0]}" if len(which) == 1 else f"clients {which}"
            what = f"round {r}: {node}: reply for {who} refused: {problem}"
            reply_refused(self.cfg.engine.on_client_error, what)

    def close(self) -> None:
        pass


class SecureFlowerExecutor(FlowerExecutor):
    """A :class:`FlowerExecutor` whose rounds' means come from Flower's SecAgg+ (``engine.secagg``): the
    server sees the sum of the nodes' masked updates, never an upload (:mod:`fedskew.flower.secure`)."""

    def train_folded(self, job: RoundJob) -> FoldedRound:
        from fedskew.flower.secure_server import secure_train

        return secure_train(self, job)

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        """Never: a round that does not fold its mean would see every upload in the clear."""
        raise FedskewError(
            f"round {job.round}: engine.secagg is set but the round does not fold its mean (the uploads "
            "would reach the server in the clear); allowed: a weighted-mean method, engine.fold_uploads=true"
        )


@dataclass
class ServerParts:
    """What the ServerApp builds before the first round: the algorithm and models, the evaluator on its own
    test set (``None``: node-local data), the clients' test / validation sizes, the nodes' test-set sizes
    and each node's federation record, which its messages carry (node-local data)."""

    algorithm: Algorithm
    models: ModelCache
    local: Evaluator | None
    test_sizes: list[int]
    val_sizes: list[int]
    node_tests: list[int] = field(default_factory=list)
    federation: dict[int, dict[str, Any]] = field(default_factory=dict)  # node index -> its record
    classes: list[str] = field(default_factory=list)
    in_shape: tuple[int, ...] = ()


def partition_parts(cfg: Config) -> ServerParts:
    """A simulated partition: the algorithm and the evaluation data (global test set, validation samples)
    built from the config. The clients' training samples are read (the partition needs every label) and
    released before the first round."""
    data = build_data(cfg)
    algorithm, models = build_algorithm(cfg, data)
    test_sizes = [int(t.numel()) for t in data.test_idx]
    val_sizes = [int(t.numel()) for t in data.val_idx] or [0] * len(test_sizes)
    return ServerParts(algorithm, models, evaluator(cfg, algorithm, models, data), test_sizes, val_sizes)


def node_parts(grid: Grid, cfg: Config, bound: Mapping[int, int] | None = None) -> ServerParts:
    """Node-local data: the nodes' manifests, checked against each other before any training, and the
    algorithm built from their counts alone; the server reads no data."""
    timeout = cfg.engine.round_timeout
    nodes = node_map(grid, cfg.engine.nodes, timeout, bound)
    nodes.wait_all()
    manifests = ask_manifests(nodes.index, lambda messages: exchange(grid, messages, timeout), cfg, timeout)
    meta = federation_meta(manifests)
    algorithm, models = algorithm_of(cfg, meta)
    test_sizes = [n for m in manifests for n in m.test_sizes]
    val_sizes = [n for m in manifests for n in m.val_sizes]
    records = node_federations(meta, cfg, type(algorithm).federation_counts)  # need to know
    tests = [m.test_total for m in manifests]
    return ServerParts(
        algorithm, models, None, test_sizes, val_sizes, tests, records,
        list(manifests[0].classes), meta.in_shape,
    )  # fmt: skip


def server_simulation(
    grid: Grid,
    cfg: Config,
    out: Path | None,
    states_dir: Path | None,
    bound: Mapping[int, int] | None = None,
) -> Simulation:
    """The ServerApp's round transaction: the algorithm, the clients' counts for its context, and the
    Flower executor, evaluator and state references (:func:`partition_parts`, :func:`node_parts`).
    ``bound``: node index -> the Flower node id authenticated for it (:mod:`fedskew.flower.identity`)."""
    parts = node_parts(grid, cfg, bound) if cfg.data.source == "nodes" else partition_parts(cfg)
    algorithm, models = parts.algorithm, parts.models
    server = initial_server(algorithm, models, cfg.seed)
    kind = FlowerExecutor if cfg.engine.secagg is None else SecureFlowerExecutor
    executor = kind(algorithm, grid, cfg, models.device, out, parts.federation, bound)
    states = SpillingStates(lambda cid: {REF_KEY: 0}, int(cfg.engine.state_memory_mb * 2**20), states_dir)
    scorer = FlowerEvaluator(parts.local, executor, parts.test_sizes, parts.val_sizes, parts.node_tests)
    adapted = adapted_clients(algorithm, cfg.eval.protocol, parts.test_sizes, parts.val_sizes)  # compute
    return Simulation(
        algorithm,
        server,
        round_plan(cfg, len(parts.test_sizes), adapted),
        executor=executor,
        evaluator=with_central(cfg, scorer, algorithm, models, parts.classes, parts.in_shape)
        if parts.local is None
        else probed(cfg, scorer, parts.local),
        states=states,
        tables=TableStore(int(cfg.engine.state_memory_mb * 2**20), states_dir, models.device),
    )


def serve(
    grid: Grid,
    cfg: Config,
    out: str | Path | None,
    resume: bool,
    force: bool,
    node_ids: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """The ServerApp's body: the whole experiment, with the results files in ``out``; ``node_ids``: the
    Flower node id bound to each node index (:mod:`fedskew.flower.identity`; ``None``: first claim)."""
    if node_ids:
        parse_node_ids(format_node_ids(node_ids), cfg.engine.nodes)  # every index, once
    folder = Path(out) if out is not None else None
    if force and folder is not None:
        (folder / ROUNDS_FILE).unlink(missing_ok=True)

    def assemble(cfg: Config, states_dir: Path | None) -> Simulation:
        return server_simulation(grid, cfg, folder, states_dir, node_ids)

    return run_experiment(cfg, out, resume=resume, force=force, assemble=assemble)
