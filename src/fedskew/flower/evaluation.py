"""The Flower server's evaluator: the embedded evaluator where the server holds the test set, the nodes
where the models or the data live on them.

* Simulated partition (``data.source: partition``): the server holds the global test set and scores the
  global model itself; personal models (``eval.protocol: personalized`` with a personalized method) are
  scored on the nodes that hold the clients' states.
* Node-local data (``data.source: nodes``): the server holds no sample, so every metric comes from the
  nodes. ``global`` protocol: each node scores the global model on its whole test set and its clients'
  validation samples (scope ``node``), and the sums give the accuracy over all nodes' test samples, as the
  embedded engine's on the nodes' test sets joined. ``personalized``: each client's model (scope
  ``personal``) or the global model (scope ``global``) on the client's own splits, reduced as the
  embedded evaluator reduces them (:func:`~fedskew.engine.evaluation.client_summary`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from flwr.app import Message, MessageType

from fedskew.algorithms.base import Algorithm, RoundInfo, State
from fedskew.engine.evaluation import Evaluator, client_summary, summarize
from fedskew.errors import FedskewError
from fedskew.experiment.config import Config
from fedskew.flower.records import arrays, config, ref_of


class NodeMessenger(Protocol):
    """What the evaluator needs of the Flower executor (:class:`fedskew.flower.server.FlowerExecutor`):
    the run, where clients live, and messages to their nodes."""

    algorithm: Algorithm
    cfg: Config

    def home(self, cid: int) -> int: ...

    def by_node(self, cids: list[int]) -> tuple[dict[int, list[int]], list[int]]: ...

    def message(self, node: int, kind: str, job: dict[str, Any], payloads: dict[Any, Any]) -> Message: ...

    def ask(self, messages: dict[int, Message]) -> dict[int, Message]: ...


class FlowerEvaluator:
    """A round evaluator over the Flower nodes (see the module docstring for who scores what).

    ``local``: the embedded evaluator on the server's test set (``None``: node-local data). ``test_sizes`` /
    ``val_sizes``: per client; ``node_tests``: the nodes' whole test sets' sizes (node-local data)."""

    def __init__(
        self,
        local: Evaluator | None,
        executor: NodeMessenger,
        test_sizes: list[int],
        val_sizes: list[int],
        node_tests: list[int] | None = None,
    ):
        self.local, self.ex = local, executor
        self.test_sizes, self.val_sizes, self.node_tests = test_sizes, val_sizes, node_tests or []
        cfg = executor.cfg
        self.protocol, self.seed = cfg.eval.protocol, cfg.seed

    @property
    def algorithm(self) -> Algorithm:
        return self.ex.algorithm

    def scope(self) -> str | None:
        """What the nodes score this run (``None``: the server scores the global model itself)."""
        personal = self.protocol == "personalized" and self.algorithm.personalized_eval
        if personal:
            return "personal"
        if self.local is not None:
            return None
        return "global" if self.protocol == "personalized" else "node"

    def evaluate(self, server: State, state_of: Callable[[int], State], round_idx: int) -> dict[str, Any]:
        scope = self.scope()
        if scope is None:
            assert self.local is not None
            return self.local.evaluate(server, state_of, round_idx)
        rows, heads = self.ask(scope, server, state_of, round_idx)
        if scope == "node":
            return self.pooled(rows, heads)
        out = self.combine(rows, "test", self.test_sizes, heads)
        if sum(self.val_sizes):
            val = self.combine(rows, "val", self.val_sizes, heads)
            out.update({f"val_{k}": val[k] for k in ("accuracy", "loss")})
        return out

    def ask(
        self, scope: str, server: State, state_of: Callable[[int], State], round_idx: int
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Every node's score rows (keys ``<split>.<cid>``, or ``<split>.node<i>`` for scope ``node``)."""
        alg, ex = self.algorithm, self.ex
        cids = list(range(len(self.test_sizes)))
        groups, missing = ex.by_node(cids)
        if missing:
            raise FedskewError(f"round {round_idx}: clients {missing} have no online node to evaluate them")

        def payloads(cs: list[int]) -> dict[Any, Any]:
            if scope == "personal":
                return {c: alg.broadcast(server, RoundInfo(round_idx, c, self.seed)) for c in cs}
            return {"global": alg.broadcast(server, RoundInfo(round_idx, None, self.seed))}

        job = {"round": round_idx, "scope": scope}
        messages = {
            node: ex.message(
                node, MessageType.EVALUATE, {**job, "cids": cs, "refs": [ref_of(state_of(c)) for c in cs]},
                payloads(cs),
            )
            for node, cs in groups.items()
        }  # fmt: skip
        replies = ex.ask(messages)
        rows: dict[str, torch.Tensor] = {}
        heads: list[str] = []
        for node, cs in groups.items():
            reply = replies.get(node)
            if reply is None or reply.has_error():
                raise FedskewError(f"round {round_idx}: node of clients {cs} did not return its evaluation")
            got = arrays(reply.content, "scores").to_torch_state_dict()
            index = ex.home(cs[0])
            rows.update({k.replace(".node", f".node{index}"): v for k, v in got.items()})
            heads = heads or list(config(reply.content, "job")["heads"])
        return rows, heads

    def pooled(self, rows: dict[str, torch.Tensor], heads: list[str]) -> dict[str, Any]:
        """The global protocol from the nodes' sums: accuracy and mean loss over all their test samples
        (and ``val_*`` over all their clients' validation samples)."""

        def mean(split: str, total: int) -> torch.Tensor:
            parts = [v for k, v in rows.items() if k.startswith(f"{split}.node")]
            zero = torch.zeros(len(heads) + 1, dtype=torch.float64)  # no node held samples of the split
            return torch.stack([zero, *parts]).sum(0) / max(total, 1)

        test = mean("test", sum(self.node_tests))
        out = summarize({h: test[i].view(1) for i, h in enumerate(heads)}, float(test[-1]), heads)
        if sum(self.val_sizes):
            val = mean("val", sum(self.val_sizes))
            out.update({"val_accuracy": float(val[0]), "val_loss": float(val[-1])})
        return out

    @staticmethod
    def combine(
        rows: dict[str, torch.Tensor], split: str, sizes: list[int], heads: list[str]
    ) -> dict[str, Any]:
        """The nodes' per-client sums reduced as the embedded evaluator reduces its own
        (:func:`~fedskew.engine.evaluation.client_summary`): a client without samples has no row and is left
        out of the means."""
        zero = torch.zeros(len(heads) + 1, dtype=torch.float64)
        table = torch.stack([rows.get(f"{split}.{c}", zero) for c in range(len(sizes))])
        correct = {h: table[:, i] for i, h in enumerate(heads)}
        return client_summary(correct, table[:, -1], torch.tensor(sizes), heads)
