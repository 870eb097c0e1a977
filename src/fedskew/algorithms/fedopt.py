"""Server-side optimizers over the FedAvg pseudo-gradient: FedAvgM, FedAdagrad, FedAdam, FedYogi.

Reddi et al. 2021, "Adaptive Federated Optimization" (ICLR), Alg. 2 (no bias correction): clients run local
SGD as in FedAvg; the server treats the sample-weighted change of the model as a pseudo-gradient

    Δ_t = Σ_k p_k w_k − w_t,          p_k = n_k / Σ_j n_j,

and updates ``m_t = β1 m_{t−1} + (1 − β1) Δ_t``, a method-specific second moment ``v_t`` and
``w_{t+1} = w_t + η m_t / (√v_t + τ)``, with ``m_{−1} = 0`` and ``v_{−1} = τ²`` (Alg. 2 requires
``v_{−1} ≥ τ²``; we take the smallest allowed value).

FedAvgM (Hsu, Qi, Brown 2019, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", §3): server momentum ``v ← β v + Δ_t``, ``w ← w + η v`` (η = 1, β = 0 is FedAvg).

Only trainable parameters go through the optimizer; buffers (BatchNorm running statistics, counters) are
taken from the plain sample-weighted average: they are statistics, not iterates of an optimizer.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from fedskew import numerics
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    HyperParams,
    MeanInfo,
    Payload,
    ServerUpdate,
    State,
)
from fedskew.search_space import tunable


class ServerOptimizer(Algorithm):
    """Shared aggregation: FedAvg's weighted mean, then one server-optimizer step on the parameters.

    Subclasses name their per-parameter slots (``slots``, the first holds every parameter name), give each
    slot's initial value (:meth:`init_slot`) and the step (:meth:`param_step`). Slot ``s`` of parameter
    ``n`` lives in ``server[s][n]``. The mean is the engine's (``mean_aggregation``: folded as uploads
    arrive where the executor can; replaced by a robust rule or DP where configured).
    """

    slots: ClassVar[tuple[str, ...]] = ("m",)

    def init_slot(self, slot: str, param: Tensor) -> Tensor:
        return torch.zeros_like(param)

    def param_step(self, slots: dict[str, Tensor], delta: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """Return the new slot values and the update added to the parameter."""
        raise NotImplementedError

    def init_server(self, model: nn.Module) -> State:
        server = super().init_server(model)
        params = {n: p.detach() for n, p in model.named_parameters()}
        for slot in self.slots:
            server[slot] = {n: self.init_slot(slot, p) for n, p in params.items()}
        return server

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        avg = mean.model_state()
        weights = server["weights"]
        new = dict(avg)  # buffers: the plain weighted average
        new_slots: dict[str, dict[str, Tensor]] = {s: {} for s in self.slots}
        for name in server[self.slots[0]]:  # the parameter names
            slots, update = self.param_step(
                {s: server[s][name] for s in self.slots}, avg[name] - weights[name]
            )
            for s, value in slots.items():
                new_slots[s][name] = value
            new[name] = weights[name] + update
        return ServerUpdate({**server, **new_slots, "weights": new})


# ------------------------------------------------------------------------------------------------ FedAvgM
@ALGORITHMS.register("fedavgm")
class FedAvgM(ServerOptimizer):
    """FedAvgM (Hsu et al. 2019): server momentum on the FedAvg pseudo-gradient."""

    slots = ("m",)

    class Params(HyperParams):
        server_lr: float = Field(
            1.0,
            gt=0.0,
            description="server learning rate η (source: Hsu et al. 2019 §3; η=1 keeps FedAvg's step)",
        )
        momentum: float = tunable(
            0.9,
            low=0.0,
            high=0.99,
            ge=0.0,
            lt=1.0,
            description="server momentum β (source: Hsu et al. 2019 §3; Reddi et al. 2021 use 0.9; search: "
            "fedskew, [0, 0.99]; 0 is FedAvg)",
        )

    p: Params

    def param_step(self, slots: dict[str, Tensor], delta: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        m = self.p.momentum * slots["m"] + delta  # Hsu et al.: v ← βv + Δw (no dampening)
        return {"m": m}, self.p.server_lr * m


# ------------------------------------------------------------------------------------------------ adaptive
class AdaptiveParams(HyperParams):
    server_lr: float = tunable(
        1e-2,
        low=1e-3,
        high=1.0,
        log=True,
        gt=0.0,
        description="server learning rate η (source: Reddi et al. 2021 §5, tuned on a grid; FedEnt gives no "
        "value: 1e-2 is our default, tune in {1e-3, 1e-2, 1e-1}; search: fedskew, [1e-3, 1] log spans it)",
    )
    beta1: float = Field(
        0.9,
        ge=0.0,
        lt=1.0,
        description="first-moment decay β1 (source: Reddi et al. 2021 §5; FedEnt §6.1.3)",
    )
    tau: float = Field(
        1e-3,
        gt=0.0,
        description="adaptivity τ (source: Reddi et al. 2021 Alg. 2; 1e-3 as in FedEnt §6.1.3)",
    )


class AdamParams(AdaptiveParams):
    beta2: float = Field(
        0.99,
        ge=0.0,
        lt=1.0,
        description="second-moment decay β2 (source: Reddi et al. 2021 §5; FedEnt §6.1.3)",
    )


class AdaptiveServerOptimizer(ServerOptimizer):
    """Reddi et al. 2021 Alg. 2: ``m`` with β1, a method-specific ``v``, step ``η m / (√v + τ)``."""

    slots = ("m", "v")
    p: AdaptiveParams

    def init_slot(self, slot: str, param: Tensor) -> Tensor:
        initial = {"m": 0.0, "v": self.p.tau**2}  # m_{−1} = 0, v_{−1} = τ²
        return torch.full_like(param, initial[slot])

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        raise NotImplementedError

    def param_step(self, slots: dict[str, Tensor], delta: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        m = self.p.beta1 * slots["m"] + (1.0 - self.p.beta1) * delta
        v = self.second_moment(slots["v"], delta * delta)
        return {"m": m, "v": v}, self.p.server_lr * m / (numerics.sqrt(v) + self.p.tau)


@ALGORITHMS.register("fedadagrad")
class FedAdagrad(AdaptiveServerOptimizer):
    """FedAdagrad (Reddi et al. 2021): server Adagrad on the FedAvg pseudo-gradient."""

    Params = AdaptiveParams

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        return v + delta_sq  # v_t = v_{t−1} + Δ_t²


@ALGORITHMS.register("fedadam")
class FedAdam(AdaptiveServerOptimizer):
    """FedAdam (Reddi et al. 2021): server Adam (no bias correction) on the FedAvg pseudo-gradient."""

    Params = AdamParams
    p: AdamParams

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        return self.p.beta2 * v + (1.0 - self.p.beta2) * delta_sq  # v_t = β2 v_{t−1} + (1 − β2) Δ_t²


@ALGORITHMS.register("fedyogi")
class FedYogi(AdaptiveServerOptimizer):
    """FedYogi (Reddi et al. 2021): server Yogi on the FedAvg pseudo-gradient."""

    Params = AdamParams
    p: AdamParams

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        # v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²): additive, so v cannot collapse as Adam's can
        return v - (1.0 - self.p.beta2) * delta_sq * torch.sign(v - delta_sq)
