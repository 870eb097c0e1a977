"""Evaluation protocols: ``global`` (one model, the held-out global test set) and ``personalized`` (each
client's own test split, with the model / state that client would use). Batched; every metric once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.algorithms.base import Algorithm, Payload, State


@dataclass
class HeadScores:
    """Per-sample correctness for each named head and per-sample loss of the ``logits`` head."""

    correct: dict[str, Tensor]  # head -> bool [n]
    loss: Tensor  # float [n]


@torch.no_grad()
def score(
    algorithm: Algorithm,
    model: nn.Module,
    payload: Payload,
    state: State | None,
    x: Tensor,
    y: Tensor,
    batch_size: int,
    to_float: Callable[[Tensor], Tensor],
) -> HeadScores:
    """Run ``algorithm.predict`` in batches over ``x`` (raw tensors, converted per batch)."""
    model.eval()
    correct: dict[str, list[Tensor]] = {}
    losses: list[Tensor] = []
    for start in range(0, y.shape[0], batch_size):
        xb = to_float(x[start : start + batch_size])
        yb = y[start : start + batch_size]
        heads = algorithm.predict(model, xb, payload, state)
        for name, scores in heads.items():
            correct.setdefault(name, []).append(scores.argmax(1) == yb)
        logits = heads.get("logits", next(iter(heads.values())))
        losses.append(F.cross_entropy(logits, yb, reduction="none"))
    return HeadScores({k: torch.cat(v) for k, v in correct.items()}, torch.cat(losses))


def summarize(
    per_client: dict[str, Tensor], loss: float, heads: list[str], sizes: Tensor | None = None
) -> dict[str, Any]:
    """Metrics record: ``accuracy`` (primary head) and ``accuracy_<head>`` for the others.

    ``per_client[head]`` holds one accuracy per client (``personalized``: mean and std over clients, as
    FedProto and MP-FedCL report) or a single value (``global``).
    """
    out: dict[str, Any] = {}
    for i, head in enumerate(heads):
        accs = per_client[head].double()
        key = "accuracy" if i == 0 else f"accuracy_{head}"
        out[key] = float(accs.mean())
        out[key + "_std"] = float(accs.std(unbiased=False)) if accs.numel() > 1 else 0.0
        if sizes is not None and i == 0:  # per-client accuracies of the primary head (spread analyses)
            out["accuracy_clients"] = [round(float(a), 6) for a in accs]  # type: ignore[assignment]
    out["loss"] = loss
    if sizes is not None:  # sample-weighted personalized accuracy, for comparison with pooled numbers
        w = sizes.double() / sizes.sum()
        out["accuracy_weighted"] = float((per_client[heads[0]].double() * w).sum())
    return out


def segment_mean(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Mean of ``values`` within each segment (client), vectorized with ``index_add_``."""
    sums = torch.zeros(num_segments, dtype=torch.float64, device=values.device)
    sums.index_add_(0, segment_ids, values.double())
    counts = torch.bincount(segment_ids, minlength=num_segments).double().clamp_min(1)
    return sums / counts
