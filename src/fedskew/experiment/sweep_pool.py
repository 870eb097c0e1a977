"""A sweep's runs in spawned worker processes, one run per worker at a time.

Workers report rounds through a queue; the parent owns the only progress display. Workers ignore SIGINT:
a Ctrl-C reaches the parent, which sets a stop event that every worker checks after each round (the run
checkpoints the round it just finished and stops). A second Ctrl-C sends SIGTERM to the running workers,
which abandon their current round at once (keeping the last complete one in the checkpoint).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from fedskew.engine.workers import die_with_parent
from fedskew.experiment.failure import recorded_failure
from fedskew.experiment.sweep import (
    PlannedRun,
    RunState,
    SweepListener,
    SweepOutcome,
    execute_run,
    round_accuracy,
    run_in_process,
    settle,
)

_POLL_SECONDS = 0.2

# worker-process state, set by the pool initializer
_messages: Any = None
_stop: Any = None
_in_task = False


def _on_sigterm(signum: int, frame: Any) -> None:
    if _in_task:
        raise KeyboardInterrupt  # the runner saves the last complete round, then the task ends
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # an idle worker: terminate as asked
    os.kill(os.getpid(), signal.SIGTERM)


def _init_worker(threads: int, messages: Any, stop: Any, parent: int) -> None:
    global _messages, _stop
    import torch

    if sys.platform.startswith("linux"):  # a killed sweep must not leave workers behind
        die_with_parent(parent)
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _messages, _stop = messages, stop


def _task(index: int, config: dict[str, Any], folder: str) -> dict[str, Any]:
    global _in_task
    if _stop.is_set():
        raise KeyboardInterrupt
    _messages.put(("started", index, os.getpid()))

    def on_round(sim: Any, record: dict[str, Any] | None) -> None:
        _messages.put(("round", index, sim.round, round_accuracy(record)))
        if _stop.is_set():
            raise KeyboardInterrupt

    _in_task = True
    try:
        return execute_run(config, Path(folder), on_round)
    finally:
        _in_task = False


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Spawned children inherit an ignored SIGINT, so a Ctrl-C during their start-up cannot kill them."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to change
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


class _Pool:
    """The parent side: submit, relay worker messages to the listener, settle futures, stop on Ctrl-C."""

    def __init__(self, todo: Sequence[PlannedRun], listener: SweepListener, outcome: SweepOutcome) -> None:
        self.todo, self.listener, self.outcome = todo, listener, outcome
        self.pids: dict[int, int] = {}  # run index -> pid of the worker running it
        self.stopping = False
        self.handlers: dict[str, Callable[..., None]] = {"started": self._started, "round": self._round}

    def run(self, jobs: int, threads: int) -> None:
        ctx = mp.get_context("spawn")  # fork is unsafe once torch has started its thread pools
        self.messages, self.stop = ctx.Queue(), ctx.Event()
        with _sigint_ignored():
            pool = ProcessPoolExecutor(
                jobs, ctx, _init_worker, (threads, self.messages, self.stop, os.getpid())
            )
            futures = {
                pool.submit(_task, i, run.config, str(run.folder)): i for i, run in enumerate(self.todo)
            }
        try:
            self._collect(futures)
        except KeyboardInterrupt:
            self._wind_down(futures)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _collect(self, futures: dict[Future[Any], int]) -> None:
        while futures:
            done, _ = wait(futures, timeout=_POLL_SECONDS, return_when=FIRST_COMPLETED)
            self._drain()
            for f in done:
                self._settle(futures.pop(f), f)

    def _wind_down(self, futures: dict[Future[Any], int]) -> None:
        """First Ctrl-C: running runs stop after their round; a second one: at once."""
        self.stopping = True
        self.stop.set()
        for f in list(futures):
            if f.cancel():
                self.outcome.interrupted.append(self.todo[futures.pop(f)])
        try:
            self._collect(futures)
        except KeyboardInterrupt:
            self._drain()
            for pid in self.pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            self._collect(futures)

    def _drain(self) -> None:
        while True:
            try:
                kind, index, *args = self.messages.get_nowait()
            except queue.Empty:
                return
            self.handlers[kind](index, *args)

    def _started(self, index: int, pid: int) -> None:
        self.pids[index] = pid
        self.listener.run_started(self.todo[index])

    def _round(self, index: int, round_: int, accuracy: float | None) -> None:
        self.listener.run_round(self.todo[index], round_, accuracy)

    def _settle(self, index: int, future: Future[Any]) -> None:
        self.pids.pop(index, None)
        run = self.todo[index]
        error = future.exception()
        if self.stopping and isinstance(error, BrokenProcessPool):
            error = KeyboardInterrupt()  # a worker ended by the second Ctrl-C
        settle(self.outcome, self.listener, run, None if error else future.result(), error)


def run_in_pool(
    todo: Sequence[PlannedRun], jobs: int, threads: int, listener: SweepListener, outcome: SweepOutcome
) -> None:
    """Run ``todo`` in ``jobs`` spawned processes with ``threads`` torch threads each."""
    _Pool(todo, listener, outcome).run(jobs, threads)


def run_sweep(
    runs: Sequence[PlannedRun], jobs: int = 1, threads: int = 1, listener: SweepListener | None = None
) -> SweepOutcome:
    """Run every unfinished run of ``runs``: in this process when ``jobs == 1``, else in ``jobs`` spawned
    processes with ``threads`` torch threads each. A failed run is recorded and the sweep goes on; an
    interrupt (Ctrl-C, or KeyboardInterrupt raised by the listener) stops it with every run resumable."""
    listener = listener or SweepListener()
    outcome = SweepOutcome(skipped=[r for r in runs if r.state is RunState.FINISHED])
    todo = [r for r in runs if r.state is not RunState.FINISHED]
    for r in outcome.skipped:  # finished earlier but counted as failed: still failed (not rerun)
        if (reason := recorded_failure(r.folder)) is not None:
            outcome.failed.append((r, reason))
    if jobs <= 1 or len(todo) <= 1:
        run_in_process(todo, threads, listener, outcome)
    else:
        run_in_pool(todo, min(jobs, len(todo)), threads, listener, outcome)
    return outcome
