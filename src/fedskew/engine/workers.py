"""Client training spread over persistent worker processes (``engine.workers = N``).

Why processes: on a CPU the convolutions of one client already run near the GEMM ceiling, so the lever left
is running several single-threaded clients at once (two single-threaded processes beat one two-thread loop
by ~1.3x on FedAvg/MNIST, issue 8). The workers are forked once, after the simulation is built, so they
inherit the dataset tensors, the models and the algorithm copy-on-write: nothing is set up twice and the
data is never pickled. Each round the parent sends a worker the server state (once, with its first task of
the round) and, per task, the client id and that client's state; the worker runs the very same
:meth:`Simulation.train_client` as the sequential loop and sends the outcome back.

Messages carry their tensors through an :class:`Arena` per worker and direction: an anonymous shared mapping
made before the fork, so a tensor costs one copy in and one copy out. (torch's own sharing makes a shared
memory file per tensor and passes its descriptor over a socket: ~0.6 ms a tensor, 5 ms for an 8-tensor
upload, more than training a 60-sample client costs.)

Results equal the sequential loop's: ``train_client`` seeds everything from ``(seed, round, client)``, the
outcomes are put back in sampling order, and the parent alone aggregates and evaluates. Tasks go out
largest client first, each to the first worker that is free (longest-processing-time scheduling).

Forking needs a CPU simulation (CUDA cannot be forked); :func:`pool_supported` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import io
import logging
import mmap
import pickle
import queue
import signal
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from fedskew.engine.loop import ClientOutcome, Simulation

log = logging.getLogger("fedskew.engine")

#: the simulation the forked workers inherit (set only while forking)
_INHERITED: Simulation | None = None
#: seconds between liveness checks while waiting for results
_POLL_SECONDS = 1.0
#: bytes of each arena (virtual: pages are only backed once written); larger messages are pickled whole
ARENA_BYTES = 1 << 30
_ALIGN = 64


class _ArenaPickler(pickle.Pickler):
    """Writes each plain CPU tensor's bytes into ``arena`` at the next aligned offset and pickles only the
    reference ``(offset, dtype, shape, requires_grad)``."""

    def __init__(self, file: io.BytesIO, arena: torch.Tensor) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arena, self.offset = arena, 0

    def persistent_id(self, o: Any) -> Any:
        if type(o) is not torch.Tensor or o.layout != torch.strided or o.device.type != "cpu":
            return None  # parameters and other subclasses keep their type: pickled inline
        flat = o.detach().contiguous().reshape(-1)
        n = flat.numel() * flat.element_size()
        if self.offset + n > self.arena.numel():
            return None  # does not fit: pickled inline
        if n:
            self.arena[self.offset : self.offset + n].copy_(flat.view(torch.uint8))
        pid = (self.offset, o.dtype, tuple(o.shape), o.requires_grad)
        self.offset += -(-n // _ALIGN) * _ALIGN
        return pid


class _ArenaUnpickler(pickle.Unpickler):
    """Rebuilds the tensors :class:`_ArenaPickler` referenced, as copies out of ``arena``."""

    def __init__(self, file: io.BytesIO, arena: torch.Tensor) -> None:
        super().__init__(file)
        self.arena = arena

    def persistent_load(self, pid: Any) -> torch.Tensor:
        offset, dtype, shape, requires_grad = pid
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        t = self.arena[offset : offset + n].view(dtype).reshape(shape).clone()
        return t.requires_grad_(requires_grad)


class Arena:
    """A shared anonymous memory mapping that carries the tensors of one message at a time.

    Made before the fork, it is the same memory in the parent and the worker. :meth:`dumps` pickles an
    object with each tensor's bytes written into the arena (referenced by offset); :meth:`loads` rebuilds it
    with copies, so the writer may reuse the arena as soon as the reader has loaded. The protocol keeps one
    message per arena in flight: a worker has one task at a time, and the parent loads its result before
    it sends that worker the next task.
    """

    def __init__(self, nbytes: int = ARENA_BYTES) -> None:
        while True:  # under strict overcommit accounting a large mapping may be refused: take less
            try:
                self._map = mmap.mmap(-1, nbytes)
                break
            except OSError:
                if nbytes <= 1 << 24:
                    raise
                nbytes //= 2
        self.nbytes = nbytes
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def dumps(self, obj: Any) -> bytes:
        out = io.BytesIO()
        _ArenaPickler(out, self._bytes).dump(obj)
        return out.getvalue()

    def loads(self, data: bytes) -> Any:
        return _ArenaUnpickler(io.BytesIO(data), self._bytes).load()


@dataclass
class WorkerFailure:
    """An exception raised inside a worker, re-raised in the parent with the client it happened on."""

    cid: int
    error: BaseException


def pool_supported(sim: Simulation) -> str | None:
    """``None`` if ``sim`` can train clients in forked workers, else the reason it cannot."""
    if sim.device.type != "cpu":
        return f"engine.workers > 1 needs engine.device=cpu (forked workers cannot share {sim.device.type})"
    if "fork" not in mp.get_all_start_methods():
        return "engine.workers > 1 needs the 'fork' start method (not available on this platform)"
    return None


def _worker_main(inbox: Any, outbox: Any, wid: int, task_arena: Arena, result_arena: Arena) -> None:
    """Worker loop: ``(round, cids, server | None, client states, vectorized)`` in, ``(wid, cids,
    outcomes)`` out. A task is one client, or with ``vectorized`` a group trained at once with vmap."""
    sim = _INHERITED
    assert sim is not None
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    while True:
        message = inbox.get()
        if message is None:
            return
        round_idx, cids, server, states, vectorized = task_arena.loads(message)
        if server is not None:
            sim.server = server
        sim.client_states.update(zip(cids, states, strict=True))
        try:
            if vectorized:
                outcome: Any = sim._train_vectorized(cids, round_idx)
            else:
                outcome = [sim.train_client(cid, round_idx) for cid in cids]
        except Exception as err:  # sent back: the parent raises it with the client's id
            outcome = WorkerFailure(cids[0], err)
        for cid in cids:
            sim.client_states.pop(cid, None)  # the parent owns client state
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
    """``n`` persistent forked workers that train clients of a :class:`Simulation`."""

    def __init__(self, sim: Simulation, n: int) -> None:
        global _INHERITED
        ctx = mp.get_context("fork")
        self.n = n
        self.inboxes = [ctx.SimpleQueue() for _ in range(n)]
        self.outbox = ctx.Queue()
        self.task_arenas = [Arena() for _ in range(n)]
        self.result_arenas = [Arena() for _ in range(n)]
        _INHERITED = sim
        try:
            self.procs = [
                ctx.Process(
                    target=_worker_main,
                    args=(self.inboxes[i], self.outbox, i, self.task_arenas[i], self.result_arenas[i]),
                    daemon=True,
                )
                for i in range(n)
            ]
            for p in self.procs:
                p.start()
        finally:
            _INHERITED = None

    def train(
        self,
        sim: Simulation,
        cids: Sequence[int],
        round_idx: int,
        cost: Callable[[int], float],
        vectorized: bool = False,
    ) -> list[ClientOutcome]:
        """Train ``cids`` for round ``round_idx``; outcomes in the order of ``cids``. ``vectorized``: one
        group of clients per worker, of balanced cost, each trained with vmap in its worker."""
        if vectorized:
            tasks = deque(balanced_groups(cids, cost, self.n))
        else:
            tasks = deque([cid] for cid in sorted(cids, key=lambda c: -cost(c)))  # largest first
        has_server = [False] * self.n
        done: dict[int, ClientOutcome] = {}

        def send(w: int) -> None:
            group = tasks.popleft()
            server = None if has_server[w] else sim.server
            has_server[w] = True
            task = (round_idx, group, server, [sim.client_state(cid) for cid in group], vectorized)
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

    def _receive(self) -> tuple[int, list[int], Any]:
        while True:
            try:
                w, group, message = self.outbox.get(timeout=_POLL_SECONDS)
                return w, group, self.result_arenas[w].loads(message)
            except queue.Empty:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    self.close()
                    raise RuntimeError(
                        f"engine worker {dead[0]} exited (exit code {self.procs[dead[0]].exitcode}); "
                        "rerun with engine.workers=1 to see the error in-process"
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
