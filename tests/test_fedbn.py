"""FedBN (Li et al. 2021, Algorithm 1): BatchNorm layers never leave their client.

The defining behaviour on small cases: the server averages every entry but BatchNorm's (a hand-computed
weighted mean), a client keeps its own γ, β and running statistics across rounds, its running mean is the
BatchNorm update of its own data only (hand-checked), and the worker processes give the sequential numbers
and client states.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import (
    ClientView,
    Context,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    Upload,
    load_state,
    model_arrays,
)
from fedskew.algorithms.fedbn import batchnorm_names
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from fedskew.models.base import FedModel
from fedskew.settings import ClientSection
from tests.test_contract import tiny_config


class TinyBN(FedModel):
    """x (2 features) -> Linear 2x2 -> BatchNorm1d(2) -> Linear 2 -> 2 classes."""

    embed_dim = 2

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2, momentum=0.5)
        self.classifier = nn.Linear(2, 2)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.body.bias.zero_()
            self.classifier.weight.fill_(0.5)
            self.classifier.bias.zero_()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.body(x))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.classifier(z)


def fedbn() -> object:
    ctx = Context(
        num_clients=2,
        num_classes=2,
        in_shape=(2,),
        device=torch.device("cpu"),
        client=ClientSection(epochs=1, lr=0.1, batch_size=2),
        client_sizes=torch.tensor([1.0, 3.0]),
        class_counts=torch.tensor([[1, 0], [0, 3]]),
        rounds=1,
        seed=0,
        build_model=lambda cid: TinyBN(),
    )
    cls = ALGORITHMS.get("fedbn")
    return cls(cls.Params(), ctx)


BN_KEYS = {"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


def test_batchnorm_entries_are_found_by_module_type():
    assert batchnorm_names(TinyBN()) == BN_KEYS


def test_the_server_sends_and_averages_everything_but_batchnorm():
    alg = fedbn()
    server = alg.init_server(TinyBN())
    payload = alg.broadcast(server, RoundInfo(1, 0, 0))
    assert set(payload.model_state()) == {"body.weight", "body.bias", "classifier.weight", "classifier.bias"}

    def upload(cid: int, n: int, value: float) -> Upload:
        sd = {k: torch.full_like(v, value) for k, v in TinyBN().state_dict().items()}
        return Upload(cid, n, Payload(arrays=model_arrays(sd, lambda k: k not in BN_KEYS)))

    new = alg.aggregate(server, [upload(0, 1, 2.0), upload(1, 3, 6.0)], RoundInfo(1, None, 0)).state
    # w = (1·2 + 3·6) / 4 = 5 for every shared entry; no BN entry on the server
    assert set(new["weights"]) == set(payload.model_state())
    for v in new["weights"].values():
        assert torch.equal(v, torch.full_like(v, 5.0))


def test_a_client_trains_with_and_keeps_its_own_batchnorm():
    alg = fedbn()
    server = alg.init_server(TinyBN())
    payload = alg.broadcast(server, RoundInfo(1, 0, 0))
    state = alg.init_client(0)
    state["personal"] = {**state["personal"], "bn.running_mean": torch.tensor([7.0, -7.0])}
    model = TinyBN()
    load_state(model, alg.model_weights(payload, state))
    assert torch.equal(
        model.bn.running_mean, torch.tensor([7.0, -7.0])
    )  # its own statistics, not the server's

    x = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    model.train()
    model(x)  # one BatchNorm training step: running = (1 − 0.5)·running + 0.5·batch mean
    client = ClientView(0, x, torch.tensor([0, 0]), torch.tensor([2, 0]))
    step = LocalStep(model=model, payload=payload, state=state, client=client, info=RoundInfo(1, 0, 0))
    out = alg.finish_local(step, LocalResult(steps=1, loss=0.0, lr=0.1))
    # batch mean of body(x) = x (identity): (2, 4) -> running = 0.5·(7, −7) + 0.5·(2, 4) = (4.5, −1.5)
    assert torch.allclose(out.state["personal"]["bn.running_mean"], torch.tensor([4.5, -1.5]))
    assert int(out.state["personal"]["bn.num_batches_tracked"]) == 1
    assert not set(out.upload.model_state()) & BN_KEYS  # nothing of BN leaves the client


def test_there_is_no_global_model_to_evaluate():
    alg = fedbn()
    payload = alg.broadcast(alg.init_server(TinyBN()), RoundInfo(1, None, 0))
    with pytest.raises(ConfigError, match="no global BatchNorm layers"):
        alg.eval_weights(payload, None)


@pytest.mark.slow
def test_workers_keep_each_clients_running_statistics_as_the_sequential_loop():
    seq = build_simulation(build_config(tiny_config("fedbn", rounds=2)))
    pooled = build_simulation(build_config(tiny_config("fedbn", rounds=2, mode="sequential", workers=2)))
    try:
        for _ in range(2):
            seq.run_round()
            pooled.run_round()
        changed = 0
        for cid in range(6):
            a, b = seq.client_state(cid)["personal"], pooled.client_state(cid)["personal"]
            assert a.keys() == b.keys() and a
            for k in a:
                assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-6), (cid, k)
            changed += int(a["body.0.1.num_batches_tracked"]) > 0
        assert changed >= 4  # clients sampled at least once hold their own, trained BN layers
        means = [seq.client_state(c)["personal"]["body.0.1.running_mean"] for c in range(6)]
        assert len({tuple(m.tolist()) for m in means}) >= 4  # statistics differ between clients
    finally:
        seq.close()
        pooled.close()
