"""The round loop. Algorithms never write it; every algorithm runs through this one.

A :class:`Simulation` is an embedded, single-process federation (worker processes optional) for one
algorithm and one seed. A round is a transaction: sample (pre-drawn stream), let the executor train the
sampled clients (broadcast, local training, upload; non-finite updates rejected), aggregate, evaluate the
new state every ``eval.every`` rounds, and only then commit the server state, the clients' states, the
counters and the metrics record together. An exception anywhere leaves the previous round's state, which is
what a checkpoint written on failure or interrupt holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedskew.algorithms.base import Algorithm, Context, HyperParams, RoundInfo, State
from fedskew.data.federated import FederatedData
from fedskew.engine.client import ALLOWED, ClientError
from fedskew.engine.device import resolve_device
from fedskew.engine.evaluation import EVAL_BATCH, EVAL_BATCH_OTHER, EvalData, Evaluator
from fedskew.engine.executors import Executor
from fedskew.engine.modes import make_executor, memory_format
from fedskew.engine.runtime import INIT_KEY, ClientData, ClientRuntime, ModelCache
from fedskew.engine.sampling import derive_seed, sampling_schedule
from fedskew.engine.types import ClientOutcome, RoundJob, tree_to
from fedskew.settings import ClientSection, EngineSection, EvalSection

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


def build_runtime(
    data: FederatedData,
    algorithm_cls: type[Algorithm],
    params: HyperParams,
    models: ModelCache,
    client: ClientSection,
    rounds: int,
    seed: int,
    on_client_error: str = "drop_non_finite",
    precision: str = "fp32",
) -> ClientRuntime:
    """The algorithm (constructed from a context derived from the config alone) and the clients' data on
    the device: what a client process needs, identical in every process of a run."""
    ds = data.dataset
    counts = data.class_counts()
    ctx = Context(
        num_clients=len(data.train_idx),
        num_classes=ds.num_classes,
        in_shape=ds.in_shape,
        device=models.device,
        client=client,
        client_sizes=counts.sum(1),
        class_counts=counts,
        rounds=rounds,
        seed=seed,
        build_model=models.build,
        initial_model=models.initial,
        arch_key=models.arch_key,
        assets=ds.meta.get("assets", {}),
    )
    algorithm = algorithm_cls(params, ctx)
    models.prepare = algorithm.prepare_model
    dev = models.device
    # Training inputs are normalised once and held on the device; clients are index views.
    train = ClientData(
        ds.to_float(ds.x_train).to(dev), ds.y_train.to(dev), [t.to(dev) for t in data.train_idx], counts
    )
    return ClientRuntime(algorithm, train, models, client, seed, dev, on_client_error, precision)


class Simulation:
    """An embedded federation for one algorithm and one seed (see the module docstring)."""

    def __init__(
        self,
        data: FederatedData,
        algorithm_cls: type[Algorithm],
        params: HyperParams,
        build_model: Callable[[int | None], nn.Module],
        arch_key: Callable[[int | None], Any],
        client: ClientSection,
        evaluation: EvalSection,
        engine: EngineSection,
        rounds: int,
        seed: int,
    ) -> None:
        device = resolve_device(engine.device)
        fmt = memory_format(engine.memory_format, device, engine.mode)
        models = ModelCache(build_model, arch_key, device, fmt, seed)
        self.runtime = build_runtime(
            data,
            algorithm_cls,
            params,
            models,
            client,
            rounds,
            seed,
            on_client_error=engine.on_client_error,
            precision=engine.precision,
        )
        self.algorithm = self.runtime.algorithm
        self.engine, self.rounds, self.seed = engine, rounds, seed
        self.every = evaluation.every
        ds = data.dataset
        eval_data = EvalData(
            x_test=ds.x_test.to(device),
            y_test=ds.y_test.to(device),
            to_float=ds.to_float,
            test_idx=[t.to(device) for t in data.test_idx],
            x_train=self.runtime.data.x,
            y_train=self.runtime.data.y,
            val_idx=[t.to(device) for t in (data.val_idx or [])],
        )
        batch = evaluation.batch_size or EVAL_BATCH.get(device.type, EVAL_BATCH_OTHER)
        self.evaluator = Evaluator(
            self.algorithm, models, eval_data, evaluation.protocol, batch, seed, engine.precision
        )
        torch.manual_seed(derive_seed(seed, INIT_KEY))  # same initial model for every algorithm
        self.server: State = self.algorithm.init_server(models.model_for(None))
        self.client_states: dict[int, State] = {}
        #: a client's state before its first round; a runtime keeping states elsewhere (Flower nodes) keeps
        #: only references here and replaces this
        self.initial_client_state: Callable[[int], State] = self.runtime.initial_state
        self.num_clients = len(data.train_idx)
        self.schedule = sampling_schedule(self.num_clients, client.fraction, rounds, seed)
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self.skipped: list[int] = []  # rounds in which every sampled client was rejected
        self.bytes_up = 0
        self.bytes_down = 0
        self.times = RoundTimes()
        self.executor: Executor | None = None  # chosen on the first round (engine.mode)

    def client_state(self, cid: int) -> State:
        """The client's committed state (CPU); a client never trained gets its initial state, which is a
        pure function of the config and is memoised."""
        if cid not in self.client_states:
            self.client_states[cid] = self.initial_client_state(cid)
        return self.client_states[cid]

    def close(self) -> None:
        """Release the worker processes, if any (the simulation stays usable; a later round re-forks)."""
        if self.executor is not None:
            self.executor.close()

    # ------------------------------------------------------------------ one round
    def run_round(self) -> RoundOutcome:
        """Run the next round; evaluates when ``round % eval.every == 0`` or at the last round. Commits the
        server state, client states, counters and record together, once everything succeeded."""
        r = self.round + 1
        cids = self.schedule[r - 1].tolist()
        t0 = time.perf_counter()
        if self.executor is None:
            self.executor = make_executor(self.runtime, self.engine, cids)
        job = RoundJob(r, cids, self.server, {cid: self.client_state(cid) for cid in cids})
        outcomes = self.executor.train(job)
        rejected = [o.cid for o in outcomes if o.upload is None]
        if rejected and self.engine.on_client_error == "fail":
            raise ClientError(
                f"round {r}: update of client {rejected[0]} rejected (non-finite values); the round was not "
                f"committed (engine.on_client_error=fail; {ALLOWED})"
            )
        uploads = [o.upload for o in outcomes if o.upload is not None]
        if not uploads:
            log.warning("round %d: every sampled client was rejected; the round is skipped", r)
        t1 = time.perf_counter()
        info = RoundInfo(round=r, cid=None, seed=self.seed)
        update = self.algorithm.aggregate(self.server, uploads, info) if uploads else None
        server = self.server if update is None else update.state
        t2 = time.perf_counter()
        states = {o.cid: o.state for o in outcomes if o.state is not None}
        traffic = sum(u.payload.nbytes() for u in uploads), sum(o.bytes_down for o in outcomes)
        record = None
        if r % self.every == 0 or r == self.rounds:
            record = self._record(r, server, states, outcomes, traffic)
            record.update({} if update is None else update.metrics)
        t3 = time.perf_counter()
        # commit
        self.server, self.round = server, r
        self.client_states.update(states)
        if not uploads:
            self.skipped.append(r)
        self.bytes_up += traffic[0]
        self.bytes_down += traffic[1]
        self.times.train += t1 - t0
        self.times.aggregate += t2 - t1
        self.times.evaluate += t3 - t2
        if record is not None:
            record.update(seconds=t3 - t0, seconds_train=t1 - t0, seconds_eval=t3 - t2)
            self.history.append(record)
        return RoundOutcome(r, record, rejected)

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
            return states[cid] if cid in states else self.client_state(cid)

        record: dict[str, Any] = {"round": r, **self.evaluator.evaluate(server, state_of, r)}
        round_up, round_down = traffic
        record.update(
            train_loss=float(np.mean(losses)) if losses else float("nan"),
            bytes_up=self.bytes_up + round_up,
            bytes_down=self.bytes_down + round_down,
            round_bytes_up=round_up,
            round_bytes_down=round_down,
            round_params_up=sum(u.payload.num_params() for u in uploads),
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
        return self.evaluator.evaluate(self.server, self.client_state, self.round)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "server": tree_to(self.server, "cpu"),
            "clients": self.client_states,
            "history": self.history,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "times": self.times.__dict__.copy(),
            "skipped": list(self.skipped),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.round = int(sd["round"])
        self.server = tree_to(sd["server"], self.runtime.device)
        self.client_states = sd["clients"]
        self.history = list(sd["history"])
        self.bytes_up = int(sd["bytes_up"])
        self.bytes_down = int(sd["bytes_down"])
        self.times = RoundTimes(**sd.get("times", {}))
        self.skipped = [int(r) for r in sd.get("skipped", [])]
