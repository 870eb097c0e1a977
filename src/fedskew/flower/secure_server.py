"""The ServerApp's side of a secure round (:mod:`fedskew.flower.secure` explains the protocol): Flower's
``SecAggPlusWorkflow`` driven through a minimal legacy ``Strategy`` that hands it fedskew's per-node train
messages and takes back the aggregate, then the receipts checked and the method's mean rebuilt."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, FitRes, Parameters, parameters_to_ndarrays
from flwr.serverapp import Grid

from fedskew.algorithms.base import Algorithm, Payload, RoundInfo
from fedskew.algorithms.layouts import expected_layout
from fedskew.engine.folding import FoldedRound, plan_round
from fedskew.engine.policy import client_raised, reply_refused
from fedskew.engine.replies import check_reply, expected_count, layout_problem
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.errors import ConfigError
from fedskew.flower.identity import LOST
from fedskew.flower.records import REF_KEY, config, get_scalars
from fedskew.flower.secure import (
    CLIPPING,
    SECAGG_KEY,
    WEIGHTS,
    array_kind,
    from_bytes,
    node_examples,
    to_bytes,
    workflow_of,
)
from fedskew.settings import SecAggSection

if TYPE_CHECKING:
    from flwr.server.strategy import Strategy

    from fedskew.flower.server import FlowerExecutor

log = logging.getLogger("fedskew.flower")
#: the failures' key of a workflow that raised (no Flower node id is negative)
CRASHED = -1


def collecting_strategy(fitins: Mapping[int, FitIns], grid: Grid) -> Strategy:
    """A legacy Flower ``Strategy`` whose ``configure_fit`` returns ``fitins`` (per node id) and whose
    ``aggregate_fit`` keeps what SecAgg+ gives it (``results``: per node that made the sum its ``FitRes``,
    the aggregate in ``parameters``; ``failures``) instead of aggregating."""
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import Strategy

    class Collect(Strategy):
        def __init__(self) -> None:
            self.results: list[tuple[Any, FitRes]] = []
            self.failures: list[Any] = []

        def initialize_parameters(self, client_manager: Any) -> None:
            return None

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[Any]:
            return [(GridClientProxy(n, grid, 0), ins) for n, ins in fitins.items()]

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> tuple[None, dict]:
            self.results, self.failures = list(results), list(failures)
            return None, {}

        def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any) -> list[Any]:
            return []

        def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> tuple[None, dict]:
            return None, {}

        def evaluate(self, server_round: int, parameters: Any) -> None:
            return None

    return Collect()


class WatchedGrid:
    """The grid as SecAgg+ uses it (``send_and_receive`` only), noting each node's error reply: Flower's
    workflow drops a failed node from the protocol but keeps no record of which one failed, or why."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.errors: dict[int, str] = {}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for m in replies:
            if m.has_error() and m.error.code not in LOST:
                self.errors.setdefault(m.metadata.src_node_id, str(m.error.reason).splitlines()[0][:300])
        return replies


def secure_sum(
    grid: Grid, ex: FlowerExecutor, r: int, fitins: Mapping[int, FitIns]
) -> tuple[list[tuple[int, FitRes]], dict[int, str]]:
    """One SecAgg+ run over ``fitins``' nodes: the ``FitRes`` of each node in the sum (by node id) and the
    one-line error of each node whose ClientApp failed (by node id; :data:`CRASHED`: the workflow raised on
    a message that does not follow the protocol, and there are no results)."""
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

    strategy = collecting_strategy(fitins, grid)
    base = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=strategy)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: r})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    assert ex.cfg.engine.secagg is not None
    watched = WatchedGrid(grid)
    try:
        workflow_of(ex.cfg.engine.secagg, ex.cfg.engine.round_timeout)(cast(Grid, watched), context)
    except Exception as err:  # a node's message Flower's workflow cannot digest (a hostile node)
        text = str(err).splitlines()[0][:120] if str(err) else ""
        return [], {CRASHED: f"{type(err).__name__}: {text}"}
    results = [(int(proxy.node_id), res) for proxy, res in getattr(strategy, "results", [])]
    return results, watched.errors


def check_weights(alg: Algorithm) -> None:
    """SecAgg+ renormalises the planned weights over the nodes that made the sum, which is the method's
    ``mean_weights`` of those clients only for ``n_k / n`` and uniform weights (every built-in mean)."""
    probe = alg.mean_weights([1, 2, 3]).double()
    allowed = (torch.tensor([1.0, 2.0, 3.0]) / 6, torch.full((3,), 1 / 3, dtype=torch.float64))
    if not any(torch.allclose(probe, w.double()) for w in allowed):
        raise ConfigError(
            f"config key 'engine.secagg': the mean weights of '{alg.name}' are neither n_k / n nor uniform, "
            "so they cannot be renormalised over the nodes that make the sum; allowed: such methods only"
        )


@dataclass
class SecureRound:
    """A secure round's bookkeeping: the planned weights, the payloads, the node groups and outcomes."""

    weights: dict[int, float]
    payloads: dict[int, Payload]
    groups: dict[int, list[int]]
    outcomes: dict[int, ClientOutcome] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    summed: dict[int, list[int]] = field(default_factory=dict)  # node -> its clients in the sum


def secure_train(ex: FlowerExecutor, job: RoundJob) -> FoldedRound:
    """Train ``job`` with its mean computed by SecAgg+ (the executor's ``train_folded``)."""
    alg, cfg, r = ex.algorithm, ex.cfg, job.round
    assert cfg.engine.secagg is not None
    check_weights(alg)
    plan = plan_round(alg, job.cids, [expected_count(alg, c) for c in job.cids])
    if plan is None:
        raise ValueError(f"round {r}: a client was sampled twice; SecAgg+ needs one weight per client")
    payloads = {cid: alg.broadcast(job.server, RoundInfo(r, cid, cfg.seed)) for cid in job.cids}
    groups, _ = ex.by_node(job.cids)  # the clients of offline nodes stay dropped
    rnd = SecureRound(plan.weights, payloads, groups)
    rnd.outcomes = {c: ClientOutcome(cid=c, bytes_down=0, dropped=True) for c in job.cids}
    if len(groups) < 2:
        log.warning("round %d: secure aggregation needs 2 nodes with sampled clients, this round has %d; "
                    "its clients are dropped", r, len(groups))  # fmt: skip
        return FoldedRound([rnd.outcomes[c] for c in job.cids], None)
    fitins = {}
    for node, cids in groups.items():
        extra = {WEIGHTS: [plan.weights[c] for c in cids], CLIPPING: cfg.engine.secagg.clipping_range}
        content = ex.content(node, ex.train_job(r, cids, job), {c: payloads[c] for c in cids}, extra)
        fitins[node] = FitIns(Parameters([], ""), {SECAGG_KEY: to_bytes(content)})
    results, failures = secure_sum(ex.map.grid, ex, r, fitins)
    for node, why in failures.items():
        if node == CRASHED:
            for c in (c for cids in groups.values() for c in cids):
                rnd.outcomes[c] = ClientOutcome.received(c, payloads[c])  # rejected: none is in a sum
            what = f"round {r}: secure aggregation failed ({why}); the round's update is discarded"
            reply_refused(cfg.engine.on_client_error, what)
            return FoldedRound([rnd.outcomes[c] for c in job.cids], None)
        cids = groups.get(node, [])
        where = f"node {ex.home(cids[0])} (Flower node {node})" if cids else f"Flower node {node}"
        client_raised(cfg.engine.on_client_error, f"round {r}: clients {cids} failed on {where}: {why}")
    mean = _receive(ex, rnd, r, results)
    if mean is None:
        for o in rnd.outcomes.values():
            o.upload = None
    else:  # each node uploaded one update of the mean's size, counted on its clients in the sum
        size = sum(t.numel() * t.element_size() for t in mean.values())
        for cids in rnd.summed.values():
            for i, c in enumerate(cids):
                rnd.outcomes[c].bytes_up = size // len(cids) + (size % len(cids) if i == 0 else 0)
    return FoldedRound([rnd.outcomes[c] for c in job.cids], mean)


def _receive(
    ex: FlowerExecutor, rnd: SecureRound, r: int, results: list[tuple[int, FitRes]]
) -> dict[str, torch.Tensor] | None:
    """Check every node's receipts and claimed weight, note the outcomes, and rebuild the mean (``None``
    with one line per problem under ``engine.on_client_error`` when the round's sum cannot be used)."""
    claims: list[tuple[list[Any], list[Any]]] = []
    for node, res in results:
        cids = rnd.groups.get(node, [])
        for c in cids:  # in the sum: rejected unless its entry passes
            rnd.outcomes[c] = ClientOutcome.received(c, rnd.payloads[c])
        where = f"node {ex.home(cids[0])} (Flower node {node})" if cids else f"Flower node {node}"
        try:
            receipts = from_bytes(bytes(res.metrics[SECAGG_KEY]))  # type: ignore[arg-type]
            job, layout = config(receipts, "job"), config(receipts, "secagg")
            claims.append((list(layout["names"]), list(layout["delta"])))
        except Exception as err:  # a hostile node's bytes
            rnd.problems.append(f"{where}: unreadable receipts ({type(err).__name__})")
            continue
        _accept(ex, rnd, r, node, where, receipts, job, res.num_examples)
    mean = None
    if results and not rnd.problems:
        try:
            mean = _mean(ex, rnd, r, results[0][1], claims)
        except Exception as err:  # a sum no honest round produces (a hostile masked vector)
            rnd.problems.append(f"the round's sum is unusable ({type(err).__name__}: {str(err)[:100]})")
    for problem in rnd.problems:
        what = f"round {r}: secure aggregation: {problem}; the round's update is discarded"
        reply_refused(ex.cfg.engine.on_client_error, what)
    return None if rnd.problems else mean


def _accept(
    ex: FlowerExecutor, rnd: SecureRound, r: int, node: int, where: str, receipts: RecordDict,
    job: Mapping[str, Any], examples: int,
) -> None:  # fmt: skip
    """A node's receipts checked as any reply (client ids, counts, losses, scalars) and its clear weight
    against the plan; its accepted clients noted as in the sum."""
    cids = rnd.groups.get(node, [])
    checked = check_reply(
        ex.algorithm, RoundInfo(r, None, ex.cfg.seed), cids, job,
        lambda cid: get_scalars(receipts, f"u.{cid}"), rnd.payloads,
        arrays=False,
    )  # fmt: skip
    for cid, problem in checked.refused.items():
        rnd.problems.append(f"{where}: reply for client {cid} refused: {problem}")
    accepted = [e.upload.cid for e in checked.accepted]
    weight = sum(rnd.weights[c] for c in accepted)
    if examples != node_examples(weight):
        rnd.problems.append(f"{where}: weight {examples} / 2^20 is not the plan's {weight:.6g}")
    for entry in checked.accepted:
        o = rnd.outcomes[entry.upload.cid]
        o.accept(entry.upload)
        o.state, o.loss = {REF_KEY: r}, entry.loss
        o.steps, o.passes = entry.steps, entry.passes
    rnd.summed[node] = accepted


def _shape(declared: tuple[int | str, ...], summed: tuple[int, ...]) -> tuple[int, ...]:
    """An array's shape: the method's where the layout fixes it, else the sum's."""
    return tuple(int(d) for d in declared) if all(isinstance(d, int) for d in declared) else summed


def _mean(
    ex: FlowerExecutor, rnd: SecureRound, r: int, res: FitRes, claims: list[tuple[list[Any], list[Any]]]
) -> dict[str, torch.Tensor] | None:
    """``Σ w_k u_k / Σ w_k`` over the clients in the sum: SecAgg+'s mean of the nodes' updates, each array
    scaled back and, where it is a change, plus what was sent. The server derives every array's kind from the
    method's layout and its own broadcast, and refuses a sum that no honest round gives: names or kinds
    other than those, or a mean outside the clipping range (each honest update is clipped to it)."""
    counted = [c for cids in rnd.summed.values() for c in cids]
    if not counted:
        rnd.problems.append("no client's update is in the sum")
        return None
    first = counted[0]
    spec = expected_layout(ex.algorithm, rnd.payloads[first], RoundInfo(r, first, ex.cfg.seed))
    names, arrays = sorted(spec.arrays), parameters_to_ndarrays(res.parameters)
    if len(arrays) != len(names):
        rnd.problems.append(f"the sum holds {len(arrays)} arrays, the method uploads {len(names)}")
        return None
    sent = rnd.payloads[first].arrays
    shapes = [_shape(spec.arrays[n].shape, a.shape) for n, a in zip(names, arrays, strict=True)]
    arrays = [a.reshape(s) for a, s in zip(arrays, shapes, strict=True)]  # 0-d arrays travel as 1-d
    kinds = [
        array_kind(s, spec.arrays[n].dtype.is_floating_point, sent.get(n))
        for n, s in zip(names, shapes, strict=True)
    ]
    if any(claim != (names, [d for d, _ in kinds]) for claim in claims):
        rnd.problems.append("a node's update names other arrays, or other changes, than the method uploads")
        return None
    clip = cast(SecAggSection, ex.cfg.engine.secagg).clipping_range
    largest = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0)
    if largest > clip * (1 + 1e-9):
        rnd.problems.append(f"the sum's mean reaches {largest:.3g}, beyond the clipping range {clip:g}")
        return None
    total = sum(rnd.weights[c] for c in counted)
    mean: dict[str, torch.Tensor] = {}
    for name, (is_delta, scale), value in zip(names, kinds, arrays, strict=True):
        t = torch.from_numpy(np.asarray(value, dtype=np.float64)) * scale
        if is_delta:
            t = t + sum(rnd.weights[c] * rnd.payloads[c].arrays[name].double() for c in counted) / total
        dtype = spec.arrays[name].dtype
        mean[name] = (t if dtype.is_floating_point else t.round()).to(dtype)
    problem = layout_problem(replace(spec, config=None, metrics=None), Payload(arrays=mean))
    if problem is not None:
        rnd.problems.append(f"the securely summed update: {problem}")
    return mean
