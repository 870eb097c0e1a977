"""Contract v4's mean seam: a method that declares ``mean_aggregation`` aggregates by the engine's weighted
mean of its uploads plus its ``server_step``; the engine folds that mean as uploads arrive for every such
method (FedAvgM, FedAdam, SCAFFOLD, FedNova, a user's server-lr FedAvg), bit for bit the held mean."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    MeanInfo,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
)
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from fedskew.testing import check_algorithm
from tests.conftest import digits_config


class ServerLR(Algorithm):
    """FedAvg with a server learning rate η (a user's method: only ``server_step``)."""

    eta = 0.5

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        w = server["weights"]
        new = {
            k: w[k] + self.eta * (v - w[k]) if v.is_floating_point() else v
            for k, v in mean.model_state().items()
        }
        return ServerUpdate({**server, "weights": new})


class Inconsistent(Algorithm):
    """Declares a mean but aggregates something else: what the contract check must catch."""

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        update = super().aggregate(server, uploads, info)
        return ServerUpdate(
            {**update.state, "weights": {k: v + 1 for k, v in update.state["weights"].items()}}
        )


def _equal(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.fixture
def user_methods() -> Iterator[None]:
    for name, cls in (("test_server_lr", ServerLR), ("test_inconsistent", Inconsistent)):
        ALGORITHMS.register(name)(cls)
    try:
        yield
    finally:
        ALGORITHMS.discard("test_server_lr", ServerLR)
        ALGORITHMS.discard("test_inconsistent", Inconsistent)


def _cfg(alg: str, **engine: object) -> dict:
    return digits_config(
        rounds=2,
        algorithm={"name": alg},
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5}},
        client={"epochs": 1, "batch_size": 16, "lr": 0.05, "fraction": 0.7},
        engine={"mode": "sequential", "workers": 1, **engine},
    )


def _run(cfg: dict) -> tuple[list[dict], State, int]:
    sim = build_simulation(build_config(cfg))
    try:
        records = [sim.run_round().record for _ in range(2)]
        strip = [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in records if r]
        return strip, sim.server, sim.folded_rounds
    finally:
        sim.close()


@pytest.mark.parametrize(
    "alg",
    [
        "fedavgm", "fedadam", "fedyogi", "fedadagrad", "scaffold", "feddyn", "fednova", "pfedme",
        "perfedavg", "apfl", "test_server_lr",
    ],
)  # fmt: skip
def test_declared_means_take_the_folded_path_bit_for_bit(user_methods: None, alg: str) -> None:
    held = _run(_cfg(alg, fold_uploads=False))
    folded = _run(_cfg(alg))
    assert (held[2], folded[2]) == (0, 2)  # every round folded; none when turned off
    assert folded[0] == held[0]
    assert _equal(folded[1], held[1])


def test_server_lr_is_a_server_step_on_the_mean(user_methods: None) -> None:
    alg = ALGORITHMS.get("test_server_lr").__new__(ALGORITHMS.get("test_server_lr"))
    server = {"weights": {"w": torch.zeros(3)}}
    ups = [
        Upload(0, 1, Payload(arrays={"model.w": torch.full((3,), 2.0)})),
        Upload(1, 3, Payload(arrays={"model.w": torch.full((3,), 6.0)})),
    ]
    new = alg.aggregate(server, ups, RoundInfo(1, None, 0)).state["weights"]["w"]
    assert torch.equal(new, torch.full((3,), 0.5 * (0.25 * 2.0 + 0.75 * 6.0)))


def test_an_aggregate_override_under_a_declared_mean_is_refused_before_round_1(user_methods: None) -> None:
    """The folded path never calls ``aggregate``: a method overriding it while declaring the (default) mean
    would run two rules in one run. The build refuses it in one line, and so does the contract check."""
    with pytest.raises(ConfigError, match="test_inconsistent.*overrides aggregate.*mean_aggregation") as err:
        build_simulation(build_config(_cfg("test_inconsistent")))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="overrides aggregate"):
        check_algorithm("test_inconsistent")
    consistent = type("Declared", (Inconsistent,), {"mean_aggregation": False})
    with ALGORITHMS.replaced("test_inconsistent", consistent):  # declared as not a mean: runs, never folded
        records, _, folded = _run(_cfg("test_inconsistent"))
    assert folded == 0 and len(records) == 2
