"""Extra measurements beside a round's metrics, as :class:`~fedskew.engine.evaluation.RoundEvaluator`
wrappers (the round transaction is handed the wrapped evaluator; nothing else changes).

:class:`BackdoorProbe`: the attack success rate of a pixel-pattern backdoor (Bagdasaryan et al., AISTATS
2020, §5: "backdoor accuracy"): the share of the global test samples whose label is not the target that
the global model classifies as the target once the trigger is stamped on them. Logged as
``attack_success_rate`` beside the clean accuracy of every evaluated round.

:class:`CentralProbe`: the global model on a test set the server holds, beside metrics that come from
elsewhere (node-local data: the nodes score their own test sets). Logged as ``central_accuracy`` and
``central_loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from fedskew.algorithms.base import RoundInfo, State, load_state
from fedskew.algorithms.security.attacks import stamp_trigger
from fedskew.engine.evaluation import EvalData, Evaluator, RoundEvaluator, score


class BackdoorProbe:
    """``inner``'s record plus ``attack_success_rate`` of the global model (the server's evaluation
    weights) on the triggered non-target test samples."""

    def __init__(self, inner: RoundEvaluator, evaluator: Evaluator, target: int, size: int) -> None:
        self.inner, self.ev, self.target, self.size = inner, evaluator, target, size
        data: EvalData = evaluator.data
        keep = data.y_test != target
        self.x: Tensor = data.x_test[keep]
        self.y: Tensor = data.y_test[keep]

    def evaluate(self, server: State, state_of: Callable[[int], State], round_idx: int) -> dict[str, Any]:
        record = self.inner.evaluate(server, state_of, round_idx)
        ev = self.ev
        payload = ev.algorithm.broadcast(server, RoundInfo(round_idx, None, ev.seed))
        model = ev.models.model_for(None)
        load_state(model, ev.algorithm.eval_weights(payload, None))
        to_float = ev.data.to_float

        def triggered(x: Tensor) -> Tensor:
            return stamp_trigger(to_float(x), self.size)

        target = self.y.new_full(self.y.shape, self.target)
        hits = score(
            ev.algorithm, model, payload, None, self.x, target, ev.batch_size, triggered, ev.precision
        )
        primary = next(iter(hits.correct.values()))
        record["attack_success_rate"] = float(primary.double().mean()) if primary.numel() else float("nan")
        return record


class CentralProbe:
    """``inner``'s record plus ``central_accuracy`` / ``central_loss``: ``evaluator`` (the ``global``
    protocol on the server's own test set) scoring the global model."""

    def __init__(self, inner: RoundEvaluator, evaluator: Evaluator) -> None:
        self.inner, self.ev = inner, evaluator

    def evaluate(self, server: State, state_of: Callable[[int], State], round_idx: int) -> dict[str, Any]:
        record = self.inner.evaluate(server, state_of, round_idx)
        central = self.ev.evaluate(server, state_of, round_idx)
        record.update({f"central_{k}": central[k] for k in ("accuracy", "loss")})
        return record
