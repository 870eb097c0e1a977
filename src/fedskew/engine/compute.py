"""The compute a run spent, counted by the round transaction: ``summary.json``'s ``compute`` (issue 52).

A *step* is one optimizer update on one mini-batch; its *samples* are that mini-batch's samples (one
forward-backward pass each). Counted per round, committed with the round, checkpointed, so a resumed run
reports what an uninterrupted one does:

* ``client``: the engine's local loop (every phase of every ``LocalPlan``) of the clients whose upload the
  round accepted — the work behind the model (a rejected or dropped client's work is not counted). Each
  client's steps come from the executor that trained it (sequential, vectorized, workers, Flower nodes);
* ``extra``: named work of those clients' rounds outside the loop, as the method declares it
  (:class:`fedskew.algorithms.work.DeclaresExtraWork`: pFedMe's inner steps, a ``stale`` fine-tuning);
* ``evaluation``: evaluation-time adaptation (:meth:`Algorithm.adapt_for_eval`) at every evaluation, over
  the clients the evaluator adapts (:func:`adapted_clients`), as the method declares it
  (:class:`fedskew.algorithms.work.DeclaresEvalWork`: FedAvg-FT's and FedBABU's fine-tuning, Per-FedAvg's
  test-time step).

Declared work is a function of the client's training-set size, which the server's context holds, so every
runtime reports the same numbers. Server-side computations (FedGen's generator, CCVR's calibration, FedPAC's
solver) and data-dependent loops (FedALA's adaptive aggregation) are not client training and not counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fedskew.algorithms.base import Algorithm
from fedskew.algorithms.work import Work, eval_work_of, extra_work_of
from fedskew.engine.types import ClientOutcome

#: what summary.json says a step is
STEP = "one optimizer update on one mini-batch; samples: that mini-batch's samples (forward-backward passes)"


@dataclass(frozen=True)
class Compute:
    """Work summed over rounds (see the module docstring); ``since_round`` > 0: counted from that round on (a
    run resumed from a checkpoint written before fedskew counted compute)."""

    client: Work = field(default_factory=Work)
    evaluation: Work = field(default_factory=Work)
    evaluations: int = 0
    extra: Mapping[str, Work] = field(default_factory=dict)
    since_round: int = 0

    def plus(self, other: Compute) -> Compute:
        extra = dict(self.extra)
        for name, w in other.extra.items():
            extra[name] = extra.get(name, Work()) + w
        return replace(
            self,
            client=self.client + other.client,
            evaluation=self.evaluation + other.evaluation,
            evaluations=self.evaluations + other.evaluations,
            extra=extra,
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain ints (``torch.load(weights_only=True)``)."""
        return {
            "client": [self.client.steps, self.client.samples],
            "evaluation": [self.evaluation.steps, self.evaluation.samples],
            "evaluations": self.evaluations,
            "extra": {k: [w.steps, w.samples] for k, w in sorted(self.extra.items())},
            "since_round": self.since_round,
        }

    @classmethod
    def from_state(cls, sd: Any, round_idx: int) -> Compute:
        """The counts of a checkpoint's ``compute`` entry (``None``: a checkpoint without one, at round
        ``round_idx``). A malformed entry raises ``ValueError`` (the caller's one line)."""
        if sd is None:
            return cls(since_round=round_idx)
        if not isinstance(sd, dict) or not isinstance(sd.get("extra"), dict):
            raise ValueError("compute is not a mapping with extra work")
        return cls(
            client=_work(sd.get("client")),
            evaluation=_work(sd.get("evaluation")),
            evaluations=_count(sd.get("evaluations")),
            extra={str(k): _work(v) for k, v in sd["extra"].items()},
            since_round=_count(sd.get("since_round")),
        )

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s ``compute``: steps and samples per kind, and their total."""
        extra = {k: {"steps": w.steps, "samples": w.samples} for k, w in sorted(self.extra.items())}
        total = sum(self.extra.values(), self.client + self.evaluation)
        out: dict[str, Any] = {
            "step": STEP,
            "client_steps": self.client.steps,
            "client_samples": self.client.samples,
            "extra": extra,
            "eval_finetune_steps": self.evaluation.steps,
            "eval_finetune_samples": self.evaluation.samples,
            "evaluations": self.evaluations,
            "total_steps": total.steps,
            "total_samples": total.samples,
        }
        if self.since_round:
            out["counted_from_round"] = self.since_round + 1
        return out


def _count(v: Any) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        raise ValueError(f"compute count {v!r} is not a non-negative integer")
    return v


def _work(v: Any) -> Work:
    if not (isinstance(v, list) and len(v) == 2):
        raise ValueError("compute work is not [steps, samples]")
    return Work(_count(v[0]), _count(v[1]))


def adapted_clients(
    algorithm: Algorithm, protocol: str, test_sizes: Sequence[int], val_sizes: Sequence[int]
) -> tuple[int, ...]:
    """The clients an evaluation adapts with ``adapt_for_eval``: under ``eval.protocol=personalized`` of a
    ``personalized_eval`` method, each client with a test or validation sample (the evaluators score, and
    adapt, no other: :mod:`fedskew.engine.evaluation`, :mod:`fedskew.flower.evaluation`)."""
    if protocol != "personalized" or not algorithm.personalized_eval:
        return ()
    vals = list(val_sizes) or [0] * len(test_sizes)
    return tuple(c for c, (t, v) in enumerate(zip(test_sizes, vals, strict=True)) if t or v)


def round_compute(
    algorithm: Algorithm, outcomes: Sequence[ClientOutcome], adapted: Sequence[int], evaluated: bool
) -> Compute:
    """The work of one round: its accepted clients' local loops and declared extras, and, when the round
    was evaluated, the declared evaluation-time work of the ``adapted`` clients."""
    sizes = algorithm.ctx.client_sizes
    client, extra = Work(), dict[str, Work]()
    for o in outcomes:
        if o.upload is None:
            continue
        local = Work(o.steps, o.passes)
        client = client + local
        for name, w in extra_work_of(algorithm, int(sizes[o.cid]), local).items():
            extra[name] = extra.get(name, Work()) + w
    evaluation = Work()
    if evaluated:
        for cid in adapted:
            evaluation = evaluation + eval_work_of(algorithm, int(sizes[cid]))
    return Compute(client, evaluation, int(evaluated), extra)
