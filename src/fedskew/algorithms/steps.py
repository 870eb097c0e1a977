"""The values hooks receive and return (contract v4): one :class:`LocalStep` per client and round for the
client hooks, a :class:`ServerUpdate` from ``aggregate``, and the small records around them.

A client hook never receives more than two arguments: the step (model, payload, state, client, round, the
per-round channel ``derived`` and the ``scratch`` tensors) and, for ``local_loss``, the batch, or, for
``finish_local``, the engine's :class:`LocalResult`. ``derived`` is the per-round channel: what
``start_local`` computed for this round (FedEnt's η and its probe statistics, MOON's reference networks),
seen by ``init_scratch``, ``local_loss`` and ``finish_local``, and never persisted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedskew.algorithms.messages import Payload
from fedskew.seeding import derive_seed

State = dict[str, Any]


class ContractError(RuntimeError):
    """An algorithm broke the contract (e.g. wrote into its scratch mapping outside ``init_scratch``)."""


class RoundSkipped(Exception):
    """Raised by :meth:`Algorithm.aggregate` to keep the server state for the round: the loop logs the message
    (one line) and records the round as skipped, as one without uploads. A robust rule left with fewer uploads
    than its f needs raises it under ``defence.too_few: skip`` (fedskew.algorithms.security.secured)."""


@dataclass(frozen=True)
class RoundInfo:
    """Where a hook runs: the round (1-based), the client (``None``: the server or global evaluation) and
    the run's seed, from which per-(round, client) randomness is derived independently of execution order."""

    round: int
    cid: int | None
    seed: int

    def generator(self, key: int) -> torch.Generator:
        """A CPU generator seeded from ``(seed, round, cid, key)``; ``key`` separates a method's streams."""
        cid = 2**32 if self.cid is None else self.cid  # the server's streams: an id no client has
        return torch.Generator().manual_seed(derive_seed(self.seed, self.round, cid, key))


@dataclass
class ClientView:
    """One client's local data as seen by hooks: full tensors on the training device (possibly empty: a
    ``min_size: 0`` partition has clients without training samples)."""

    cid: int
    x: Tensor
    y: Tensor
    class_counts: Tensor  # [C]

    @property
    def num_samples(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: Tensor) -> ClientView:
        """The client's samples ``idx`` (1-d integer indices into its samples), with their class counts."""
        y = self.y[idx]
        counts = torch.bincount(y.long(), minlength=self.class_counts.numel()).to(self.class_counts)
        return ClientView(self.cid, self.x[idx], y, counts)


@dataclass
class Batch:
    x: Tensor
    y: Tensor
    epoch: int = 0
    last_epoch: bool = True


@dataclass
class Phase:
    """A stretch of local training: ``epochs`` passes with learning rate ``lr`` over the parameters whose
    names ``trainable`` accepts (``None``: all)."""

    epochs: int
    lr: float
    trainable: Callable[[str], bool] | None = None
    momentum: float | None = None  # None: the client config's


@dataclass
class LocalPlan:
    """What :meth:`Algorithm.start_local` decides: the training phases, what it derived for this round (the
    per-round channel :attr:`LocalStep.derived`; never persisted) and, optionally, the weights training
    starts from.

    ``start_weights``: weights the engine loads into the model after ``start_local`` and before
    ``init_scratch`` (a subset of the model state's keys; the engine copies them in and keeps no reference):
    the weights local training starts from when they depend on the client's data, which
    :meth:`Algorithm.model_weights` cannot see (FedALA's adaptive local aggregation, FedFomo's first-order
    combination of downloaded models). ``None``: training starts from ``model_weights``.

    ``train_indices``: the client's samples local training uses (1-d distinct integer indices into
    ``step.client``), when a method holds some out of training (FedFomo's validation split, scored in
    ``start_local``, disjoint from what the client trains on). From ``init_scratch`` on, ``step.client`` is
    that subset; the upload's sample count stays the client's full count (the count the server plans with).
    ``None``: training uses every sample."""

    phases: list[Phase]
    derived: Mapping[str, Any] = field(default_factory=dict)
    start_weights: Mapping[str, Tensor] | None = None
    train_indices: Tensor | None = None


@dataclass
class LocalResult:
    """What the engine reports back after the optimizer loop."""

    steps: int
    loss: float  # mean training loss of the last epoch (nan: the client had no batch)
    lr: float  # learning rate of the last phase
    samples: int = 0  # the samples of those steps' mini-batches (forward-backward passes)


@dataclass
class LocalOutput:
    """What :meth:`Algorithm.finish_local` returns: the upload and the client's new (persistent) state."""

    upload: Payload
    state: State


@dataclass
class ServerUpdate:
    """What :meth:`Algorithm.aggregate` returns: the new server state and the round's diagnostics (logged in
    ``metrics.jsonl`` on evaluated rounds; never kept in state)."""

    state: State
    metrics: Mapping[str, float | list[float]] = field(default_factory=dict)


class Scratch(Mapping[str, Tensor]):
    """The read-only mapping ``local_loss`` gets: exactly the tensors :meth:`Algorithm.init_scratch` made.

    Its keys cannot change after ``init_scratch`` (a write raises :class:`ContractError` in every engine
    mode, since the vectorized engine stacks these tensors over clients before the first batch); the
    tensors themselves may be accumulated into in place (FedProto's last-epoch prototype sums)."""

    __slots__ = ("_items",)
    _items: dict[str, Tensor]

    def __init__(self, items: Mapping[str, Tensor] | None = None) -> None:
        object.__setattr__(self, "_items", dict(items or {}))

    def __getitem__(self, key: str) -> Tensor:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __setitem__(self, key: str, value: Any) -> None:
        raise ContractError(
            f"scratch is read-only outside init_scratch (wrote '{key}'): create every tensor the loss "
            "needs in init_scratch and update it in place"
        )

    def __setattr__(self, key: str, value: Any) -> None:
        raise ContractError("scratch is read-only outside init_scratch")


@dataclass(frozen=True)
class LocalStep:
    """One client's local round as every client hook sees it (contract v4).

    ``model`` holds :meth:`Algorithm.model_weights` when ``start_local`` runs (read it, do not change it),
    those weights updated with the plan's ``start_weights`` from ``init_scratch`` on, and the trained weights
    when ``finish_local`` runs; under ``engine.mode=vectorized`` ``local_loss`` sees
    the model with the client's stacked parameters substituted. ``state`` is the client's persistent state
    (on the training device), ``derived`` what ``start_local`` computed for this round, ``scratch`` the
    tensors of ``init_scratch`` (empty before it ran).
    """

    model: nn.Module
    payload: Payload
    state: State
    client: ClientView
    info: RoundInfo
    derived: Mapping[str, Any] = field(default_factory=dict)
    scratch: Scratch = field(default_factory=Scratch)

    def replace(self, **changes: Any) -> LocalStep:
        """A copy with ``changes`` (the step itself is never changed)."""
        return dataclasses.replace(self, **changes)

    @property
    def cid(self) -> int:
        return self.client.cid
