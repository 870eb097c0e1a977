"""A Flower ``Grid`` that delivers each message to fedskew's ``ClientApp`` in this process, one ``Context``
per node, with every message's content round-tripped through Flower's wire format (protobuf + ``.npy``
arrays): the apps' code exactly as on a deployment, without processes, so every algorithm can be checked in
seconds. ``pushed`` and ``pulled`` keep what the server sent and received. ``silent`` nodes never reply
(a crashed node); ``faults`` rewrite a node's reply (``None``: the node dies with the message); ``raising``
nodes fail in training (Flower replies with an error)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedskew.flower.apps import client_app


def wire(content: RecordDict) -> RecordDict:
    """``content`` after a trip through Flower's protobuf serialisation."""
    return recorddict_from_proto(recorddict_to_proto(content))


class LoopbackGrid(Grid):
    def __init__(self, nodes: int, first_id: int = 100) -> None:
        # what Flower's runtimes set in a ServerApp process before messages are created
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.contexts: dict[int, Context] = {}
        for i in range(nodes):
            self.add_node(first_id + i, i)
        self.silent: set[int] = set()  # node indexes that never reply
        self.faults: dict[int, Callable[[Message], Message]] = {}
        self.raising: set[int] = set()  # node indexes whose ClientApp raises
        self.replies: dict[str, Message] = {}
        self.bytes_sent = 0
        self.pushed: list[Message] = []  # every message the server pushed, as it pushed it
        self.pulled: list[Message] = []  # every reply the server pulled, after the wire

    def add_node(self, node_id: int, index: int) -> None:
        cfg = {"partition-id": index, "num-partitions": len(self.contexts) + 1}
        self.contexts[node_id] = Context(
            run_id=1, node_id=node_id, node_config=cfg, state=RecordDict(), run_config={}
        )

    def remove_node(self, node_id: int) -> None:
        del self.contexts[node_id]

    # the Grid interface -------------------------------------------------------------------
    def set_run(self, run_id: int) -> None:
        pass

    @property
    def run(self):  # type: ignore[override]
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[override]
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl, group_id=group_id
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            self.pushed.append(msg)
            msg.metadata.__dict__["_message_id"] = mid = str(uuid4())
            ids.append(mid)
            context = self.contexts.get(msg.metadata.dst_node_id)
            index = None if context is None else int(context.node_config["partition-id"])
            if context is None or index in self.silent:
                continue
            received = Message(wire(msg.content), dst_node_id=msg.metadata.dst_node_id,
                               message_type=msg.metadata.message_type)  # fmt: skip
            received.metadata.__dict__["_message_id"] = mid
            self.bytes_sent += len(recorddict_to_proto(msg.content).SerializeToString())
            try:
                if index in self.raising and msg.metadata.message_type == "train":
                    raise RuntimeError(f"node {index} failed")
                reply = client_app(received, context)
                reply = Message(wire(reply.content), reply_to=received)
            except Exception as err:  # Flower turns a ClientApp exception into an error reply
                reply = Message(Error(code=2, reason=str(err)), reply_to=received)
            if index in self.faults:
                reply = self.faults[index](reply)
                if reply is None:  # the node died after receiving the message: no reply comes
                    continue
            self.replies[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = [self.replies.pop(m) for m in list(message_ids) if m in self.replies]
        self.pulled += replies
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
