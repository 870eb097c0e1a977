"""Asynchronous aggregation on the virtual clock: FedAsync (Xie, Koyejo, Gupta 2019) and FedBuff (Nguyen et
al. 2022), for methods that aggregate by a mean (the contract's ``mean_aggregation`` seam).

One :meth:`AsynchronousSimulation.run_round` is one **server update** ``u`` (``rounds`` counts updates;
evaluation, checkpoints and resume happen between updates exactly as between synchronous rounds). Events
are ordered by virtual time alone, never by the wall clock, so a run is deterministic per seed:

1. **Start.** While fewer than ``clock.concurrency`` clients are in flight, the server starts the online
   clients with the smallest keys of row ``u`` of the seed's sampling stream (:meth:`VirtualClock.pick`)
   among those neither in flight nor already started or arrived during update ``u`` (so a client's
   training seed ``(seed, u, cid)`` is used once, and it always starts from its committed state). They get
   the current model (version ``self.round``) and are trained at once, in one executor job of round ``u``;
   each finishes at ``now + duration(steps, bytes)``. A client that drops out (``clock.dropout``) is *lost*:
   it holds its slot until ``now + download time`` and never arrives.
2. **Arrive.** Flights land in order of ``(finish_time, cid)``; ``now`` follows them. An accepted upload
   enters the buffer; a rejected one (``engine.on_client_error``) or a lost client only frees its slot.
   Freed slots are refilled (step 1) once every flight landing at the same instant has landed, as in
   FedBuff's Algorithm 1 (the server keeps ``concurrency`` clients busy). The update closes when the buffer
   holds ``K`` uploads (FedAsync: 1; FedBuff: ``clock.buffer``).
3. **Nobody left.** With nothing in flight, nobody startable and the buffer short: under ``availability:
   trace``, an empty buffer waits for the next virtual hour (at most 24 times: a day repeats); otherwise
   the update closes with the uploads it has (none: it is skipped and the server kept, like a synchronous
   round whose clients were all rejected).
4. **Aggregate** (:data:`MIXERS`), uploads by client id, staleness ``τ = self.round − start version``:
   FedBuff ``x + η_g Σ w_i s(τ_i) (u_i − b_i)`` with ``b_i`` the model client ``i`` started from, computed
   as the weighted mean of the rebased uploads ``x + s_i (u_i − b_i)`` (``u_i`` itself when ``s_i = 1`` and
   ``b_i = x``), so that with ``K = m``, no staleness and ``η_g = 1`` it is synchronous FedAvg bit for bit;
   FedAsync ``(1 − α s(τ)) x + α s(τ) u``. The result goes through the method's own ``server_step``.
5. **Commit** as a synchronous round does: the arrived clients' states, the server, counters and record.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedskew.algorithms.base import (
    Algorithm,
    MeanInfo,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    receipt,
    uniform_weights,
    weighted_average,
)
from fedskew.algorithms.messages import MODEL_PREFIX
from fedskew.engine.clock import HOUR, VirtualClock
from fedskew.engine.clock_config import ClockSection
from fedskew.engine.evaluation import RoundEvaluator
from fedskew.engine.executors import Executor
from fedskew.engine.loop import RoundOutcome, RoundPlan, Simulation, check_no_state_on_self
from fedskew.engine.policy import check_rejected
from fedskew.engine.states import ClientStates, JobStates
from fedskew.engine.table_store import TableStore
from fedskew.engine.types import ClientOutcome, RoundJob, tree_to
from fedskew.errors import ConfigError

__all__ = ["MIXERS", "STALENESS", "AsynchronousSimulation", "Flight", "MixInput", "staleness_weight"]

#: ``clock.staleness`` -> ``s(τ; a, b)`` (Xie et al. 2019, §5.2): constant, polynomial, hinge
STALENESS: dict[str, Callable[[float, float, int], float]] = {
    "constant": lambda tau, a, b: 1.0,
    "polynomial": lambda tau, a, b: (tau + 1.0) ** (-a),
    "hinge": lambda tau, a, b: 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0),
}
#: what each rule's staleness function is evaluated at, from τ = server updates since the client started:
#: FedAsync's ``t − τ`` counts the server epoch being written (Xie et al. 2019, Alg. 1: a worker that got
#: the latest model ``x_{t−1}`` has ``t − τ = 1``); FedBuff's ``s(τ) = 1/√(1 + τ)`` has τ = 0 when fresh
STALENESS_SHIFT = {"fedasync": 1, "fedbuff": 0}
#: an empty buffer waits at most this many virtual hours for a client to come online (a trace's day)
MAX_WAITS = 24


def staleness_weight(name: str, tau: float, a: float, b: int) -> float:
    """``s(τ)`` of ``clock.staleness`` ``name`` with parameters ``a`` and ``b``."""
    return STALENESS[name](tau, a, b)


@dataclass(frozen=True)
class Flight:
    """A started client: its start version and times, its trained outcome (``None``: lost, it dropped out)
    and ``base``, the arrays of the payload it trained from for the keys its upload has (references to
    the server's tensors, which are never changed in place)."""

    cid: int
    start_version: int
    start_time: float
    finish_time: float
    outcome: ClientOutcome | None
    base: dict[str, Tensor] = field(default_factory=dict)

    @property
    def upload(self) -> Upload | None:
        return None if self.outcome is None else self.outcome.upload

    def to_plain(self) -> dict[str, Any]:
        """Plain data for a checkpoint (``torch.load(weights_only=True)``)."""
        o = self.outcome
        return {
            "cid": self.cid,
            "start_version": self.start_version,
            "start_time": self.start_time,
            "finish_time": self.finish_time,
            "base": tree_to(self.base, "cpu"),
            "outcome": None if o is None else outcome_to_plain(o),
        }

    @classmethod
    def from_plain(cls, d: dict[str, Any], device: torch.device) -> Flight:
        o = d["outcome"]
        return cls(
            int(d["cid"]), int(d["start_version"]), float(d["start_time"]), float(d["finish_time"]),
            None if o is None else outcome_from_plain(o, device), tree_to(d["base"], device),
        )  # fmt: skip


def outcome_to_plain(o: ClientOutcome) -> dict[str, Any]:
    up = o.upload
    upload = None
    if up is not None:
        p = up.payload
        upload = {"num_samples": up.num_samples, "arrays": tree_to(p.arrays, "cpu"), "config": dict(p.config),
                  "metrics": dict(p.metrics)}  # fmt: skip
    scalars = {k: getattr(o, k) for k in ("cid", "bytes_down", "params_down", "loss", "dropped", "bytes_up",
                                          "params_up", "steps", "passes")}  # fmt: skip
    return {**scalars, "state": o.state, "upload": upload}


def outcome_from_plain(d: dict[str, Any], device: torch.device) -> ClientOutcome:
    up = d["upload"]
    upload = None
    if up is not None:
        payload = Payload(tree_to(up["arrays"], device), dict(up["config"]), dict(up["metrics"]))
        upload = Upload(int(d["cid"]), int(up["num_samples"]), payload)
    return ClientOutcome(
        cid=int(d["cid"]), bytes_down=int(d["bytes_down"]), params_down=int(d["params_down"]), upload=upload,
        state=d["state"], loss=float(d["loss"]), dropped=bool(d["dropped"]), bytes_up=int(d["bytes_up"]),
        params_up=int(d["params_up"]), steps=int(d["steps"]), passes=int(d.get("passes", 0)),
    )  # fmt: skip


@dataclass
class Gathered:
    """What update ``u`` gathered before it commits: the time, the flights still out, the buffer (accepted
    arrivals), every arrival with an outcome, the lost clients, the clients touched (started or landed)."""

    now: float
    flights: list[Flight]
    buffer: list[Flight] = field(default_factory=list)
    arrived: list[Flight] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    touched: set[int] = field(default_factory=set)

    def land(self, f: Flight) -> None:
        self.now = max(self.now, f.finish_time)
        self.touched.add(f.cid)
        if f.outcome is None:
            self.lost.append(f.cid)
            return
        self.arrived.append(f)
        if f.outcome.upload is not None:
            self.buffer.append(f)

    def same_instant(self) -> bool:
        """Whether another flight lands at ``now`` (they all land before the slots are refilled)."""
        return bool(self.flights) and self.flights[0].finish_time <= self.now


# ---------------------------------------------------------------------------- mixing (contract v4 seam)
@dataclass(frozen=True)
class MixInput:
    x: dict[str, Tensor]  # the current global payload's arrays
    uploads: list[dict[str, Tensor]]  # the buffer's upload arrays, by client id
    bases: list[dict[str, Tensor]]  # the payload arrays each client started from
    stale: list[float]  # s(τ_i)
    weights: Tensor  # the mean's weights
    #: the model's buffers (BatchNorm running statistics): averaged as the plain weighted mean of the
    #: uploads, never extrapolated (x + s (u − b) can make a running variance negative)
    buffers: frozenset[str] = frozenset()


def _affine(x: Tensor, y: Tensor, a: float, b: float) -> Tensor:
    """``a x + b y`` (integer entries computed in float64 and rounded back)."""
    if x.is_floating_point():
        return x.mul(a).add_(y, alpha=b)
    return (a * x.double() + b * y.double()).round().to(x.dtype)


def rebased(x: Tensor, u: Tensor, b: Tensor, s: float) -> Tensor:
    """Upload ``u`` of a client that started from ``b``, moved onto ``x`` and scaled: ``x + s (u − b)``;
    ``u`` itself when ``s = 1`` and ``b = x`` (exactly: a fresh client's upload is untouched)."""
    if s == 1.0 and (b is x or torch.equal(b, x)):
        return u
    if not u.is_floating_point():
        return (x.double() + s * (u.double() - b.double())).round().to(u.dtype)
    return u + (x - b) if s == 1.0 else x + s * (u - b)


def fedbuff_mix(m: MixInput, server_lr: float) -> dict[str, Tensor]:
    """FedBuff: ``x + η_g Σ_i w_i s(τ_i) (u_i − b_i)`` as the weighted mean of the rebased uploads, then
    ``η_g`` (``η_g = 1``: the mean itself)."""
    moved = [
        {k: u[k] if k in m.buffers else rebased(m.x[k], u[k], b[k], s) for k in u}
        for u, b, s in zip(m.uploads, m.bases, m.stale, strict=True)
    ]
    mean = weighted_average(moved, m.weights)
    if server_lr == 1.0:
        return mean
    return {
        k: v if k in m.buffers else _affine(m.x[k], v, 1.0 - server_lr, server_lr) for k, v in mean.items()
    }


def fedasync_mix(m: MixInput, alpha: float) -> dict[str, Tensor]:
    """FedAsync: ``(1 − α_t) x + α_t u`` with ``α_t = α s(τ)``, the client's model itself (one upload)."""
    (u,), (s,) = m.uploads, m.stale
    a = alpha * s
    return {k: v if a == 1.0 else _affine(m.x[k], v, 1.0 - a, a) for k, v in u.items()}


#: ``clock.aggregation`` -> the mixed "mean" handed to ``server_step``, from the clock section's parameters
MIXERS: dict[str, Callable[[MixInput, ClockSection], dict[str, Tensor]]] = {
    "fedbuff": lambda m, c: fedbuff_mix(m, c.server_lr),
    "fedasync": lambda m, c: fedasync_mix(m, c.mixing),
}


def check_rebasable(algorithm: Algorithm, aggregation: str, x: dict[str, Tensor], f: Flight) -> None:
    """Every upload key must be model-like: in the global payload and the client's, with their shape."""
    assert f.upload is not None
    for key, v in f.upload.payload.arrays.items():
        ok = key in x and key in f.base and x[key].shape == v.shape == f.base[key].shape
        if not ok:
            raise ConfigError(
                f"clock.aggregation={aggregation} mixes models: {algorithm.name}'s uploads carry {key}, "
                "which its global broadcast does not (with that shape); allowed: methods whose uploads are "
                "models (fedavg, fedprox, fedavgm, fedopt, ...)"
            )


# ---------------------------------------------------------------------------- the transaction
class AsynchronousSimulation(Simulation):
    """Server updates of FedAsync / FedBuff on the virtual clock (module docstring)."""

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
        if clock is None or not clock.cfg.asynchronous:
            raise ConfigError("asynchronous aggregation needs clock.aggregation; allowed: fedasync, fedbuff")
        super().__init__(
            algorithm, server, plan, executor=executor, evaluator=evaluator, states=states, tables=tables,
            clock=clock,
        )  # fmt: skip
        self.vclock = clock
        self.folding = False  # the mean is mixed here, from held uploads
        cfg = clock.cfg
        self.concurrency = cfg.concurrency or clock.m
        self.k = 1 if cfg.aggregation == "fedasync" else (cfg.buffer or clock.m)
        self.flights: list[Flight] = []  # in flight, by (finish_time, cid)
        # the model's buffers under their payload names (``model.`` + the state name)
        template = algorithm.ctx.model_template(None)
        self.buffers = frozenset(MODEL_PREFIX + name for name, _ in template.named_buffers())

    # ------------------------------------------------------------------ one server update
    def run_round(self) -> RoundOutcome:
        """Gather the next update's buffer, mix it, evaluate every ``eval.every`` updates, then commit."""
        u = self.round + 1
        t0 = time.perf_counter()
        g = self.gather(u)
        arrived = sorted(g.arrived, key=lambda f: f.cid)
        outcomes = [f.outcome for f in arrived if f.outcome is not None]
        check_rejected(self.plan.on_client_error, u, [o.cid for o in outcomes if o.upload is None])
        t1 = time.perf_counter()
        buffer = sorted(g.buffer, key=lambda f: f.cid)
        update = self.mix(u, buffer) if buffer else None
        server = self.server if update is None else update.state
        t2 = time.perf_counter()
        states = {o.cid: o.state for o in outcomes if o.state is not None}
        traffic = (
            sum(o.bytes_up for o in outcomes if o.upload is not None),
            sum(o.bytes_down for o in outcomes),
        )
        record = None
        if u % self.every == 0 or u == self.rounds:
            record = self._record(u, server, states, outcomes, traffic)
            record.update({} if update is None else update.metrics)
            record.update(self.update_record(g, buffer))
            record = self.algorithm.released(record)
        work, t3 = self.work(outcomes, record is not None), time.perf_counter()  # the landed clients' work
        check_no_state_on_self(self.algorithm, self.allowed_attributes)
        # commit (the store first: nothing else has changed if it raises)
        self.states.commit(u, states)
        self.server, self.round, self.compute = self.tables.commit(u, server), u, self.compute.plus(work)
        self.now, self.flights = g.now, g.flights
        if not buffer:
            self.skipped.append(u)
        self.bytes_up += traffic[0]
        self.bytes_down += traffic[1]
        self.times.train += t1 - t0
        self.times.aggregate += t2 - t1
        self.times.evaluate += t3 - t2
        if record is not None:
            record.update(seconds=t3 - t0, seconds_train=t1 - t0, seconds_eval=t3 - t2)
            self.history.append(record)
        return RoundOutcome(u, record, [o.cid for o in outcomes if o.upload is None])

    def gather(self, u: int) -> Gathered:
        """Start and land clients until update ``u``'s buffer holds ``K`` uploads or nobody is left (module
        docstring, steps 1–3). Bounded: a client starts at most once per update, and waits are counted."""
        g = Gathered(self.now, list(self.flights))
        self.start(u, g)
        waits = 0
        while len(g.buffer) < self.k:
            if not g.flights:
                if waits >= MAX_WAITS or not self.waiting_helps(g):
                    break
                g.now = (math.floor(g.now / HOUR) + 1) * HOUR  # the next virtual hour
                waits += 1
                self.start(u, g)
                continue
            g.land(g.flights.pop(0))
            if len(g.buffer) < self.k and not g.same_instant():
                self.start(u, g)
        return g

    def waiting_helps(self, g: Gathered) -> bool:
        """An empty buffer under trace availability, with clients not yet tried in this update: the next
        hour may bring them online (bernoulli availability is drawn per update, always is always)."""
        untried = len(g.touched) < self.num_clients
        return self.vclock.cfg.availability == "trace" and not g.buffer and untried

    def start(self, u: int, g: Gathered) -> None:
        """Fill the free slots at ``g.now`` (module docstring, step 1); the new flights join ``g.flights``."""
        free = self.concurrency - len(g.flights)
        if free <= 0:
            return
        eligible = self.vclock.online(u, g.now)
        eligible[sorted({f.cid for f in g.flights} | g.touched)] = False
        picked = self.vclock.pick(u, eligible, free)
        if not picked:
            return
        g.touched.update(picked)
        lost = [c for c in picked if self.vclock.drops_out(u, c)]
        train = [c for c in picked if c not in lost]
        job = RoundJob(u, train, self.server, JobStates(self.states, train))  # seeds as sync round u's
        outcomes = self.executor.train(job) if train else []
        new = [self.flight(u, c, g.now, None) for c in lost]
        new += [self.flight(u, o.cid, g.now, o) for o in outcomes]
        g.flights = sorted(g.flights + new, key=lambda f: (f.finish_time, f.cid))

    def flight(self, u: int, cid: int, now: float, outcome: ClientOutcome | None) -> Flight:
        """Client ``cid`` started at ``now`` in update ``u``: it lands after its training and transfers, or,
        lost, once its download is done (then it is noticed and its slot freed)."""
        payload = self.algorithm.broadcast(self.server, RoundInfo(round=u, cid=cid, seed=self.seed))
        if outcome is None:
            return Flight(cid, self.round, now, now + self.vclock.duration(cid, 0, payload.nbytes(), 0), None)
        seconds = self.vclock.duration(cid, outcome.steps, outcome.bytes_down, outcome.bytes_up)
        keys = () if outcome.upload is None else outcome.upload.payload.arrays
        base = {k: payload.arrays[k] for k in keys if k in payload.arrays}
        return Flight(cid, self.round, now, now + seconds, outcome, base)

    def mix(self, u: int, buffer: Sequence[Flight]) -> ServerUpdate:
        """The method's ``server_step`` on the buffer mixed by ``clock.aggregation`` (step 4)."""
        cfg, info = self.vclock.cfg, RoundInfo(round=u, cid=None, seed=self.seed)
        x = self.algorithm.broadcast(self.server, info).arrays
        for f in buffer:
            check_rebasable(self.algorithm, cfg.aggregation, x, f)
        uploads = [f.upload for f in buffer if f.upload is not None]
        counts = [up.num_samples for up in uploads]
        weights = (
            uniform_weights(counts)
            if cfg.buffer_weights == "uniform"
            else self.algorithm.mean_weights(counts)
        )
        shift = STALENESS_SHIFT[cfg.aggregation]
        stale = [
            staleness_weight(cfg.staleness, self.staleness(f) + shift, cfg.staleness_a, cfg.staleness_b)
            for f in buffer
        ]
        mixed = MIXERS[cfg.aggregation](
            MixInput(
                x,
                [up.payload.arrays for up in uploads],
                [f.base for f in buffer],
                stale,
                weights,
                self.buffers,
            ),
            cfg,
        )
        return self.algorithm.server_step(
            self.server, Payload(arrays=mixed), MeanInfo(info, [receipt(up) for up in uploads], weights)
        )

    def staleness(self, f: Flight) -> int:
        """Server updates since ``f``'s client started: ``τ = self.round − start version``."""
        return self.round - f.start_version

    def update_record(self, g: Gathered, buffer: list[Flight]) -> dict[str, Any]:
        """The clock's entries of an update's record: virtual time, the update's length, staleness of the
        buffer, who arrived, who was lost, how many clients are still out."""
        taus = [self.staleness(f) for f in buffer]
        stale = {"staleness_mean": float(np.mean(taus)), "staleness_max": max(taus)} if taus else {}
        return {
            "virtual_time": g.now,
            "round_seconds": g.now - self.now,
            **stale,
            "arrived": [f.cid for f in buffer],
            "round_uploads": sum(f.upload is not None for f in buffer),
            "round_steps": sum(f.outcome.steps for f in buffer if f.outcome is not None),
            "dropped_out": sorted(g.lost),
            "in_flight": len(g.flights),
        }

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "flights": [f.to_plain() for f in self.flights]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.flights = [Flight.from_plain(d, self.plan.device) for d in sd.get("flights", [])]
