"""Client training spread over persistent worker processes (``engine.workers = N``).

Why processes: on a CPU the convolutions of one client already run near the GEMM ceiling, so the lever left
is running several single-threaded clients at once (two single-threaded processes beat one two-thread loop
by ~1.3x on FedAvg/MNIST, measured on the project's 2-core CPU machine, docs/performance.md). The workers
are forked once, after the simulation is built, so they inherit the dataset tensors, the models and the
algorithm copy-on-write: nothing is set up twice and the data is never pickled. Each round the parent
sends a worker the server state (once, with its first task of the round) and, per task, the client ids and
their states; the worker runs the very same executor kind (:mod:`fedskew.engine.executors`: sequential or
vectorized) as the parent would and sends the outcomes back.

Messages carry their tensors through an :class:`~fedskew.engine.arena.Arena` per worker and direction.

Results equal the sequential executor's: ``train_client`` seeds everything from ``(seed, round, client)``, the
outcomes are put back in sampling order, and the parent alone aggregates and evaluates. Tasks go out
largest client first, each to the first worker that is free (longest-processing-time scheduling). A round
whose mean is folded (:mod:`fedskew.engine.folding`) goes out as one task per worker instead, and the
workers fold the uploads into a shared sum (:mod:`fedskew.engine.fold_workers`): no upload comes back.

Forking needs a CPU run (CUDA cannot be forked); :func:`pool_supported` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import queue
import signal
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from fedskew.algorithms.base import State
from fedskew.engine.arena import Arena
from fedskew.engine.executors import ExecutorKind, fold_in_process, plan_fold
from fedskew.engine.fold_workers import (
    FoldResult,
    FoldTask,
    SharedRound,
    SharedSum,
    interleaved_shares,
    train_fold_task,
)
from fedskew.engine.folding import FoldedRound, MeanFold, finish_mean, finite_mean
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.errors import RunFailure

log = logging.getLogger("fedskew.engine")

#: the client runtime and the executor kind the forked workers inherit (set only while forking)
_INHERITED: tuple[ClientRuntime, ExecutorKind] | None = None
#: seconds between liveness checks while waiting for results
_POLL_SECONDS = 1.0
#: prctl option: the signal a process gets when its parent dies (linux/prctl.h)
_PR_SET_PDEATHSIG = 1
#: times a round is run again on freshly forked workers after a worker process died mid-round
WORKER_RETRIES = 1
_T = TypeVar("_T")


class WorkerDied(RunFailure):
    """A worker process exited mid-round (killed by a signal, the OOM killer, ...)."""


@dataclass
class WorkerFailure:
    """An exception raised inside a worker, re-raised in the parent with the client it happened on."""

    cid: int
    error: BaseException


def pool_supported(device: torch.device) -> str | None:
    """``None`` if clients on ``device`` can train in forked workers, else the reason they cannot."""
    if device.type != "cpu":
        return f"engine.workers > 1 needs engine.device=cpu (forked workers cannot share {device.type})"
    if "fork" not in mp.get_all_start_methods():
        return "engine.workers > 1 needs the 'fork' start method (not available on this platform)"
    return None


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this worker when its parent dies (Linux): a parent killed by SIGKILL or the OOM
    killer cannot stop its workers, which would otherwise wait on their inbox forever."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker_main(
    inbox: Any, outbox: Any, wid: int, arenas: tuple[Arena, Arena], shared: SharedSum, parent: int
) -> None:
    """Worker loop: ``(round, cids, server | None, client states)`` in, ``(wid, cids, outcomes)`` out. A task
    is one client, or for a grouped kind (vectorized) a group trained at once. The server state comes with a
    worker's first task of a round and serves its later ones."""
    assert _INHERITED is not None
    rt, kind = _INHERITED
    task_arena, result_arena = arenas
    if sys.platform.startswith("linux"):
        die_with_parent(parent)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    server: State = {}
    while True:
        message = inbox.get()
        if message is None:
            return
        task = task_arena.loads(message)
        if isinstance(task, FoldTask):
            job, cids = task.job, task.job.cids
        else:
            round_idx, cids, new_server, states = task
            if new_server is not None:
                server = new_server
            job = RoundJob(round_idx, cids, server, dict(zip(cids, states, strict=True)))
        try:
            if isinstance(task, FoldTask):
                outcome: Any = train_fold_task(rt, kind, task, shared)
            else:
                outcome = kind.train(rt, job, cids)
        except Exception as err:  # sent back: the parent raises it with the client's id
            outcome = WorkerFailure(cids[0], err)
        outbox.put((wid, cids, result_arena.dumps(outcome)))


def balanced_groups(cids: Sequence[int], cost: Callable[[int], float], n: int) -> list[list[int]]:
    """``cids`` in at most ``n`` groups of near-equal total cost (largest first, each to the lightest)."""
    groups: list[list[int]] = [[] for _ in range(min(n, len(cids)))]
    loads = [0.0] * len(groups)
    for cid in sorted(cids, key=lambda c: -cost(c)):
        i = loads.index(min(loads))
        groups[i].append(cid)
        loads[i] += cost(cid)
    return groups


class WorkerPool:
    """``n`` persistent forked workers training clients of a :class:`ClientRuntime` with an executor kind."""

    def __init__(self, rt: ClientRuntime, kind: ExecutorKind, n: int) -> None:
        global _INHERITED
        ctx = mp.get_context("fork")
        self.n = n
        self.inboxes = [ctx.SimpleQueue() for _ in range(n)]
        self.outbox = ctx.Queue()
        self.task_arenas = [Arena() for _ in range(n)]
        self.result_arenas = [Arena() for _ in range(n)]
        self.shared = SharedSum(Arena(), SharedRound(ctx))
        _INHERITED = (rt, kind)
        try:
            self.procs = [
                ctx.Process(
                    target=_worker_main,
                    args=(
                        self.inboxes[i],
                        self.outbox,
                        i,
                        (self.task_arenas[i], self.result_arenas[i]),
                        self.shared,
                        os.getpid(),
                    ),
                    daemon=True,
                )
                for i in range(n)
            ]
            for p in self.procs:
                p.start()
        finally:
            _INHERITED = None

    def train(
        self, job: RoundJob, cost: Callable[[int], float], grouped: bool = False
    ) -> list[ClientOutcome]:
        """Train ``job``'s clients; outcomes in the order of ``job.cids``. ``grouped``: a group of clients
        per worker, of balanced cost, each trained at once in its worker."""
        cids = job.cids
        if grouped:
            tasks = deque(balanced_groups(cids, cost, self.n))
        else:
            tasks = deque([cid] for cid in sorted(cids, key=lambda c: -cost(c)))  # largest first
        has_server = [False] * self.n
        done: dict[int, ClientOutcome] = {}

        def send(w: int) -> None:
            group = tasks.popleft()
            server = None if has_server[w] else job.server
            has_server[w] = True
            task = (job.round, group, server, [job.states[cid] for cid in group])
            self.inboxes[w].put(self.task_arenas[w].dumps(task))

        busy = 0
        for w in range(min(self.n, len(tasks))):
            send(w)
            busy += 1
        while busy:
            w, group, outcomes = self._receive()
            busy -= 1
            if isinstance(outcomes, WorkerFailure):
                raise outcomes.error
            done.update(zip(group, outcomes, strict=True))
            if tasks:
                send(w)
                busy += 1
        return [done[c] for c in cids]

    def train_folded(
        self, job: RoundJob, fold: MeanFold, shares: list[list[int]] | None
    ) -> FoldedRound | None:
        """Train ``job``'s clients folding into the shared sum (:mod:`fedskew.engine.fold_workers`): every
        worker takes clients as it goes (``shares=None``) or trains its share. The mean is bit for bit the
        in-process fold's; ``None``: the fold was abandoned."""
        self.shared.round.reset()
        parts = [None] * self.n if shares is None else shares
        for w, positions in enumerate(parts):
            mine = job.cids if positions is None else [job.cids[i] for i in positions]
            states = {c: job.states[c] for c in mine}
            task = FoldTask(RoundJob(job.round, job.cids, job.server, states, folded=True), positions, fold)
            self.inboxes[w].put(self.task_arenas[w].dumps(task))
        done: list[FoldResult] = []
        while len(done) < len(parts):
            _, _, result = self._receive()
            if isinstance(result, WorkerFailure):
                raise result.error
            done.append(result)
        if self.shared.round.abandoned() or any(r[0] is None for r in done):
            return None
        layout = next(r[1] for r in done if r[1])
        acc = {k: v.clone() for k, v in self.shared.slots_of(layout).items()}
        by_position = dict(pair for r in done for pair in r[0] or [])
        outcomes = [by_position[i] for i in range(len(job.cids))]
        mean = finish_mean(acc, {k: d for k, _, d in layout})
        return FoldedRound(outcomes, mean) if finite_mean(mean) else None

    def _receive(self) -> tuple[int, list[int], Any]:
        while True:
            try:
                w, group, message = self.outbox.get(timeout=_POLL_SECONDS)
                return w, group, self.result_arenas[w].loads(message)
            except queue.Empty:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    code = self.procs[dead[0]].exitcode
                    self.close(terminate=True)
                    raise WorkerDied(
                        f"engine worker {dead[0]} exited (exit code {code}); rerun with engine.workers=1 to "
                        "see the error in-process"
                    ) from None

    def close(self, terminate: bool = False) -> None:
        """Stop the workers (idempotent): let them finish their task, or with ``terminate`` (a round that
        failed or was interrupted) stop them at once."""
        if not terminate:
            for box, p in zip(self.inboxes, self.procs, strict=True):
                if p.is_alive():
                    with contextlib.suppress(OSError, ValueError):  # the worker may already be gone
                        box.put(None)
        for p in self.procs:
            if terminate:
                p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs, self.inboxes = [], []


class WorkerExecutor:
    """Runs an executor kind in ``workers`` forked processes (forked on the first round that needs them):
    one client per task or, for a grouped kind, one group per worker. Rounds too small to share run in this
    process on the same path."""

    def __init__(self, rt: ClientRuntime, kind: ExecutorKind, workers: int) -> None:
        self.rt, self.kind, self.workers = rt, kind, workers
        self.name = kind.pooled_name
        self.pool: WorkerPool | None = None

    @property
    def processes(self) -> int:
        """Worker processes alive now (0 before the first shared round and after :meth:`close`)."""
        return 0 if self.pool is None else sum(p.is_alive() for p in self.pool.procs)

    def _too_small(self, job: RoundJob) -> bool:
        return len(job.cids) < (2 * self.workers if self.kind.grouped else 2)

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        if self._too_small(job):  # too small to share
            return self.kind.train(self.rt, job, job.cids)
        return self._pooled(
            job, lambda pool: pool.train(job, lambda cid: float(self.rt.data.size(cid)), self.kind.grouped)
        )

    def train_folded(self, job: RoundJob) -> FoldedRound:
        """:meth:`train` with FedAvg's mean folded in the workers (:meth:`WorkerPool.train_folded`); a client
        not accepted abandons the fold and the round trains again unfolded (the same uploads)."""
        fold = plan_fold(self.rt, job)
        if fold is not None and self._too_small(job):
            in_process = fold_in_process(self.kind, self.rt, job, fold)
            if in_process is not None:
                return in_process
        elif fold is not None:
            shares = None  # dynamic: clients without state, trained one at a time
            if self.kind.grouped or any(job.states[c] for c in job.cids):
                epochs, batch = self.rt.client.epochs, self.rt.client.batch_size
                # samples trained, plus about a batch of per-client work
                costs = [float(epochs * self.rt.data.size(c) + batch) for c in job.cids]
                shares = interleaved_shares(costs, self.workers)
            folded = self._pooled(job, lambda pool: pool.train_folded(job, fold, shares))
            if folded is not None:
                return folded
        return FoldedRound(self.train(job), None)

    def _pooled(self, job: RoundJob, work: Callable[[WorkerPool], _T]) -> _T:
        """``work`` on the pool (forked now if needed). A worker that died mid-round: the round again on new
        workers, once; a failure or an interrupt: the workers stopped."""
        attempt = 0
        while True:
            if self.pool is None:
                self.pool = WorkerPool(self.rt, self.kind, min(self.workers, len(self.rt.data.index)))
            try:
                return work(self.pool)
            except WorkerDied as err:  # nothing of the round was committed: run it again on new workers
                self.pool, attempt = None, attempt + 1
                if attempt > WORKER_RETRIES:
                    raise WorkerDied(f"round {job.round}: {err}, again after a retry") from None
                log.warning("round %d: %s; running the round again on new workers", job.round, err)
            except BaseException:  # failed or interrupted mid-round: the workers' tasks are abandoned
                self.pool.close(terminate=True)
                self.pool = None
                raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
