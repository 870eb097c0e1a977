"""The round loop. Algorithms never write it; every algorithm runs through this one, on every runtime.

A :class:`Simulation` is the round transaction of a federation for one algorithm and one seed. It is
given, at construction, the three parts a runtime supplies, each a typed protocol:

* an :class:`~fedskew.engine.executors.Executor` that trains a round's sampled clients (the embedded
  engine's, in this machine's processes; the Flower server's, on the nodes that own the clients);
* a :class:`~fedskew.engine.evaluation.RoundEvaluator` that scores a (server, client states) pair;
* a :class:`~fedskew.engine.states.ClientStates` store of the clients' committed states (the states
  themselves, or, for Flower, references to the versions the nodes keep).

A round is a transaction: sample (pre-drawn stream), let the executor train the sampled clients
(broadcast, local training, upload; failures follow :mod:`fedskew.engine.policy`), aggregate, evaluate
the new state every ``eval.every`` rounds, and only then commit the server state, the clients' states,
the counters and the metrics record together. An exception anywhere leaves the previous round's state,
which is what a checkpoint written on failure or interrupt holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from fedskew.algorithms.base import Algorithm, ContractError, MeanInfo, Payload, RoundInfo, State
from fedskew.algorithms.steps import RoundSkipped
from fedskew.engine.clock import RoundTiming, Selection, VirtualClock
from fedskew.engine.compute import Compute, round_compute
from fedskew.engine.evaluation import RoundEvaluator
from fedskew.engine.executors import Executor
from fedskew.engine.folding import FoldingExecutor, folds_uploads
from fedskew.engine.policy import check_rejected
from fedskew.engine.sampling import Schedule
from fedskew.engine.states import ClientStates, JobStates
from fedskew.engine.table_store import TableStore
from fedskew.engine.types import ClientOutcome, RoundJob, tree_to
from fedskew.errors import ConfigError

log = logging.getLogger("fedskew.engine")


@dataclass
class RoundTimes:
    train: float = 0.0
    aggregate: float = 0.0
    evaluate: float = 0.0


@dataclass
class RoundOutcome:
    round: int
    record: dict[str, Any] | None  # metrics record when the round was evaluated
    rejected: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RoundPlan:
    """What the transaction follows besides its parts: the pre-drawn sample of clients of every round
    (row ``r − 1`` for round ``r``, :func:`fedskew.engine.sampling.client_schedule`), the number of
    clients, how often to evaluate, the run's seed, ``engine.on_client_error`` and the device the server
    state lives on."""

    schedule: Schedule
    num_clients: int
    every: int
    seed: int
    on_client_error: str = "drop_non_finite"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fold_uploads: bool = True  # engine.fold_uploads (fedskew.engine.folding)
    #: the clients an evaluation adapts (:func:`fedskew.engine.compute.adapted_clients`): counted compute
    eval_adapted: tuple[int, ...] = ()

    @property
    def rounds(self) -> int:
        return len(self.schedule)


def check_no_state_on_self(algorithm: Algorithm, allowed: frozenset[str]) -> None:
    """Contract rule 2 at run time: a hook that ran in this process added an attribute to the algorithm object
    that its class does not declare in ``working_buffers`` (a cache that is not a pure function of the context
    would make a run depend on which process ran which hook). One line, before the round commits."""
    extra = sorted(set(vars(algorithm)) - allowed)
    if extra:
        raise ContractError(
            f"{algorithm.name}: a hook set {', '.join(extra)} on the algorithm object; declare caches that "
            "are pure functions of the context in working_buffers, keep per-round values in LocalPlan.derived"
        )


def layout(server: State) -> dict[str, str]:
    """The server state's top-level keys and the kind of each value (``tensor``, ``dict``, ``ServerTable``,
    ...): what a checkpoint must match to be resumed by this version of the method."""
    return {k: type(v).__name__ for k, v in sorted(server.items())}


class Simulation:
    """The round transaction of one federation (see the module docstring)."""

    def __init__(
        self,
        algorithm: Algorithm,
        server: State,
        plan: RoundPlan,
        *,
        executor: Executor,
        evaluator: RoundEvaluator,
        states: ClientStates,
        tables: TableStore | None = None,
        clock: VirtualClock | None = None,
    ) -> None:
        self.algorithm, self.server, self.plan = algorithm, server, plan
        # the virtual clock (fedskew.engine.clock): who is sampled, who makes the round, virtual time
        self.clock, self.now = clock, 0.0
        self.executor, self.evaluator, self.states = executor, evaluator, states
        # the server state's per-client tables (spilled beyond a budget; checkpointed as plain data)
        self.tables = tables if tables is not None else TableStore(device=plan.device)
        self.schedule, self.num_clients, self.rounds = plan.schedule, plan.num_clients, plan.rounds
        self.every, self.seed = plan.every, plan.seed
        # the method's mean folded as uploads arrive, where it declares a mean and the executor can
        self.folding = (
            plan.fold_uploads
            and folds_uploads(algorithm)
            and isinstance(executor, FoldingExecutor)
            and not (clock is not None and clock.cfg.cuts_after_training)  # the fold needs every client
        )
        self.folded_rounds = 0  # rounds whose mean was folded (the others aggregated the held uploads)
        # rule 2, "no state on self": what a hook may add to the algorithm object (Algorithm.working_buffers)
        self.allowed_attributes = frozenset(vars(algorithm)) | algorithm.working_buffers
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self.skipped: list[int] = []  # rounds in which every sampled client was rejected
        self.bytes_up = 0
        self.bytes_down = 0
        self.times = RoundTimes()
        self.compute = Compute()  # the work spent (fedskew.engine.compute), committed with each round

    def client_state(self, cid: int) -> State:
        """The client's committed state (CPU); a client never trained gets its initial state."""
        return self.states.get(cid)

    def close(self) -> None:
        """Release the executor's resources, if any (worker processes; the simulation stays usable: a later
        round starts them again)."""
        self.executor.close()

    # ------------------------------------------------------------------ one round
    def run_round(self) -> RoundOutcome:
        """Run the next round; evaluates when ``round % eval.every == 0`` or at the last round. Commits the
        server state, client states, counters and record together, once everything succeeded."""
        r = self.round + 1
        selection = self.sample(r)
        cids = selection.train
        t0 = time.perf_counter()
        job = RoundJob(r, cids, self.server, JobStates(self.states, cids), step_limits=selection.step_limits)
        outcomes, mean = self.train(job)
        timing = None if self.clock is None else self.clock.settle(outcomes, selection)
        outcomes = outcomes if timing is None else timing.outcomes
        rejected = [o.cid for o in outcomes if o.upload is None and not o.dropped]
        check_rejected(self.plan.on_client_error, r, rejected)
        uploads = [o.upload for o in outcomes if o.upload is not None]
        if not uploads:
            why = "every sampled client was rejected" if cids else "no client could train (the virtual clock)"
            log.warning("round %d: %s; the round is skipped", r, why)
        t1 = time.perf_counter()
        info = RoundInfo(round=r, cid=None, seed=self.seed)
        update = None
        if mean is not None:  # folded (every client accepted): the mean, the uploads without arrays
            weights = self.algorithm.mean_weights([u.num_samples for u in uploads])
            update = self.algorithm.server_step(
                self.server, Payload(arrays=mean), MeanInfo(info, uploads, weights)
            )
        elif uploads:
            try:
                update = self.algorithm.aggregate(self.server, uploads, info)
            except RoundSkipped as why:  # the method kept the server state (e.g. defence.too_few: skip)
                log.warning("round %d: %s; the round is skipped", r, why)
                uploads = []
        server = self.server if update is None else update.state
        t2 = time.perf_counter()
        states = {o.cid: o.state for o in outcomes if o.state is not None}
        up = sum(o.bytes_up for o in outcomes if o.upload is not None)
        traffic = up, sum(o.bytes_down for o in outcomes)
        record = None
        if r % self.every == 0 or r == self.rounds:
            record = self._record(r, server, states, outcomes, traffic)
            record.update({"skipped": True} if update is None else update.metrics)
            record.update(self.clock_record(selection, timing))
            record = self.algorithm.released(record)
        work, t3 = self.work(outcomes, record is not None), time.perf_counter()
        check_no_state_on_self(self.algorithm, self.allowed_attributes)
        # commit (the store first: nothing else has changed if it raises)
        self.states.commit(r, states)
        self.server, self.round, self.compute = self.tables.commit(r, server), r, self.compute.plus(work)
        self.now += 0.0 if timing is None else timing.seconds
        if not uploads:
            self.skipped.append(r)
        self.folded_rounds += mean is not None
        self.bytes_up += traffic[0]
        self.bytes_down += traffic[1]
        self.times.train += t1 - t0
        self.times.aggregate += t2 - t1
        self.times.evaluate += t3 - t2
        if record is not None:
            record.update(seconds=t3 - t0, seconds_train=t1 - t0, seconds_eval=t3 - t2)
            self.history.append(record)
        return RoundOutcome(r, record, [o.cid for o in outcomes if o.upload is None])

    def work(self, outcomes: list[ClientOutcome], evaluated: bool) -> Compute:
        """The round's compute (:func:`fedskew.engine.compute.round_compute`), committed with it."""
        return round_compute(self.algorithm, outcomes, self.plan.eval_adapted, evaluated)

    def train(self, job: RoundJob) -> tuple[list[ClientOutcome], dict[str, torch.Tensor] | None]:
        """The executor's outcomes of ``job`` and, when it folded the uploads, their mean (a round in which
        nobody trains, possible on the virtual clock, asks the executor nothing)."""
        if not job.cids:
            return [], None
        if self.folding:
            folded = cast(FoldingExecutor, self.executor).train_folded(job)
            return folded.outcomes, folded.mean
        return self.executor.train(job), None

    def sample(self, r: int) -> Selection:
        """Round ``r``'s clients: the pre-drawn row, or on the virtual clock its online sample less dropouts
        (with step limits under ``late: partial``: the deadline less a round trip of the global payload)."""
        if self.clock is None:
            return Selection(self.schedule[r - 1].tolist(), [])
        partial = None
        if self.clock.cfg.deadline is not None and self.clock.cfg.late == "partial":
            payload = self.algorithm.broadcast(self.server, RoundInfo(round=r, cid=None, seed=self.seed))
            partial = 2.0 * payload.nbytes()
        return self.clock.select(r, self.now, partial)

    def clock_record(self, selection: Selection, timing: RoundTiming | None) -> dict[str, Any]:
        """The clock's entries of a metrics record: the virtual time at the round's end, its length, the
        clients cut by the deadline or over-selection and those that dropped out."""
        if timing is None:
            return {}
        return {
            "virtual_time": self.now + timing.seconds,
            "round_seconds": timing.seconds,
            "late": timing.late,
            "dropped_out": selection.dropped_out,
            "round_steps": timing.steps,
            "round_uploads": sum(o.upload is not None for o in timing.outcomes),
        }

    def _record(
        self,
        r: int,
        server: State,
        states: dict[int, State],
        outcomes: list[ClientOutcome],
        traffic: tuple[int, int],
    ) -> dict[str, Any]:
        """The metrics record of round ``r``'s uncommitted ``server`` and client ``states``; ``traffic``:
        the round's bytes (up, down)."""
        uploads = [o.upload for o in outcomes if o.upload is not None]
        # clients without training data have no loss (NaN): the mean is over the clients that trained
        losses = [o.loss for o in outcomes if o.upload is not None and not np.isnan(o.loss)]

        def state_of(cid: int) -> State:
            return states[cid] if cid in states else self.states.get(cid)

        record: dict[str, Any] = {"round": r, **self.evaluator.evaluate(server, state_of, r)}
        round_up, round_down = traffic
        record.update(
            train_loss=float(np.mean(losses)) if losses else float("nan"),
            bytes_up=self.bytes_up + round_up,
            bytes_down=self.bytes_down + round_down,
            round_bytes_up=round_up,
            round_bytes_down=round_down,
            round_params_up=sum(o.params_up for o in outcomes if o.upload is not None),
            round_params_down=sum(o.params_down for o in outcomes),
            rejected=sum(o.upload is None and not o.dropped for o in outcomes),
        )
        dropped = [o.cid for o in outcomes if o.dropped]
        if dropped:  # clients a distributed runtime lost this round (see docs/deployment.md)
            record["dropped"] = dropped
        if not uploads:  # the server state is the previous round's: nothing was averaged
            record["skipped"] = True
        return record

    def evaluate(self) -> dict[str, Any]:
        """Metrics of the committed server and client states under the configured protocol."""
        return self.evaluator.evaluate(self.server, self.states.get, self.round)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "server": tree_to(self.tables.state_dict(self.server), "cpu"),
            "clients": self.states.state_dict(),
            "history": self.history,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "times": self.times.__dict__.copy(),
            "skipped": list(self.skipped),
            "compute": self.compute.state_dict(),
            **({} if self.clock is None else {"virtual_time": self.now}),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        server = self.tables.load_state_dict(tree_to(sd["server"], self.plan.device))
        if layout(server) != layout(self.server):  # a checkpoint of another layout would fail mid-round
            raise ConfigError(
                f"the checkpoint's server state is {layout(server)}, {self.algorithm.name} here keeps "
                f"{layout(self.server)} (written by another version of the method); start a new run"
            )
        self.round = int(sd["round"])
        self.server = server
        self.states.load_state_dict(sd["clients"])
        self.history = list(sd["history"])
        self.bytes_up = int(sd["bytes_up"])
        self.bytes_down = int(sd["bytes_down"])
        self.times = RoundTimes(**sd.get("times", {}))
        self.skipped = [int(r) for r in sd.get("skipped", [])]
        self.compute = Compute.from_state(sd.get("compute"), self.round)
        self.now = float(sd.get("virtual_time", 0.0))
