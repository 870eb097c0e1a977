"""Which Flower node serves which node index, bound for the run, and the exchange of messages with them.

A node's index (``partition-id``) decides which clients it serves (:func:`fedskew.flower.silos.home_of`), so
the index a node reports is not taken on its word (issue 51, item 1):

* **Bound** (a deployment with SuperNode authentication, the default of ``flower-deployment``): SuperNode
  authentication ties each Flower node id to one registered public key (``flwr supernode register`` returns
  the id; the SuperLink checks every request's signature against it), and the deployment that registered
  the keys knows which key it made for which index. It hands the ServerApp that binding (the run config's
  ``node-ids``: :func:`parse_node_ids`). Only those node ids are ever asked anything; a node answering for
  another index than its own is refused with one line naming it; a node that is not in the binding is
  ignored with one line. A restarted node keeps its key and so its id.
* **First claim** (the simulation runtime, ``engine.insecure``, or a deployment started without the
  binding): the first node to claim an index at the index exchange holds it; another node claiming it while
  the holder is online is refused with one line naming both (asked again each round, so a node that
  restarted with a new id while its old id was still listed gets its index back once the old id lapses).
  Without authentication nothing stronger is possible: any process that can reach the SuperLink can claim
  any index first, which is why the deployment is authenticated by default.

Replies are matched to requests by message id, and a reply whose sender is not the node the request went to
is refused with one line (:func:`exchange`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from flwr.app import Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedskew.errors import ConfigError, FedskewError
from fedskew.flower.records import config

log = logging.getLogger("fedskew.flower")

#: the ServerApp's reply polling: from ``POLL_SECONDS[0]``, growing 1.5x per empty poll up to ``[1]``, so a
#: fast round (the simulation) is seen at once and a slow one (a deployment) costs the SuperLink little CPU
POLL_SECONDS = (0.01, 0.1)
#: error codes with which Flower reports a lost message or node (transport, not the client): dropped
LOST = {ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE}
#: run-config key of the binding of node indexes to Flower node ids (``"0:8123,1:9931"``)
NODE_IDS_KEY = "node-ids"


@dataclass
class Timeline:
    """When an exchange's messages were pushed and each node's reply pulled (``time.time()`` seconds)."""

    pushed: float = 0.0
    arrived: dict[int, float] = field(default_factory=dict)


def exchange(
    grid: Grid, messages: dict[int, Message], timeout: float, timeline: Timeline | None = None
) -> dict[int, Message]:
    """Push ``messages`` (by node id), pull replies until all arrived or ``timeout`` seconds passed (their
    times noted in ``timeline``). A reply from another node than the one asked is refused (one line)."""
    if not messages:
        return {}
    nodes = list(messages)
    timeline = timeline if timeline is not None else Timeline()
    timeline.pushed = time.time()  # before the push: a fast node may start before push_messages returns
    ids = list(grid.push_messages([messages[n] for n in nodes]))
    pending = dict(zip(ids, nodes, strict=True))
    replies: dict[int, Message] = {}
    end, delay = time.monotonic() + timeout, POLL_SECONDS[0]
    while pending and time.monotonic() < end:
        arrived = 0
        for reply in grid.pull_messages(list(pending)):
            node = pending.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            if reply.metadata.src_node_id != node:
                log.warning(
                    "a reply to Flower node %d's message came from Flower node %d: refused",
                    node, reply.metadata.src_node_id,
                )  # fmt: skip
                continue
            replies[node] = reply
            timeline.arrived[node] = time.time()
            arrived += 1
        delay = POLL_SECONDS[0] if arrived else min(delay * 1.5, POLL_SECONDS[1])
        if pending:
            time.sleep(min(delay, max(end - time.monotonic(), 0.0)))
    return replies


def parse_node_ids(text: str, nodes: int | None = None) -> dict[int, int]:
    """The binding ``"index:node_id,..."`` of a run config (empty: none); one-line :class:`ConfigError` on a
    malformed entry, a repeated index or node id, or (``nodes`` given) indexes other than ``0..nodes-1``."""
    text = text.strip()
    if not text:
        return {}
    bound: dict[int, int] = {}
    for entry in text.split(","):
        index, sep, node = entry.strip().partition(":")
        if not (sep and index.strip().isdigit() and node.strip().isdigit()):
            raise ConfigError(
                f"run config '{NODE_IDS_KEY}': entry {entry.strip()!r} is not 'index:node_id' (allowed: "
                "non-negative integers, e.g. '0:8123,1:9931')"
            )
        if int(index) in bound or int(node) in bound.values():
            raise ConfigError(f"run config '{NODE_IDS_KEY}': {entry.strip()!r} repeats an index or node id")
        bound[int(index)] = int(node)
    if nodes is not None and sorted(bound) != list(range(nodes)):
        raise ConfigError(
            f"run config '{NODE_IDS_KEY}' binds node indexes {sorted(bound)}; engine.nodes={nodes} needs "
            f"exactly 0..{nodes - 1}"
        )
    return bound


def format_node_ids(bound: Mapping[int, int]) -> str:
    """The run-config value of a binding (:func:`parse_node_ids` reads it back)."""
    return ",".join(f"{i}:{n}" for i, n in sorted(bound.items()))


@dataclass
class NodeMap:
    """Which Flower node id serves which node index: bound by ``bound`` (index -> node id) when given, else
    by first claim (see the module docstring); refreshed every round."""

    grid: Grid
    nodes: int
    timeout: float
    bound: dict[int, int] = field(default_factory=dict)
    index: dict[int, int] = field(default_factory=dict)  # node index -> Flower node id
    online: set[int] = field(default_factory=set)  # Flower lists only nodes whose heartbeat is current
    refused: dict[int, str] = field(default_factory=dict)  # Flower node id -> why (logged once)

    def __post_init__(self) -> None:
        self.owner = {node: i for i, node in self.bound.items()}  # Flower node id -> its bound index

    def refresh(self) -> None:
        """Note which nodes are online, and ask every online node id that holds no index for its index (a
        restarted node may have a new id; a refused one may have been set right); a bound map asks only the
        bound ids."""
        self.online = set(self.grid.get_node_ids())
        holders = set(self.index.values())
        new = [n for n in self.online if n not in holders]
        if self.bound:
            for n in new:
                if n not in self.owner:
                    self.refuse(n, "is not bound to any node index (run config 'node-ids'): ignored")
            new = [n for n in new if n in self.owner]
        if not new:
            return
        query = {
            n: Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY, ttl=self.timeout)
            for n in new
        }
        for node_id, reply in exchange(self.grid, query, self.timeout).items():
            if reply.has_content() and "node" in reply.content.config_records:
                self.claim(node_id, config(reply.content, "node").get("index"))
            else:
                self.refuse(node_id, "answered the index query without a node record: refused")

    def claim(self, node_id: int, claimed: object) -> None:
        """Node ``node_id`` says it is node index ``claimed``: bind it, or refuse it with one line."""
        if isinstance(claimed, bool) or not isinstance(claimed, int) or not 0 <= claimed < self.nodes:
            self.refuse(node_id, f"claims node index {claimed!r} (allowed: 0..{self.nodes - 1}): refused")
            return
        if self.bound and self.owner[node_id] != claimed:
            why = f"is bound to node index {self.owner[node_id]} but claims node index {claimed}: refused"
            self.refuse(node_id, why)
            return
        holder = self.index.get(claimed)
        if holder is not None and holder != node_id and holder in self.online:
            self.refuse(node_id, f"claims node index {claimed}, held by Flower node {holder}: refused")
            return
        if holder is not None and holder != node_id:  # first claim: the holder is no longer listed online
            moves = "node index %d moves from Flower node %d (offline) to Flower node %d"
            log.warning(moves, claimed, holder, node_id)
        self.refused.pop(node_id, None)
        self.index[claimed] = node_id

    def refuse(self, node_id: int, why: str) -> None:
        if self.refused.get(node_id) != why:
            log.warning("Flower node %d %s", node_id, why)
        self.refused[node_id] = why

    def wait_all(self) -> None:
        """Wait (up to the timeout) until every node index has a node; the error names the refused nodes."""
        end = time.monotonic() + self.timeout
        while len(self.index) < self.nodes:
            self.refresh()
            if time.monotonic() > end:
                missing = sorted(set(range(self.nodes)) - set(self.index))
                refused = "; ".join(f"Flower node {n} {why}" for n, why in sorted(self.refused.items()))
                extra = f" (refused: {refused})" if refused else ""
                raise FedskewError(
                    f"Flower nodes {missing} did not connect within {self.timeout:.0f} s{extra}"
                )
            time.sleep(0.1 if len(self.index) < self.nodes else 0)

    def index_of(self, node_id: int) -> int | None:
        """The node index Flower node ``node_id`` serves (``None``: none)."""
        return next((i for i, n in self.index.items() if n == node_id), None)

    def node_of(self, index: int) -> int | None:
        """The online Flower node id of node ``index`` (None: the node is offline; its clients are dropped
        at once instead of waiting for a reply that cannot come)."""
        node = self.index.get(index)
        return node if node in self.online else None


_MAPS: dict[int, NodeMap] = {}


def node_map(grid: Grid, nodes: int, timeout: float, bound: Mapping[int, int] | None = None) -> NodeMap:
    """The grid's node map, shared by the experiments a ServerApp runs in turn (nodes answer once)."""
    bound = dict(bound or {})
    cached = _MAPS.get(id(grid))
    if cached is None or cached.grid is not grid or cached.nodes != nodes or cached.bound != bound:
        _MAPS.clear()
        _MAPS[id(grid)] = cached = NodeMap(grid, nodes, timeout, bound)
    cached.timeout = timeout
    return cached
