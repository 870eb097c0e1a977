"""Executors: how a round's sampled clients are trained. Every one returns outcomes in sampling order and
gives the same numbers as the sequential one (tested for every registered algorithm).

An executor *kind* is one way of training clients inside a process, registered by name in
:data:`EXECUTORS` and selected with ``engine.mode=<name>``; a new kind is one module that registers
itself (imported by :mod:`fedskew.engine.modes`, as :mod:`fedskew.algorithms` imports its methods). The
engine runs a kind in this process (:class:`InProcessExecutor`) or, with ``engine.workers > 1``, in
forked worker processes (:class:`~fedskew.engine.workers.WorkerExecutor`); ``engine.mode=auto`` chooses
among the built-in kinds (:mod:`fedskew.engine.modes`).

* ``sequential``: one client after another.
* ``vectorized``: the clients of an architecture at once under ``torch.func.vmap``
  (:mod:`fedskew.engine.vectorized`), falling back to sequential training with a logged reason.

The round loop (:mod:`fedskew.engine.loop`) only sees the :class:`Executor` protocol; the Flower server
implements it by sending the clients to the nodes that own them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Protocol

from fedskew.algorithms.base import Algorithm, ContractError, RoundInfo
from fedskew.engine.client import train_client
from fedskew.engine.folding import FoldedRound, Folder, MeanFold, finite_mean, plan_round
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.engine.vectorized import NotVectorizable, train_vectorized, unsupported_reason
from fedskew.registry import Registry
from fedskew.settings import EngineSection

log = logging.getLogger("fedskew.engine")


class Executor(Protocol):
    """Trains a round's clients; outcomes in ``job.cids`` order. Commits nothing."""

    @property
    def name(self) -> str: ...

    def train(self, job: RoundJob) -> list[ClientOutcome]: ...

    def close(self) -> None: ...


class ExecutorKind(Protocol):
    """One way of training clients inside a process (``engine.mode=<name>``)."""

    #: the executor's name in this process, and in worker processes (``engine.workers > 1``)
    name: str
    pooled_name: str
    #: worker tasks: a balanced group of clients per worker (True) or one client per task (False)
    grouped: bool

    def supports(self, algorithm: type[Algorithm]) -> bool:
        """Whether the kind can train ``algorithm`` at all (a model may still rule it out)."""
        ...

    def unsupported(self, rt: ClientRuntime, cids: list[int]) -> str | None:
        """Why the kind cannot train these clients of ``rt`` (None: it can)."""
        ...

    def train(self, rt: ClientRuntime, job: RoundJob, cids: list[int]) -> list[ClientOutcome]:
        """Broadcast to and train ``cids`` of ``job`` in this process; outcomes in ``cids`` order."""
        ...


#: name -> ``kind(engine_section)``; ``engine.mode`` names one, or ``auto``
EXECUTORS: Registry[Callable[[EngineSection], ExecutorKind]] = Registry("executor")


def train_sequential(rt: ClientRuntime, job: RoundJob, cids: list[int]) -> list[ClientOutcome]:
    """Broadcast to and train each of ``cids`` in turn, in this process."""
    alg = rt.algorithm
    return [
        train_client(
            rt,
            cid,
            job.round,
            alg.broadcast(job.server, RoundInfo(job.round, cid, rt.seed)),
            job.states[cid],
            check=not job.folded,
            max_steps=job.step_limits.get(cid),
        )
        for cid in cids
    ]


def train_grouped_vectorized(
    rt: ClientRuntime, job: RoundJob, cids: list[int], memory_mb: float
) -> list[ClientOutcome]:
    """Vectorized training of ``cids`` per architecture; a group that cannot be vectorized (clients with
    different phases, payloads of different shapes, ...) trains sequentially, with the reason logged."""
    groups: dict[Hashable, list[int]] = {}
    for cid in cids:
        groups.setdefault(rt.models.arch_key(cid), []).append(cid)
    done: dict[int, ClientOutcome] = {}
    for members in groups.values():
        try:
            outs = train_vectorized(rt, job, members, memory_mb)
        except NotVectorizable as err:
            log.warning("round %d: %s; these clients train sequentially", job.round, err)
            outs = train_sequential(rt, job, members)
        except ContractError:
            raise
        except Exception as err:  # a client raised: one by one, the failure is that client's
            log.warning("round %d: vectorized group failed (%s); training it sequentially", job.round, err)
            outs = train_sequential(rt, job, members)
        done.update((o.cid, o) for o in outs)
    return [done[c] for c in cids]


@EXECUTORS.register("sequential")
class Sequential:
    """One client after another (every algorithm, every model)."""

    name, pooled_name, grouped = "sequential", "workers", False

    def __init__(self, engine: EngineSection) -> None:
        pass

    def supports(self, algorithm: type[Algorithm]) -> bool:
        return True

    def unsupported(self, rt: ClientRuntime, cids: list[int]) -> str | None:
        return None

    def train(self, rt: ClientRuntime, job: RoundJob, cids: list[int]) -> list[ClientOutcome]:
        return train_sequential(rt, job, cids)


@EXECUTORS.register("vectorized")
class Vectorized:
    """The clients of an architecture at once under ``torch.func.vmap``, in chunks of ``engine.memory_mb``."""

    name, pooled_name, grouped = "vectorized", "vectorized+workers", True

    def __init__(self, engine: EngineSection) -> None:
        self.memory_mb = engine.memory_mb

    def supports(self, algorithm: type[Algorithm]) -> bool:
        return bool(algorithm.vectorizable)

    def unsupported(self, rt: ClientRuntime, cids: list[int]) -> str | None:
        return unsupported_reason(rt.algorithm, rt.models.model_for(cids[0]))

    def train(self, rt: ClientRuntime, job: RoundJob, cids: list[int]) -> list[ClientOutcome]:
        if len(cids) < 2:
            return train_sequential(rt, job, cids)
        return train_grouped_vectorized(rt, job, cids, self.memory_mb)


def plan_fold(rt: ClientRuntime, job: RoundJob) -> MeanFold | None:
    """The round's mean weights from the sampled clients' sample counts (:mod:`fedskew.engine.folding`)."""
    return plan_round(rt.algorithm, job.cids, [rt.data.size(c) for c in job.cids])


def train_folding(
    kind: ExecutorKind,
    rt: ClientRuntime,
    job: RoundJob,
    positions: list[int],
    folder: Folder,
) -> list[ClientOutcome] | None:
    """Train the clients at ``positions`` of the round's sampling order with ``kind``, handing each upload to
    ``folder`` at its position as it arrives (a grouped kind: after its group). Returns the receipts, or
    ``None`` as soon as the fold is abandoned (a client was not accepted, here or in another process)."""
    cids = [job.cids[i] for i in positions]
    if kind.grouped:
        outs = [folder.add(o, i) for o, i in zip(kind.train(rt, job, cids), positions, strict=True)]
        return outs if folder.valid else None
    outs = []
    for cid, i in zip(cids, positions, strict=True):
        outs.append(folder.add(kind.train(rt, job, [cid])[0], i))
        if not folder.valid:
            return None
    return outs


def fold_in_process(
    kind: ExecutorKind, rt: ClientRuntime, job: RoundJob, fold: MeanFold
) -> FoldedRound | None:
    """Train ``job`` in this process with ``kind``, folding every upload (``None``: fold abandoned)."""
    folder = Folder(fold)
    outcomes = train_folding(kind, rt, replace(job, folded=True), list(range(len(job.cids))), folder)
    mean = folder.mean()
    if outcomes is None or mean is None or not finite_mean(mean):
        return None
    return FoldedRound(outcomes, mean)


class InProcessExecutor:
    """Runs an executor kind on every round's clients in this process."""

    def __init__(self, rt: ClientRuntime, kind: ExecutorKind) -> None:
        self.rt, self.kind, self.name = rt, kind, kind.name

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        return self.kind.train(self.rt, job, job.cids)

    def train_folded(self, job: RoundJob) -> FoldedRound:
        """:meth:`train`, each upload folded into FedAvg's mean as it arrives; a client not accepted abandons
        the fold and the round trains again unfolded (the same uploads)."""
        fold = plan_fold(self.rt, job)
        if fold is not None:
            folded = fold_in_process(self.kind, self.rt, job, fold)
            if folded is not None:
                return folded
        return FoldedRound(self.train(job), None)

    def close(self) -> None:
        pass
