"""A mean-aggregation method's mean folded as uploads arrive, bit for bit the mean of the held uploads.

A method that declares ``mean_aggregation`` aggregates by ``Σ_k w_k u_k`` over the round's uploads' arrays,
then its ``server_step`` (FedAvg, McMahan et al. 2017, Alg. 1: ``w_k = n_k / n`` and the mean is the new
model). :func:`~fedskew.algorithms.base.weighted_average` computes the mean over the held list, in sampling
order: ``acc = w_0 · s_0``, then ``acc += w_k · s_k`` for each later upload. The weights are
``Algorithm.mean_weights`` of the sample counts, known before any client trains, so the same sum can be
folded one upload at a time, in the same order, with the same operations: the result is the same bits, and
no upload is held.

What it saves (``docs/performance.md``): in-process, the round's uploads are never all alive at once (each
is folded while in cache, then freed); across worker processes (:mod:`fedskew.engine.workers`), the workers
fold into one shared running sum, taking turns in sampling order (:mod:`fedskew.engine.fold_workers`), and
send back no upload at all.

The planned weights assume every sampled client is accepted. A rejected or dropped client changes ``n``, so
the fold is abandoned and the executor trains the round again unfolded (training depends only on
``(seed, round, client)``, payload and state, so the rerun gives the same uploads).

The engine folds for every method that declares ``mean_aggregation`` (:func:`folds_uploads`): FedAvg, FedAvgM,
FedOpt, SCAFFOLD, FedNova, ...; a secured variant whose robust rule, attack or DP replaces the mean does not
declare it. ``engine.fold_uploads=false`` turns it off.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from fedskew.algorithms.base import Algorithm, Payload, count_weights, receipt
from fedskew.engine.types import ClientOutcome, RoundJob


def folds_uploads(algorithm: Algorithm) -> bool:
    """Whether the engine may compute ``algorithm``'s mean itself: it declares ``mean_aggregation``."""
    return bool(algorithm.mean_aggregation)


def plan_round(algorithm: Algorithm, cids: Sequence[int], sizes: Sequence[int]) -> MeanFold | None:
    """The round's planned weights for ``algorithm`` from the sampled clients' training-set ``sizes``: the
    counts its uploads will carry (1 each where it does not disclose them: DP runs)."""
    counts = list(sizes) if algorithm.discloses_client_statistics else [1] * len(sizes)
    return MeanFold.plan(cids, counts, algorithm.mean_weights)


@dataclass(frozen=True)
class MeanFold:
    """A round's planned weights per sampled client (``Algorithm.mean_weights`` of the counts; FedAvg's
    ``n_k / n``, :func:`~fedskew.algorithms.base.count_weights`), with the counts they assume."""

    weights: dict[int, float]
    counts: dict[int, int]

    @classmethod
    def plan(
        cls,
        cids: Sequence[int],
        counts: Sequence[int],
        weigh: Callable[[Sequence[int]], Tensor] = count_weights,
    ) -> MeanFold | None:
        """The plan for ``cids`` (sampling order) with these sample counts and weights ``weigh(counts)``;
        ``None`` when a client is sampled twice (its weight would not be one number)."""
        if len(set(cids)) != len(cids):
            return None
        w = weigh(counts).tolist()
        return cls(dict(zip(cids, w, strict=True)), dict(zip(cids, counts, strict=True)))


@dataclass
class FoldedRound:
    """What a folding executor returns: the outcomes in sampling order and, when every client was accepted,
    ``mean`` (the uploads then carry no arrays); ``mean=None``: the uploads are whole (the fold was abandoned
    and the round trained unfolded)."""

    outcomes: list[ClientOutcome]
    mean: dict[str, Tensor] | None


@runtime_checkable
class FoldingExecutor(Protocol):
    """An executor that can fold the uploads of a round into the method's mean."""

    def train_folded(self, job: RoundJob) -> FoldedRound:
        """Train ``job`` as ``train`` does, folding the uploads (see :class:`FoldedRound`)."""
        ...


def light_outcome(outcome: ClientOutcome) -> ClientOutcome:
    """``outcome`` with its upload's arrays dropped (counts, config, metrics and traffic kept)."""
    if outcome.upload is None:
        return outcome
    return dataclasses.replace(outcome, upload=receipt(outcome.upload))


class Turn(Protocol):
    """Whose upload is folded next: the sampling position of the next upload to fold, and whether the fold
    was abandoned (shared by the processes folding one round)."""

    def current(self) -> int: ...

    def advance(self, position: int) -> None: ...

    def abandon(self) -> None: ...

    def abandoned(self) -> bool: ...


class LocalTurn:
    """The :class:`Turn` of a fold in one process."""

    def __init__(self) -> None:
        self.position, self.stopped = 0, False

    def current(self) -> int:
        return self.position

    def advance(self, position: int) -> None:
        self.position = position

    def abandon(self) -> None:
        self.stopped = True

    def abandoned(self) -> bool:
        return self.stopped


Slots = Callable[[Mapping[str, Tensor]], dict[str, Tensor]]


def _position(held: tuple[int, int, Mapping[str, Tensor]]) -> int:
    return held[0]


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The running sum's dtype of an entry: its own if floating, float64 for integers (BatchNorm counters)."""
    return dtype if dtype.is_floating_point else torch.float64


def fresh_slots(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Running-sum tensors for uploads shaped like ``state`` (:func:`sum_dtype`)."""
    return {k: torch.empty(v.shape, dtype=sum_dtype(v.dtype)) for k, v in state.items()}


class Folder:
    """The weighted running sum of a round's uploads' arrays (by their names), in sampling order (a process
    may own only some of the uploads).

    :meth:`add` takes an upload with its sampling position; it is folded when the :class:`Turn` reaches that
    position, held until then. The first upload is ``w_0 · s_0``, every later one ``acc += w_k · s_k``:
    floating entries in their own dtype (``mul``, ``add_(alpha=w)``), integer buffers (BatchNorm counters) in
    float64, rounded back by :meth:`mean`: the operations of
    :func:`~fedskew.algorithms.base.weighted_average`, so the same bits. ``slots`` makes the sum's tensors
    (worker processes: views of one shared buffer).
    """

    def __init__(self, fold: MeanFold, turn: Turn | None = None, slots: Slots = fresh_slots) -> None:
        self.fold, self.slots = fold, slots
        self.turn: Turn = turn if turn is not None else LocalTurn()
        self.acc: dict[str, Tensor] | None = None
        self.dtypes: dict[str, torch.dtype] = {}
        self.held: list[tuple[int, int, Mapping[str, Tensor]]] = []  # by position

    @property
    def valid(self) -> bool:
        return not self.turn.abandoned()

    def add(self, outcome: ClientOutcome, position: int) -> ClientOutcome:
        """Fold (or hold) ``outcome``'s upload, the ``position``-th of the round; returns its
        :func:`light_outcome`. A client without an accepted upload, or with another sample count than planned,
        abandons the fold."""
        up = outcome.upload
        if up is None or up.num_samples != self.fold.counts.get(outcome.cid):
            self.abandon()
            return outcome
        if self.valid:
            bisect.insort(self.held, (position, outcome.cid, up.payload.arrays), key=_position)
            self.drain()
        return light_outcome(outcome)

    def drain(self) -> None:
        """Fold the held uploads whose turn it is."""
        while self.held and self.valid and self.held[0][0] == self.turn.current():
            position, cid, state = self.held.pop(0)
            if not self._fold(position, cid, state):
                self.abandon()
                return
            self.turn.advance(position + 1)

    def abandon(self) -> None:
        self.turn.abandon()
        self.held.clear()

    def _fold(self, position: int, cid: int, state: Mapping[str, Tensor]) -> bool:
        w = self.fold.weights[cid]
        if self.acc is None:
            self.dtypes = {k: v.dtype for k, v in state.items()}
            self.acc = self.slots(state)
        if list(state) != list(self.acc) or any(v.shape != self.acc[k].shape for k, v in state.items()):
            return False  # uploads of different layouts: not one mean
        for k, v in state.items():
            if v.is_floating_point():
                if position == 0:
                    torch.mul(v, w, out=self.acc[k])
                else:
                    self.acc[k].add_(v, alpha=w)
            elif position == 0:
                torch.mul(v.double(), w, out=self.acc[k])
            else:
                self.acc[k].add_(w * v.double())
        return True

    def mean(self) -> dict[str, Tensor] | None:
        """The finished mean (integer buffers rounded back), or ``None`` if abandoned, empty or unfinished."""
        if not self.valid or self.acc is None or self.held:
            return None
        return finish_mean(self.acc, self.dtypes)


def finish_mean(acc: Mapping[str, Tensor], dtypes: Mapping[str, torch.dtype]) -> dict[str, Tensor]:
    """The mean from a finished running sum: integer entries rounded back to their dtype."""
    return {k: v if dtypes[k].is_floating_point else v.round().to(dtypes[k]) for k, v in acc.items()}


def finite_mean(mean: Mapping[str, Tensor]) -> bool:
    """No NaN / Inf in a folded mean: the check of a folded round (NaN and Inf propagate into the sum, so
    every upload was finite unless the sum overflowed, and then the unfolded round decides)."""
    return Payload(arrays=dict(mean)).is_finite()
