"""Executors: how a round's sampled clients are trained. Every one returns outcomes in sampling order and
gives the same numbers as the sequential one (tested for every registered algorithm).

* :class:`SequentialExecutor`: one client after another, in this process.
* :class:`VectorizedExecutor`: the clients of an architecture at once under ``torch.func.vmap``
  (:mod:`fedskew.engine.vectorized`), falling back to sequential training with a logged reason.
* :class:`~fedskew.engine.workers.WorkerExecutor`: forked single-thread worker processes, each running the
  sequential or vectorized path on its share (``engine.workers``).

The round loop (:mod:`fedskew.engine.loop`) only sees the :class:`Executor` protocol; a Flower runtime
drives :func:`~fedskew.engine.client.train_client` on its nodes instead.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Protocol

from fedskew.algorithms.base import ContractError, RoundInfo
from fedskew.engine.client import train_client
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.engine.vectorized import NotVectorizable, train_vectorized

log = logging.getLogger("fedskew.engine")


class Executor(Protocol):
    """Trains a round's clients; outcomes in ``job.cids`` order. Commits nothing."""

    name: str

    def train(self, job: RoundJob) -> list[ClientOutcome]: ...

    def close(self) -> None: ...


def train_sequential(rt: ClientRuntime, job: RoundJob, cids: list[int]) -> list[ClientOutcome]:
    """Broadcast to and train each of ``cids`` in turn, in this process."""
    alg = rt.algorithm
    return [
        train_client(
            rt, cid, job.round, alg.broadcast(job.server, RoundInfo(job.round, cid, rt.seed)), job.states[cid]
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


class SequentialExecutor:
    name = "sequential"

    def __init__(self, rt: ClientRuntime) -> None:
        self.rt = rt

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        return train_sequential(self.rt, job, job.cids)

    def close(self) -> None:
        pass


class VectorizedExecutor:
    name = "vectorized"

    def __init__(self, rt: ClientRuntime, memory_mb: float) -> None:
        self.rt, self.memory_mb = rt, memory_mb

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        if len(job.cids) < 2:
            return train_sequential(self.rt, job, job.cids)
        return train_grouped_vectorized(self.rt, job, job.cids, self.memory_mb)

    def close(self) -> None:
        pass
