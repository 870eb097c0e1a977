"""Engine modes: forked workers (engine.workers) and vectorized training (engine.mode=vectorized) give the
sequential loop's results; fallbacks say why."""

from __future__ import annotations

import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.fedavg import FedAvg
from fedskew.engine import modes
from fedskew.engine.evaluation import EVAL_BATCH
from fedskew.engine.executors import EXECUTORS
from fedskew.engine.loop import Simulation
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.engine.workers import WorkerExecutor
from fedskew.errors import RunFailure
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from tests.conftest import digits_config


def model_of(sim: Simulation, cid: int = 0) -> torch.nn.Module:
    return sim.executor.runtime.models.model_for(cid)


def first_round_outcomes(sim: Simulation) -> list[ClientOutcome]:
    """The first round's client outcomes through the simulation's own executor, nothing committed."""
    cids = sim.schedule[0].tolist()
    return sim.executor.train(RoundJob(1, cids, sim.server, {c: sim.client_state(c) for c in cids}))


def worker_config(alg: str, workers: int, rounds: int = 2, mode: str = "sequential", **client) -> dict:
    cfg = digits_config(
        rounds=rounds,
        algorithm={"name": alg},
        engine={"workers": workers, "mode": mode},
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5}},
        client={"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.5, "fraction": 0.67, **client},
    )
    if ALGORITHMS.get(alg).personalized_eval:  # personal models (FedProto, local): evaluated per client
        cfg["eval"] = {"protocol": "personalized", "every": 1}
    return cfg


def test_worker_errors_reach_the_parent(tmp_path, monkeypatch):
    def boom(self, step, batch):
        raise ValueError("broken loss")

    monkeypatch.setattr(FedAvg, "local_loss", boom)
    with pytest.raises(RunFailure, match=r"round 1: client \d+ raised ValueError: broken loss"):
        run_experiment(build_config(worker_config("fedavg", 2)), tmp_path / "run")


def test_unsupported_device_falls_back_in_process(monkeypatch, caplog):
    sim = build_simulation(build_config(worker_config("fedavg", 2, rounds=1)))
    monkeypatch.setattr(modes, "pool_supported", lambda device: "engine.workers > 1 needs engine.device=cpu")
    with caplog.at_level("INFO", logger="fedskew.engine"):
        sim.run_round()
    assert sim.executor.name == "sequential"
    assert "needs engine.device=cpu" in caplog.text


def test_vectorized_steps_each_client_at_its_own_learning_rate(monkeypatch, caplog):
    from fedskew.algorithms.base import LocalPlan, Phase

    def start_local(self, step):  # FedEnt-style per-client rates: 1x, 2x, 3x
        return LocalPlan([Phase(self.ctx.client.epochs, self.ctx.client.lr * (1 + step.client.cid % 3))])

    monkeypatch.setattr(FedAvg, "start_local", start_local)
    opts = {"epochs": 2, "batch_size": 16, "fraction": 1.0}
    seq = build_simulation(build_config(worker_config("fedavg", 1, **opts)))
    vec = build_simulation(build_config(worker_config("fedavg", 1, mode="vectorized", **opts)))
    a = {o.cid: o for o in first_round_outcomes(seq)}
    with caplog.at_level("WARNING", logger="fedskew.engine"):
        b = {o.cid: o for o in first_round_outcomes(vec)}
    assert vec.executor.name == "vectorized" and "sequentially" not in caplog.text  # really vmapped
    assert len({a[c].loss for c in a}) > 1
    for cid, out in a.items():
        for key, t in out.upload.payload.arrays.items():
            assert torch.allclose(t, b[cid].upload.payload.arrays[key], rtol=1e-5, atol=1e-6), (cid, key)


@pytest.mark.parametrize("alg", ["fedavg", "fedproto"])
def test_vectorized_groups_in_workers_match_the_sequential_loop(alg):
    opts = {"epochs": 2, "batch_size": 16, "fraction": 1.0}
    seq = build_simulation(build_config(worker_config(alg, 1, **opts)))
    vec = build_simulation(build_config(worker_config(alg, 2, mode="vectorized", **opts)))
    try:
        for _ in range(2):
            a, b = seq.run_round().record, vec.run_round().record
            for key in ("accuracy", "loss", "train_loss"):
                assert a[key] == pytest.approx(b[key], rel=1e-5)
        assert vec.executor.name == "vectorized+workers" and vec.executor.processes == 2
    finally:
        vec.close()


def test_balanced_groups_split_clients_by_total_size():
    from fedskew.engine.workers import balanced_groups

    sizes = {0: 50, 1: 40, 2: 30, 3: 20, 4: 10, 5: 10}
    groups = balanced_groups(list(sizes), sizes.__getitem__, 2)
    assert sorted(c for g in groups for c in g) == list(sizes)
    assert sorted(sum(sizes[c] for c in g) for g in groups) == [80, 80]
    assert balanced_groups([3], sizes.__getitem__, 4) == [[3]]


@pytest.mark.parametrize("alg", ["moon", "fedskc"])
def test_vectorized_falls_back_for_stateful_losses(alg, caplog):
    with caplog.at_level("WARNING", logger="fedskew.engine"):
        sim = build_simulation(build_config(worker_config(alg, 1, rounds=1, mode="vectorized")))
        sim.run_round()
    assert sim.executor.name == "sequential" and f"{alg}'s local loss" in caplog.text


def test_vectorized_refuses_batchnorm_running_statistics(caplog):
    cfg = worker_config("fedavg", 1, rounds=1, mode="vectorized")
    cfg["model"] = {"name": "resnet8", "width": 4}
    cfg["data"]["dataset"] = "digits"
    with caplog.at_level("WARNING", logger="fedskew.engine"):
        sim = build_simulation(build_config(cfg))
        sim.run_round()
    assert sim.executor.name == "sequential" and "BatchNorm" in caplog.text


def _auto_choice(cfg: dict) -> str:
    """The executor ``engine.mode=auto`` chose for the first round of ``cfg``."""
    sim = build_simulation(build_config(cfg))
    try:
        sim.run_round()
        return sim.executor.name
    finally:
        sim.close()


def test_auto_vectorizes_small_dropout_free_models_only():
    small = worker_config("fedavg", 1, rounds=1, mode="auto", batch_size=8)
    small["model"] = {"name": "cnn_fedproto", "padding": 2, "dropout": 0.0}  # 21.8k parameters
    assert _auto_choice(small) == "vectorized"
    dropout = dict(small, model={"name": "cnn_fedproto", "padding": 2})
    assert _auto_choice(dropout) == "sequential"  # vmap's dropout stream would change the numbers
    large = worker_config("fedavg", 2, rounds=1, mode="auto", epochs=2)  # 430k params, 240 x 2
    assert _auto_choice(large) == "workers"
    tiny = worker_config("fedprox", 2, rounds=1, mode="auto")  # ~120 samples x 1 epoch per client
    tiny["data"]["num_clients"] = 12
    tiny["engine"]["fold_uploads"] = False
    assert _auto_choice(tiny) == "sequential"  # shipping every upload back would cost more than training
    tiny["engine"]["fold_uploads"] = True  # folded in the workers, a round ships no upload
    assert _auto_choice(tiny) == "workers"
    tiny["algorithm"] = {"name": "scaffold"}  # a uniform mean (contract v4): folded too
    assert _auto_choice(tiny) == "workers"
    tiny["algorithm"] = {"name": "qfedavg"}  # its own aggregation (not a mean): nothing to fold
    assert _auto_choice(tiny) == "sequential"


class _OrderSpy(dict):
    """Client states that record the order in which a worker pool reads them (one read per task)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.order: list[int] = []

    def __getitem__(self, cid):
        self.order.append(cid)
        return super().__getitem__(cid)


def test_largest_clients_go_out_first():
    sim = build_simulation(build_config(worker_config("fedavg", 2, rounds=1)))
    cids = sim.schedule[0].tolist()
    states = _OrderSpy({cid: sim.client_state(cid) for cid in cids})
    sequential = EXECUTORS.get("sequential")(sim.executor.engine)
    executor = WorkerExecutor(sim.executor.runtime, sequential, workers=2)
    try:
        executor.train(RoundJob(1, cids, sim.server, states))
    finally:
        executor.close()
    size = sim.executor.runtime.data.size
    first, rest = states.order[:2], [c for c in cids if c not in states.order[:2]]
    assert min(size(c) for c in first) >= max(size(c) for c in rest)  # the two largest clients first


def test_vectorized_chunks_under_a_memory_budget_give_the_same_round():
    from fedskew.engine.vectorized import chunk_size

    cfg = worker_config("fedprox", 1, rounds=1, mode="vectorized")
    cfg["engine"]["memory_mb"] = 1.0  # below one client of the 430k-parameter MLP: one client per chunk
    small = build_simulation(build_config(cfg))
    size = chunk_size(small.executor.runtime.models.model_for(0), small.executor.runtime.data.x, 32, 1.0)
    assert 1 <= size < len(small.schedule[0])  # really split into several chunks
    whole = build_simulation(build_config(worker_config("fedprox", 1, rounds=1, mode="vectorized")))
    a, b = small.run_round().record, whole.run_round().record
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["accuracy"] == pytest.approx(b["accuracy"], rel=1e-6)


def _is_channels_last(model: torch.nn.Module) -> bool:
    convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    return bool(convs) and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)


def test_memory_format_auto_uses_channels_last_for_cpu_convolutions_and_changes_no_result():
    def conv_config(fmt: str, workers: int = 1, mode: str = "sequential") -> dict:
        cfg = worker_config("fedprox", workers, mode=mode)
        cfg["model"] = {"name": "cnn_fedproto", "padding": 2}
        cfg["engine"]["memory_format"] = fmt
        return cfg

    nhwc = build_simulation(build_config(conv_config("auto")))
    nchw = build_simulation(build_config(conv_config("contiguous")))
    par = build_simulation(build_config(conv_config("auto", workers=2)))
    assert _is_channels_last(model_of(nhwc)) and not _is_channels_last(model_of(nchw))
    try:
        for _ in range(2):
            a, b, c = nhwc.run_round().record, nchw.run_round().record, par.run_round().record
            # same values, another summation order inside the convolutions
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
            assert a["accuracy"] == pytest.approx(b["accuracy"], abs=0.01)
            assert c["loss"] == pytest.approx(a["loss"], rel=1e-5)  # workers: same layout, same numbers
    finally:
        par.close()
    vec = build_simulation(build_config(conv_config("auto", mode="vectorized")))
    assert not _is_channels_last(model_of(vec))  # vmap stacks the weights: left in NCHW
    # NCHW sequential and vectorized agree to 1e-5 on a (dropout-free) convolutional model
    seq_cfg, vec_cfg = conv_config("contiguous"), conv_config("auto", mode="vectorized")
    for cfg in (seq_cfg, vec_cfg):
        cfg["model"]["dropout"] = 0.0
    seq, vec = build_simulation(build_config(seq_cfg)), build_simulation(build_config(vec_cfg))
    a, b = seq.run_round().record, vec.run_round().record
    assert vec.executor.name == "vectorized"
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["accuracy"] == b["accuracy"]
    mlp = build_simulation(build_config(worker_config("fedavg", 1)))
    assert not any(p.dim() == 4 for p in model_of(mlp).parameters())
    with pytest.raises(Exception, match="memory_format"):
        build_config(conv_config("nhwc"))


def test_evaluation_batch_defaults_by_device_and_does_not_change_metrics():
    sim = build_simulation(build_config(worker_config("fedavg", 1, rounds=1)))
    assert sim.evaluator.batch_size == EVAL_BATCH["cpu"]
    cfg = worker_config("fedavg", 1, rounds=1)
    cfg["eval"] = {"batch_size": 7}
    odd = build_simulation(build_config(cfg))
    a, b = sim.run_round().record, odd.run_round().record
    assert a["accuracy"] == b["accuracy"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_worker_arena_round_trips_tensors_and_falls_back_inline_when_full():
    from fedskew.engine.arena import Arena

    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    msg = {
        "w": x,
        "view": torch.arange(10.0)[::3],  # non-contiguous
        "half": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.tensor([7, 8], dtype=torch.int64),
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
        "nested": [torch.ones(3, requires_grad=True), ("text", 1.5)],
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    arena = Arena(nbytes=4096)
    out = arena.loads(arena.dumps(msg))
    for key in ("w", "view", "half", "mask", "ids", "scalar", "empty"):
        assert out[key].dtype == msg[key].dtype and torch.equal(out[key], msg[key]), key
    assert out["nested"][0].requires_grad and out["nested"][1] == ("text", 1.5)
    assert isinstance(out["param"], torch.nn.Parameter)
    big = torch.randn(2000)  # 8,000 bytes > the 4,096-byte arena: pickled inline, still exact
    data = arena.dumps({"big": big, "small": torch.ones(2)})
    assert len(data) > 8000 and torch.equal(arena.loads(data)["big"], big)
    x.add_(1.0)  # the loaded copies do not alias the arena or the source
    assert not torch.equal(out["w"], x)
