"""FedCos, the cosine variant of FedEnt's §6.2.3 (Zheng, Yuan, Wang, Duan 2024, "Adaptive Federated Learning
via New Entropy Approach", arXiv:2303.14966v3; after Wu & Wang 2021).

FedCos (Eq. 59): FedAvg whose aggregation weights are the cosine similarities between local and global
models, at the static client learning rate (docs/methods/fedent.md, "FedCos: the cosine and its
normalisation").
Cosines are clamped at 0 and normalised over the sampled clients; when none is positive the weights fall
back to FedAvg's. The round's cosine statistics are :class:`ServerUpdate` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    HyperParams,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    sample_weights,
    weighted_average,
)
from fedskew.algorithms.fedent_solver import F64, PHI_FLOOR, dot


def cosine(
    v: Mapping[str, Tensor],
    ref: Mapping[str, Tensor],
    ref_norm: float,
    names: list[str],
    origin: Mapping[str, Tensor] | None,
) -> float:
    """``cos(v − origin, ref)`` tensor by tensor in float64 (no float64 copy of a whole model is kept)."""
    inner = sq = 0.0
    for n in names:
        x = v[n].double() if origin is None else v[n].double() - origin[n].double()
        inner += float((x * ref[n].double()).sum())
        sq += float((x * x).sum())
    return inner / max(math.sqrt(sq) * ref_norm, PHI_FLOOR)


@ALGORITHMS.register("fedcos")
class FedCos(Algorithm):
    """FedCos (after Wu & Wang 2021, as in FedEnt Eq. 59): aggregation weights = cos(w_i, w), static lr."""

    mean_aggregation = False  # cosine-similarity weights from the uploads

    class Params(HyperParams):
        cosine_of: Literal["models", "updates"] = Field(
            "models",
            description="cosine between the local and global models (Eq. 59 as printed) or between the "
            "local update w_i − w(t) and the sample-weighted mean update (Wu & Wang 2021's angle)",
        )
        sample_weighted: bool = Field(
            False,
            description="multiply the cosine weights by n_i before normalising (not in paper; default: "
            "cosines clamped at 0 and normalised over the sampled clients, as Eq. 59 leaves open)",
        )

    p: Params

    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        server["params"] = [n for n, _ in model.named_parameters()]
        return server

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """Eq. (59): the uploads averaged with their normalised, non-negative cosines as weights."""
        names, w = server["params"], server["weights"]
        states = [u.payload.model_state() for u in uploads]
        origin: Mapping[str, Tensor] | None = None  # models: cos(w_i, w); updates: cos(w_i − w, w̄ − w)
        ref: Mapping[str, Tensor] = w
        if self.p.cosine_of == "updates":
            mean = weighted_average(states, sample_weights(uploads))
            origin, ref = w, {n: mean[n] - w[n] for n in names}
        ref_norm = math.sqrt(dot(ref, ref, names))
        cos = torch.tensor([cosine(st, ref, ref_norm, names, origin) for st in states], dtype=F64)
        weights = cos.clamp_min(0.0)
        if self.p.sample_weighted:
            weights = weights * sample_weights(uploads)
        # all cosines ≤ 0 (or a zero update): no direction information, fall back to FedAvg's weights
        weights = weights / weights.sum() if float(weights.sum()) > 0.0 else sample_weights(uploads)
        metrics = {
            "fedcos_cos_min": float(cos.min()),
            "fedcos_cos_mean": float(cos.mean()),
            "fedcos_weight_max": float(weights.max()),
        }
        return ServerUpdate({**server, "weights": weighted_average(states, weights)}, metrics)
