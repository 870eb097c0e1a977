"""Training work a method does besides the engine's local loop: the optional hooks that declare it.

A *step* is one optimizer update on one mini-batch; its *samples* are the samples of that mini-batch (one
forward-backward pass each). The engine counts the steps of its local loop itself (every phase of a
``LocalPlan``: Ditto's personal epochs, FedRep's and FedPAC's head epochs are steps of that loop). What a
method trains outside it the engine cannot see, so the method declares it, as a function of the client's
training-set size (and, for work inside a round, of the loop's own work that round):

* :class:`DeclaresEvalWork` — ``eval_work(num_samples)``: what :meth:`Algorithm.adapt_for_eval` takes for
  a client of ``num_samples`` training samples at one evaluation (FedAvg-FT's and FedBABU's fine-tuning,
  Per-FedAvg's test-time step); the run's ``eval_finetune_steps``.
* :class:`DeclaresExtraWork` — ``extra_work(num_samples, local)``: named work of a client's round outside
  the loop (pFedMe's K inner steps per batch; the ``stale`` fine-tuning of FedAvg-FT / FedBABU in
  ``finish_local``); ``local``: the loop's work that round.

Declared, not measured: the hooks run on the server (which holds no training data), so every runtime
(embedded, vectorized, workers, Flower) reports the same numbers; ``tests/test_compute.py`` checks each
declaration against the updates the method really makes. A method that overrides ``adapt_for_eval`` without
declaring its work is refused there too (its evaluation-time training would count as none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from fedskew.algorithms.batching import batches_per_epoch


@dataclass(frozen=True)
class Work:
    """Optimizer steps (one update on one mini-batch) and the samples their forward-backward passes saw."""

    steps: int = 0
    samples: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.steps + other.steps, self.samples + other.samples)

    def times(self, k: int) -> Work:
        return Work(self.steps * k, self.samples * k)


def samples_per_epoch(n: int, batch_size: int) -> int:
    """The samples of one epoch under the engine's rule (:func:`~fedskew.algorithms.batching.epoch_batches`:
    a trailing batch of one sample is dropped when ``batch_size > 1``)."""
    if n == 0:
        return 0
    bs = max(1, min(batch_size, n))
    return n - (1 if bs > 1 and n % bs == 1 else 0)


def epochs_work(epochs: int, n: int, batch_size: int) -> Work:
    """``epochs`` epochs of mini-batch training on ``n`` samples in batches of ``batch_size``."""
    return Work(batches_per_epoch(n, batch_size), samples_per_epoch(n, batch_size)).times(epochs)


@runtime_checkable
class DeclaresEvalWork(Protocol):
    """A method whose ``adapt_for_eval`` trains: it says how much, per client and evaluation."""

    def eval_work(self, num_samples: int) -> Work:
        """The work ``adapt_for_eval`` does for a client of ``num_samples`` training samples."""
        ...


@runtime_checkable
class DeclaresExtraWork(Protocol):
    """A method that trains outside the engine's local loop in a client's round: it names that work."""

    def extra_work(self, num_samples: int, local: Work) -> Mapping[str, Work]:
        """The named work of a round of a client of ``num_samples`` samples whose loop did ``local``."""
        ...


def eval_work_of(algorithm: object, num_samples: int) -> Work:
    """The declared evaluation-time work of one client, ``Work()`` for a method that declares none."""
    return algorithm.eval_work(num_samples) if isinstance(algorithm, DeclaresEvalWork) else Work()


def extra_work_of(algorithm: object, num_samples: int, local: Work) -> Mapping[str, Work]:
    """The declared extra work of one client's round, none for a method that declares none."""
    return algorithm.extra_work(num_samples, local) if isinstance(algorithm, DeclaresExtraWork) else {}
