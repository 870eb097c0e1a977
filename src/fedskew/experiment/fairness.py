"""Who is left behind: summaries of the per-client accuracies (``accuracy_clients`` of a round evaluated
under the personalized protocol; clients without test data are ``None`` there and left out).

* ``accuracy_worst10``: the mean accuracy of the worst 10% of clients (at least one client), the
  "worst-10%" figure of the fairness literature (q-FFL, Li et al. ICLR 2020, Table 2 reports worst 10%);
* ``accuracy_gini``: the Gini coefficient of the accuracies, Σ_i Σ_j |a_i − a_j| / (2 n² ā) (0: every client
  alike; 0 as well when every accuracy is 0);
* ``accuracy_std`` is the engine's own (std over clients, ``engine/evaluation.py``) and is not repeated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: the share of clients the worst-clients mean is taken over
WORST_SHARE = 0.10


def client_accuracies(record: dict[str, Any]) -> list[float]:
    """The per-client accuracies of a ``metrics.jsonl`` record or a summary's ``final`` (clients without
    test data left out); empty for a round evaluated under the global protocol."""
    return [float(a) for a in record.get("accuracy_clients") or [] if a is not None]


def worst_share_mean(accuracies: Sequence[float], share: float = WORST_SHARE) -> float:
    """Mean of the lowest ``ceil(share · n)`` accuracies (at least one)."""
    ordered = np.sort(np.asarray(accuracies, dtype=np.float64))
    k = max(1, math.ceil(share * ordered.size))
    return float(ordered[:k].mean())


def gini(accuracies: Sequence[float]) -> float:
    """Σ_i Σ_j |a_i − a_j| / (2 n² ā), computed in O(n log n) as Σ_i (2i − n − 1) a_(i) / (n² ā) over the
    accuracies sorted ascending (i = 1..n); 0 when the mean is 0."""
    a = np.sort(np.asarray(accuracies, dtype=np.float64))
    n, mean = a.size, a.mean()
    if mean == 0:
        return 0.0
    rank = np.arange(1, n + 1, dtype=np.float64)
    return float(((2 * rank - n - 1) * a).sum() / (n**2 * mean))


def client_fairness(accuracies: Sequence[float]) -> dict[str, float]:
    """``accuracy_worst10`` and ``accuracy_gini`` of per-client accuracies ({} for none)."""
    if len(accuracies) == 0:
        return {}
    return {"accuracy_worst10": worst_share_mean(accuracies), "accuracy_gini": gini(accuracies)}
