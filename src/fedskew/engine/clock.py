"""The virtual clock: how long each client takes, who is online, and who makes a round.

Everything here is a pure function of the ``clock:`` section (:mod:`fedskew.engine.clock_config`), the
run's seed, the round and the virtual time, so a run on the clock is deterministic per seed and resumes
exactly from ``virtual_time`` alone (the round loop checkpoints it).

* **Speeds** (:class:`ClientSpeeds`): per client, seconds per local optimizer step and link bandwidth,
  drawn once per seed (or read from a trace file), then slowed ``slow_factor`` times for clients whose
  training data is mostly ``slow_classes``. A client's duration in a round is
  ``steps x step_seconds + (bytes_down + bytes_up) / bytes_per_second`` (:meth:`VirtualClock.duration`).
* **Availability**: ``always``; ``bernoulli`` (online with probability ``available``, drawn per round
  from ``(seed, round, client)``); ``trace`` (the trace's hourly ``online`` string at the round's start
  time, hour ``floor(t / 3600) mod 24``).
* **Sampling** (:meth:`VirtualClock.select`): the ``m`` eligible clients with the smallest keys of the
  run's sampling stream (:func:`fedskew.engine.sampling.sampling_row`, the stream
  :func:`~fedskew.engine.sampling.sampling_schedule` draws from), so with every client eligible it is the
  synchronous sample itself, and every method sees the same clients.
* **Dropout**: a sampled client drops out mid-round with probability ``dropout`` (per ``(seed, round,
  client)``); it trains nothing and holds nobody up.
* **Synchronous policies** (:meth:`VirtualClock.settle`): full wait (the round lasts as long as its
  slowest client), a deadline (clients slower than it are left out, or under ``late: partial`` train only
  the steps that fit), over-selection (sample ``ceil(k m)``, keep the first ``m`` to finish).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedskew.engine.clock_config import ClockSection, Spread
from fedskew.engine.sampling import clients_per_round, sampling_row
from fedskew.engine.types import ClientOutcome
from fedskew.errors import ConfigError
from fedskew.seeding import derive_seed

__all__ = ["ClientSpeeds", "RoundTiming", "VirtualClock", "read_trace"]

_SPEED_KEY, _ONLINE_KEY, _DROPOUT_KEY = 0xC10C, 0xA7A1, 0xD80F
HOUR = 3600.0


@dataclass(frozen=True)
class TraceRow:
    step_seconds: float
    bytes_per_second: float
    online: str | None  # 24 characters of 0 / 1, or None (always online)


TRACE_COLUMNS = ("client", "step_seconds", "bytes_per_second")


def read_trace(path: str | Path, num_clients: int) -> dict[int, TraceRow]:
    """A trace file's rows by client id (format: :mod:`fedskew.engine.clock_config`; a UTF-8 byte-order mark,
    as spreadsheets write it, is allowed); one-line errors naming the file and line."""
    where = f"clock.trace {path}"
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            columns = [c.strip() for c in reader.fieldnames or []]
            unknown = sorted(set(columns) - {*TRACE_COLUMNS, "online"})
            if not set(TRACE_COLUMNS) <= set(columns) or unknown:
                extra = f" (unknown: {', '.join(unknown)})" if unknown else ""
                raise ConfigError(
                    f"{where}: needs the header client,step_seconds,bytes_per_second[,online]{extra}"
                )
            reader.fieldnames = columns
            out: dict[int, TraceRow] = {}
            for row in reader:
                cid, parsed = trace_row(row, f"{where} line {reader.line_num}", num_clients)
                if cid in out:
                    raise ConfigError(f"{where} line {reader.line_num}: client {cid} is listed twice")
                out[cid] = parsed
    except OSError as err:
        raise ConfigError(f"{where}: cannot be read ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: is not UTF-8 text") from None
    if not out:
        raise ConfigError(f"{where}: has a header but no client rows")
    return out


def trace_row(row: dict[str | None, object], where: str, num_clients: int) -> tuple[int, TraceRow]:
    """One row of a trace file, checked (``where`` names its file and line)."""
    if row.get(None) is not None:  # more values than columns
        raise ConfigError(f"{where}: more values than the header's columns")
    try:
        cid = int(str(row["client"]).strip())
        step, bw = float(str(row["step_seconds"])), float(str(row["bytes_per_second"]))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: client must be an integer, speeds numbers") from None
    if not 0 <= cid < num_clients:
        raise ConfigError(f"{where}: unknown client {cid}; allowed: 0..{num_clients - 1}")
    if not (step > 0 and bw > 0 and math.isfinite(step) and math.isfinite(bw)):
        raise ConfigError(f"{where}: step_seconds and bytes_per_second must be > 0 and finite")
    online = str(row.get("online") or "").strip() or None
    if online is not None and (len(online) != 24 or set(online) - {"0", "1"}):
        raise ConfigError(f"{where}: online must be 24 characters of 0/1 (one per hour)")
    return cid, TraceRow(step, bw, online)


def draw(spread: Spread, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` values of ``spread`` from ``rng`` (always ``n`` normals drawn, so streams stay aligned)."""
    z = rng.standard_normal(n)
    if spread.distribution == "lognormal":
        return spread.value * np.exp(spread.sigma * z)
    if spread.distribution == "uniform":
        lo, hi = float(spread.low or 0), float(spread.high or 0)
        return lo + (hi - lo) * (0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2))))
    return np.full(n, spread.value)


@dataclass(frozen=True)
class ClientSpeeds:
    """Per client: seconds per local step, bytes per second, and the hourly availability (or None)."""

    step_seconds: np.ndarray
    bytes_per_second: np.ndarray
    online: dict[int, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        clock: ClockSection,
        seed: int,
        class_counts: Sequence[Sequence[int]],
        trace: dict[int, TraceRow] | None = None,
    ) -> ClientSpeeds:
        """Draw per seed, apply the trace's rows, then slow the ``slow_classes`` clients down."""
        n = len(class_counts)
        rng = np.random.default_rng(derive_seed(seed, _SPEED_KEY))
        step, bw = draw(clock.step_seconds, rng, n), draw(clock.bytes_per_second, rng, n)
        online: dict[int, str] = {}
        for cid, row in (trace or {}).items():
            step[cid], bw[cid] = row.step_seconds, row.bytes_per_second
            if row.online is not None:
                online[cid] = row.online
        if clock.slow_classes and clock.slow_factor > 1:
            slow = mostly_in(class_counts, clock.slow_classes)
            step[slow] *= clock.slow_factor
            bw[slow] /= clock.slow_factor
        return cls(step, bw, online)


def mostly_in(class_counts: Sequence[Sequence[int]], classes: Sequence[int]) -> np.ndarray:
    """Clients more than half of whose training samples are of ``classes`` (boolean mask)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    chosen = [c for c in classes if 0 <= c < counts.shape[1]]
    total = counts.sum(1)
    return (counts[:, chosen].sum(1) * 2 > total) & (total > 0)


@dataclass(frozen=True)
class Selection:
    """A round's sample on the clock: who trains, who dropped out, the step limits (``late: partial``)."""

    train: list[int]
    dropped_out: list[int]
    step_limits: dict[int, int] = field(default_factory=dict)
    no_time: list[int] = field(default_factory=list)  # late: partial: not one step fits the deadline
    wait: float = 0.0  # seconds the server waited for anyone to come online (availability: trace)


@dataclass(frozen=True)
class RoundTiming:
    """What :meth:`VirtualClock.settle` decided: the outcomes with late clients marked dropped, the
    round's virtual length and the clients cut (deadline or over-selection)."""

    outcomes: list[ClientOutcome]
    seconds: float
    late: list[int]
    durations: dict[int, float]
    steps: int = 0  # local steps of the clients kept (the round's compute)


class VirtualClock:
    """The clock of one run (module docstring): pure functions of the config, the seed and the time."""

    def __init__(
        self, clock: ClockSection, speeds: ClientSpeeds, num_clients: int, fraction: float, rounds: int,
        seed: int,
    ) -> None:  # fmt: skip
        self.cfg, self.speeds, self.seed = clock, speeds, seed
        self.num_clients = num_clients
        self.m = clients_per_round(num_clients, fraction)
        self.rounds = max(rounds, 1)

    # ------------------------------------------------------------------ who
    def online(self, r: int, now: float) -> np.ndarray:
        """Boolean mask of the clients that can be sampled in round ``r`` starting at time ``now``."""
        mask = np.ones(self.num_clients, dtype=bool)
        if self.cfg.availability == "bernoulli":
            rng = np.random.default_rng(derive_seed(self.seed, _ONLINE_KEY, r))
            mask = rng.random(self.num_clients) < self.cfg.available
        elif self.cfg.availability == "trace":
            hour = int(now // HOUR) % 24
            for cid, pattern in self.speeds.online.items():
                mask[cid] = pattern[hour] == "1"
        return mask

    def drops_out(self, r: int, cid: int) -> bool:
        """Whether sampled client ``cid`` drops out of round ``r`` (probability ``dropout``)."""
        if self.cfg.dropout <= 0:
            return False
        u = np.random.default_rng(derive_seed(self.seed, _DROPOUT_KEY, r, cid)).random()
        return bool(u < self.cfg.dropout)

    def pick(self, r: int, eligible: np.ndarray, count: int) -> list[int]:
        """The ``count`` eligible clients with the smallest keys of row ``r`` of the sampling stream, in
        id order (all eligible clients when fewer)."""
        ids = np.flatnonzero(eligible)
        if count >= ids.size:
            return ids.tolist()
        keys = sampling_row(self.num_clients, (r - 1) % self.rounds, self.seed)[ids]
        return np.sort(ids[np.argpartition(keys, count - 1)[:count]]).tolist()

    def wait_for_clients(self, r: int, now: float) -> float:
        """Under ``availability: trace``, the seconds until the next hour in which anyone is online (0: now;
        at most a day, the trace's period); the server waits rather than running empty rounds."""
        if self.cfg.availability != "trace" or self.online(r, now).any():
            return 0.0
        for hours in range(1, 25):
            start = (math.floor(now / HOUR) + hours) * HOUR
            if self.online(r, start).any():
                return start - now
        return 0.0

    def select(self, r: int, now: float, partial_bytes: float | None = None) -> Selection:
        """Round ``r``'s sample: ``ceil(over_selection x m)`` online clients, less those that drop out.
        ``partial_bytes``: under ``late: partial``, the round trip the server expects, turned into a step
        limit per client; a client that fits no step does not train (it is late)."""
        wait = self.wait_for_clients(r, now)
        count = math.ceil(self.cfg.over_selection * self.m - 1e-9)
        sampled = self.pick(r, self.online(r, now + wait), count)
        lost = [c for c in sampled if self.drops_out(r, c)]
        train = [c for c in sampled if c not in set(lost)]
        limits: dict[int, int] = {}
        if self.cfg.deadline is not None and self.cfg.late == "partial" and partial_bytes is not None:
            limits = {c: self.step_limit(c, partial_bytes) for c in train}
            train = [c for c in train if limits[c] > 0]
        return Selection(train, lost, limits, [c for c, k in limits.items() if k == 0], wait)

    def step_limit(self, cid: int, comm_bytes: float) -> int:
        """The local steps client ``cid`` fits before the deadline after moving ``comm_bytes`` bytes."""
        left = float(self.cfg.deadline or 0) - comm_bytes / self.speeds.bytes_per_second[cid]
        return max(0, math.floor(left / self.speeds.step_seconds[cid] + 1e-9))

    # ------------------------------------------------------------------ how long
    def duration(self, cid: int, steps: int, bytes_down: int, bytes_up: int) -> float:
        """Client ``cid``'s virtual seconds: ``steps x step_seconds + bytes / bytes_per_second``."""
        compute = steps * float(self.speeds.step_seconds[cid])
        return compute + (bytes_down + bytes_up) / float(self.speeds.bytes_per_second[cid])

    def settle(self, outcomes: list[ClientOutcome], selection: Selection | None = None) -> RoundTiming:
        """The synchronous round policy on trained ``outcomes`` (sampling order). The first ``m`` accepted
        uploads to finish (over-selection) within the deadline make the round; the others are marked dropped
        (their work and state are discarded; a rejected upload takes no place). The server stops at the
        ``m``-th kept upload, else when every trained client has reported (full wait: the slowest), and at
        the latest at the deadline. Clients that fit no step (``late: partial``) are late but not waited
        for; the wait for anyone to come online (``availability: trace``) comes first."""
        d = {o.cid: self.duration(o.cid, o.steps, o.bytes_down, o.bytes_up) for o in outcomes}
        deadline = self.cfg.deadline if self.cfg.deadline is not None else math.inf
        order = sorted((o for o in outcomes if o.upload is not None), key=lambda o: (d[o.cid], o.cid))
        kept = {o.cid for o in order[: self.m] if d[o.cid] <= deadline}
        if len(kept) == self.m:
            seconds = max(d[c] for c in kept)
        else:  # short of m: waits for every report, up to the deadline (no report at all: the deadline)
            seconds = min(deadline, max(d.values(), default=deadline))
        seconds = 0.0 if math.isinf(seconds) else seconds
        no_time = [] if selection is None else selection.no_time
        late = sorted([o.cid for o in order if o.cid not in kept] + no_time)
        new = [o if o.cid in kept or o.upload is None else cut(o) for o in outcomes]
        steps = sum(o.steps for o in outcomes if o.cid in kept)
        wait = 0.0 if selection is None else selection.wait
        return RoundTiming(new, wait + seconds, late, d, steps)


def cut(outcome: ClientOutcome) -> ClientOutcome:
    """``outcome`` left out of its round: no upload, no state, marked dropped (not rejected)."""
    return dataclasses.replace(outcome, upload=None, state=None, dropped=True, bytes_up=0, params_up=0)
