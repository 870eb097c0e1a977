"""The bare Flower app of benchmarks/flower_runtime.py (issue 51, item 8) trains the workload fedskew's
deployment trains: each node the round's sampled clients that live on it, replying with their
sample-weighted mean, so that Flower's FedAvg over the nodes is the sample-weighted mean over all clients.
In process, through the loopback grid of tests/flower_loopback.py (Flower's wire format, no processes)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("flwr")

from benchmarks import flower_bare as bare
from benchmarks.flower_runtime import TARGET, compare
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

import tests.flower_loopback as loopback
from tests.conftest import digits_config

CFG = digits_config(rounds=2)
CFG["data"]["num_clients"] = 8
CFG["client"]["fraction"] = 0.5


@pytest.fixture
def workload(tmp_path, monkeypatch):
    """A two-node bundle (8 clients, 4 per round) and a loopback grid running the bare ClientApp."""
    path = tmp_path / "bundle.pt"
    b = bare.write_bundle(CFG, path, nodes=2)
    monkeypatch.setenv(bare.BUNDLE_ENV, str(path))
    monkeypatch.setattr(loopback, "client_app", bare.client_app)
    grid = loopback.LoopbackGrid(2)
    partitions(grid, 2)  # the loopback grid numbers partitions as nodes join
    return b, path, grid


def partitions(grid, count: int) -> None:
    """Every node of ``grid`` told that the federation has ``count`` partitions."""
    for index, node in enumerate(sorted(grid.contexts)):
        cfg = {"partition-id": index, "num-partitions": count}
        grid.contexts[node] = Context(
            run_id=1, node_id=node, node_config=cfg, state=RecordDict(), run_config={}
        )


def global_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in bare.build_model().state_dict().items()}


def train_round(grid, state, server_round: int) -> list[Message]:
    content = RecordDict(
        {"arrays": ArrayRecord(state), "config": ConfigRecord({"server-round": server_round})}
    )
    msgs = [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in grid.get_node_ids()]
    return list(grid.send_and_receive(msgs))


def hand_mean(b, state, cids, server_round):
    """Each client trained alone, then the sample-weighted mean: what fedskew's FedAvg computes."""
    parts = [bare.train_clients(b, state, [c], server_round) for c in cids]
    total = sum(n for _, n in parts)
    return {k: sum(n * s[k].double() for s, n in parts) / total for k in state}, total


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].double(), b[k].double(), atol=1e-6) for k in a)


def test_each_node_trains_its_clients_of_the_round_and_fedavg_gives_the_mean_over_all_clients(workload):
    b, _, grid = workload
    state = global_state()
    replies = train_round(grid, state, 2)
    round_clients = b["schedule"][1]
    by_node = {int(m.metadata.src_node_id) - 100: m for m in replies}
    for index, reply in by_node.items():
        mine = [c for c in round_clients if c % 2 == index]
        assert mine, "the fixture's round should give both nodes clients"
        expected, n = hand_mean(b, state, mine, 2)
        assert reply.content["metrics"]["num-examples"] == n == sum(len(b["train_idx"][c]) for c in mine)
        assert close(reply.content["arrays"].to_torch_state_dict(), expected)
    everyone, _ = hand_mean(b, state, round_clients, 2)
    arrays, _ = FedAvg().aggregate_train(2, replies)
    assert close(arrays.to_torch_state_dict(), everyone)


def test_a_node_without_clients_in_the_round_does_not_dilute_the_mean(workload):
    b, path, grid = workload
    b["schedule"][0] = [0, 2, 4, 6]  # round 1: node 1 holds none of the sampled clients
    torch.save(b, path)
    state = global_state()
    replies = train_round(grid, state, 1)
    empty = next(m for m in replies if m.content["metrics"]["num-examples"] == 0)
    assert close(empty.content["arrays"].to_torch_state_dict(), state)  # the global model, weight 0
    arrays, _ = FedAvg().aggregate_train(1, replies)
    assert close(arrays.to_torch_state_dict(), hand_mean(b, state, [0, 2, 4, 6], 1)[0])


@pytest.mark.parametrize("server_round", [0, 3])
def test_a_round_outside_the_workload_is_an_error_reply_not_another_rounds_clients(workload, server_round):
    _, _, grid = workload
    replies = train_round(grid, global_state(), server_round)
    assert len(replies) == 2 and all(m.has_error() for m in replies)
    assert "outside the bundle's rounds 1..2" in replies[0].error.reason


def test_a_node_counting_other_partitions_than_the_workload_is_an_error_reply(workload):
    _, _, grid = workload
    partitions(grid, 3)  # c % 3 would train clients fedskew puts elsewhere
    replies = train_round(grid, global_state(), 1)
    assert all(
        m.has_error() and "num-partitions 3 is not the workload's 2 nodes" in m.error.reason for m in replies
    )


def test_the_server_app_runs_fedavg_and_stamps_every_round(workload):
    _, path, grid = workload
    bare.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    stamps = json.loads(path.with_suffix(".stamps.json").read_text())
    assert len(stamps["times"]) == len(stamps["accuracy"]) == 3  # before round 1, after rounds 1 and 2
    assert stamps["times"] == sorted(stamps["times"])
    assert stamps["accuracy"][2] > stamps["accuracy"][0]  # it trained


def rows(deployment: list[float], bare_rounds: list[float]) -> list[dict]:
    return [
        {"runtime": "flower-deployment", "rounds_s": deployment},
        {"runtime": "flower-bare", "rounds_s": bare_rounds},
    ]


def test_the_comparison_pairs_rounds_and_leaves_round_one_out():
    cmp = compare(rows([99.0, 6.0, 5.0, 7.0], [1.0, 5.0, 5.0, 5.0]))
    assert cmp is not None
    assert cmp["deployment/flower-bare"]["median"] == pytest.approx(1.2)  # 6/5, 5/5, 7/5
    assert cmp["deployment"]["median"] == 6.0 and cmp["flower-bare"]["median"] == 5.0
    assert cmp["met"] is (TARGET >= 1.2)
    assert compare(rows([9.0, 9.0, 9.0], [1.0, 5.0, 5.0]))["met"] is False


def test_the_comparison_refuses_unequal_rounds_rather_than_pairing_them_wrongly():
    assert compare(rows([9.0, 6.0, 5.0], [1.0, 5.0])) is None
    assert compare([{"runtime": "flower-deployment", "rounds_s": [1.0, 2.0]}]) is None
