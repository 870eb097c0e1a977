"""A mean-aggregation method's mean folded inside the worker processes (:mod:`fedskew.engine.folding`),
bit for bit.

The pool's workers share one running sum (an :class:`~fedskew.engine.arena.Arena` made before the fork) and
three counters: the next client to train, the next upload to fold (the *turn*) and whether the fold was
abandoned. A worker takes the round's clients one at a time in sampling order (dynamic: a slow client holds
back only its own worker), trains each, and folds its upload when the turn reaches it, holding it until
then. The sum is the in-process fold's, operation for operation, so the mean is the same bits whatever the
number of workers; no upload leaves its worker (a round sends back receipts and reads the sum once).

Where the clients carry state (their states would go to every worker) or the executor kind trains groups
(vectorized), each worker gets a fixed, cost-balanced interleaved share instead (:func:`interleaved_shares`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedskew.engine.arena import ALIGN, Arena
from fedskew.engine.executors import ExecutorKind, train_folding
from fedskew.engine.folding import Folder, MeanFold, sum_dtype
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.types import ClientOutcome, RoundJob

#: what a worker spins for before it sleeps between looks at the turn (its held uploads wait on clients the
#: other workers are finishing: usually well under a millisecond)
_SPIN_SECONDS = 2e-3
_TURN_WAIT = 1e-4

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


@dataclass
class FoldTask:
    """A worker's part of a folded round: ``positions`` of ``job``'s sampling order to train (``None``: take
    clients from the shared counter until none is left). ``job.states`` holds the states of those clients."""

    job: RoundJob
    positions: list[int] | None
    fold: MeanFold


class SharedRound:
    """The counters the workers share: the next client to take, the turn (the next upload to fold) and the
    abandoned flag, each read and written under its lock (which also orders the sum's writes before the
    turn's); a waiting worker spins on the turn's raw value."""

    def __init__(self, ctx: Any) -> None:
        self.taken, self.turn, self.stopped = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("b", 0)

    def reset(self) -> None:
        for value in (self.taken, self.turn, self.stopped):
            with value.get_lock():
                value.value = 0

    def take(self) -> int:
        """The next client position of the round, for this worker."""
        with self.taken.get_lock():
            i = int(self.taken.value)
            self.taken.value = i + 1
            return i

    # the folding.Turn protocol
    def current(self) -> int:
        with self.turn.get_lock():
            return int(self.turn.value)

    def advance(self, position: int) -> None:
        with self.turn.get_lock():
            self.turn.value = position

    def abandon(self) -> None:
        with self.stopped.get_lock():
            self.stopped.value = 1

    def abandoned(self) -> bool:
        with self.stopped.get_lock():
            return bool(self.stopped.value)

    def peek(self) -> int:
        """The turn without its lock (for spinning; :meth:`current` before acting on it)."""
        return int(self.turn.get_obj().value)


@dataclass
class SharedSum:
    """The running sum's shared memory and the round's counters."""

    arena: Arena
    round: SharedRound

    def slots(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Views of the shared memory for the sum of uploads shaped like ``state``."""
        return self.slots_of([(k, tuple(v.shape), v.dtype) for k, v in state.items()])

    def slots_of(self, layout: Layout) -> dict[str, Tensor]:
        """The views, in ``layout``'s order at aligned offsets (every process derives the same ones), in the
        dtypes of :func:`~fedskew.engine.folding.sum_dtype`."""
        out, offset = {}, 0
        for key, shape, dtype in layout:
            dtype = sum_dtype(dtype)
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out[key] = self.arena.tensor[offset : offset + n].view(dtype).view(shape)
            offset += -(-n // ALIGN) * ALIGN
        return out


FoldResult = tuple[list[tuple[int, ClientOutcome]] | None, Layout | None]


def train_fold_task(rt: ClientRuntime, kind: ExecutorKind, task: FoldTask, shared: SharedSum) -> FoldResult:
    """Train a :class:`FoldTask` in this worker: ``([(position, receipt)], layout of the sum)``, or
    ``(None, None)`` once the fold is abandoned (here or in another worker)."""
    job, folder = task.job, Folder(task.fold, shared.round, shared.slots)
    done: list[tuple[int, ClientOutcome]] = []
    if task.positions is not None:
        outs = train_folding(kind, rt, job, task.positions, folder)
        done = list(zip(task.positions, outs or [], strict=False))
    else:
        while folder.valid and (i := shared.round.take()) < len(job.cids):
            outs = train_folding(kind, rt, job, [i], folder)
            done += [(i, o) for o in outs or []]
    _wait_for_turns(folder, shared.round)
    if not folder.valid:
        return None, None
    return done, [(k, tuple(v.shape), folder.dtypes[k]) for k, v in (folder.acc or {}).items()]


def _wait_for_turns(folder: Folder, counters: SharedRound) -> None:
    """Fold the held uploads as the other workers fold the ones before them: spin first, then sleep."""
    spin_until = time.perf_counter() + _SPIN_SECONDS
    while folder.held and folder.valid:
        if counters.peek() == folder.held[0][0]:
            folder.drain()
        elif time.perf_counter() > spin_until:
            time.sleep(_TURN_WAIT)
            folder.drain()


def interleaved_shares(costs: Sequence[float], n: int) -> list[list[int]]:
    """Positions ``0..len(costs)-1`` dealt in order to ``n`` workers, each to the one with the least cost so
    far (ties: the lowest index): near-equal totals, and every worker walks the sampling order at the same
    pace, so uploads wait little for their turn. Workers dealt nothing are left out."""
    shares: list[list[int]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for i, c in enumerate(costs):
        w = loads.index(min(loads))
        shares[w].append(i)
        loads[w] += c
    return [s for s in shares if s]
