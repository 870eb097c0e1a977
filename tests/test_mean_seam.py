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
    receipt,
    weighted_average,
)
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
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


def check_declared_mean(alg: Algorithm, server: State, uploads: list[Upload], info: RoundInfo) -> None:
    """A method declaring ``mean_aggregation`` gives from ``aggregate`` what the engine gives from the mean
    plus ``server_step`` (the folded path skips ``aggregate``): the same bits."""
    if not alg.mean_aggregation or not uploads:
        return
    weights = alg.mean_weights([u.num_samples for u in uploads])
    mean = Payload(arrays=weighted_average([u.payload.arrays for u in uploads], weights))
    engine = alg.server_step(server, mean, MeanInfo(info, [receipt(u) for u in uploads], weights)).state
    own = alg.aggregate(server, uploads, info).state
    same = engine.keys() == own.keys() and all(_equal(engine[k], own[k]) for k in engine)
    assert same, f"{alg.name} declares mean_aggregation but its aggregate differs from mean + server_step"


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


@pytest.mark.parametrize("alg", ["fedavgm", "fedadam", "scaffold", "test_server_lr"])
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
    check_declared_mean(alg, server, ups, RoundInfo(1, None, 0))


def test_an_aggregate_that_disagrees_with_its_declared_mean_is_caught(user_methods: None) -> None:
    alg = ALGORITHMS.get("test_inconsistent").__new__(ALGORITHMS.get("test_inconsistent"))
    server = {"weights": {"w": torch.zeros(2)}}
    ups = [Upload(0, 2, Payload(arrays={"model.w": torch.ones(2)}))]
    with pytest.raises(AssertionError, match="differs from mean"):
        check_declared_mean(alg, server, ups, RoundInfo(1, None, 0))
