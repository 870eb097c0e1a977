"""``client.optimizer`` (AdamW beside the default SGD) and ``client.lr_schedule`` (per-round cosine)."""

from __future__ import annotations

import json
import math
from typing import get_args

import pytest
import torch

from fedskew.algorithms.fedavg import FedAvg
from fedskew.engine.optimizers import OPTIMIZERS, AdamW, local_optimizer, stacked_optimizer
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from fedskew.settings import ClientSection
from tests.test_engine_modes import first_round_outcomes, worker_config
from tests.test_engine_sgd import train_steps


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch_optim_adamw_step_for_step(weight_decay):
    kw = {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    for steps in (1, 3, 8):  # before and after the second layer's skipped steps
        ours = train_steps(lambda ps: AdamW(ps, **kw), steps)
        ref = train_steps(lambda ps: torch.optim.AdamW(ps, **kw), steps)
        for a, b in zip(ours, ref, strict=True):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), steps


def test_adamw_first_step_by_hand():
    p = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = AdamW([p], lr=0.1, weight_decay=0.1)
    (p * torch.tensor([2.0, 4.0])).sum().backward()  # gradient [2, 4]
    opt.step()
    # decay: p·(1 − 0.1·0.1) = [0.99, −1.98]; bias-corrected m̂ = g, v̂ = g²: step lr·g/|g| = 0.1·sign(g)
    assert torch.allclose(p.detach(), torch.tensor([0.89, -2.08]), atol=1e-6)


def test_default_client_section_trains_with_sgd_bit_for_bit():
    cfg = ClientSection(momentum=0.5, weight_decay=1e-3)
    assert cfg.optimizer == "sgd"
    ours = train_steps(lambda ps: local_optimizer(cfg, ps, 0.1, cfg.momentum), 8)
    ref = train_steps(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, weight_decay=1e-3), 8)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def test_the_registry_covers_exactly_the_config_values():
    assert set(OPTIMIZERS) == set(get_args(ClientSection.model_fields["optimizer"].annotation))


@pytest.mark.parametrize("betas", [(0.7, 0.95), (0.0, 0.999)])
def test_stacked_adamw_steps_each_client_at_its_own_count_and_rate(betas):
    cfg = ClientSection(optimizer="adamw", weight_decay=0.05, betas=betas)
    torch.manual_seed(1)
    start = {"w": torch.randn(3, 4, 2), "b": torch.randn(3, 2)}
    members = [[0, 1, 2], [0, 2], [1], [0, 1, 2], [2]]
    grads = [{n: torch.randn(len(m), *v.shape[1:]) for n, v in start.items()} for m in members]
    rates = torch.tensor([0.1, 0.02, 0.05])
    stacked = {n: v.clone() for n, v in start.items()}
    opt = stacked_optimizer(cfg, stacked, ["w", "b"], 0.0)
    for m, g in zip(members, grads, strict=True):
        sel = None if len(m) == 3 else torch.tensor(m)
        params = [stacked[n] if sel is None else stacked[n].index_select(0, sel) for n in ("w", "b")]
        with torch.no_grad():
            opt.step(params, [g["w"], g["b"]], rates[m], sel)
            if sel is not None:
                for n, p in zip(("w", "b"), params, strict=True):
                    stacked[n].index_copy_(0, sel, p)
    for k in range(3):  # client k alone, stepping only where it is a member: torch.optim.AdamW
        ps = [start[n][k].clone().requires_grad_(True) for n in ("w", "b")]
        ref = torch.optim.AdamW(ps, lr=float(rates[k]), betas=betas, weight_decay=0.05)
        for m, g in zip(members, grads, strict=True):
            if k in m:
                for p, n in zip(ps, ("w", "b"), strict=True):
                    p.grad = g[n][m.index(k)].clone()
                ref.step()
        for p, n in zip(ps, ("w", "b"), strict=True):
            assert torch.allclose(stacked[n][k], p.detach(), rtol=1e-6, atol=1e-6), (k, n)


def test_cosine_factors_over_four_rounds_by_hand():
    cosine = [1, (2 + math.sqrt(2)) / 4, 0.5, (2 - math.sqrt(2)) / 4]  # 1, 0.8536, 0.5, 0.1464
    cfg = ClientSection(lr=0.1, lr_schedule="cosine")
    assert [cfg.round_lr_scale(t, 4) for t in (1, 2, 3, 4)] == pytest.approx(cosine, abs=1e-12)
    assert cosine[1] == pytest.approx(0.8536, abs=1e-4) and cosine[3] == pytest.approx(0.1464, abs=1e-4)
    floor = ClientSection(lr=0.1, lr_schedule="cosine", lr_min=0.02)  # η_min + (η − η_min)·½(1 + cos)
    expect = [0.02 + 0.08 * c for c in cosine]
    assert [0.1 * floor.round_lr_scale(t, 4) for t in (1, 2, 3, 4)] == pytest.approx(expect, abs=1e-12)
    decayed = ClientSection(lr=0.1, lr_schedule="cosine", lr_decay=0.5)  # times lr_decay^(t−1)
    assert decayed.round_lr_scale(3, 4) == pytest.approx(0.25 * 0.5)


def test_constant_schedule_is_the_lr_decay_factor_exactly():
    cfg = ClientSection(lr_decay=0.95)
    assert [cfg.round_lr_scale(t, 60) for t in range(1, 61)] == [0.95 ** (t - 1) for t in range(1, 61)]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("client.optimizer=adam", "config key 'client.optimizer': allowed: 'sgd' or 'adamw'"),
        ("client.optimizer=adamw", "config key 'client.optimizer': Value error, adamw needs client.momentum"),
        ("client.betas=[0.9, 0.9]", "client.betas applies to client.optimizer=adamw only"),
        ("client.eps=1e-4", "client.eps applies to client.optimizer=adamw only"),
        ("client.lr_schedule=linear", "config key 'client.lr_schedule': allowed: 'constant' or 'cosine'"),
        ("client.lr_min=0.001", "client.lr_min applies to client.lr_schedule=cosine only"),
    ],
)
def test_bad_optimizer_and_schedule_settings_fail_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        build_config(worker_config("fedavg", 1), [override])  # momentum 0.5, sgd, constant
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_adamw_and_cosine_values_fail_in_one_line():
    base = ["client.optimizer=adamw", "client.momentum=0", "client.lr_schedule=cosine"]
    for override, message in [
        ("client.betas=[0.9, 1.0]", "config key 'client.betas.1': Input should be less than 1"),
        ("client.eps=0", "config key 'client.eps': Input should be greater than 0"),
        ("client.lr_min=0.5", "client.lr_min must not exceed client.lr=0.05"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config(worker_config("fedavg", 1), [*base, override])
    cfg = build_config(worker_config("fedavg", 1), [*base, "client.betas=[0.8, 0.99]", "client.lr_min=0.01"])
    assert cfg.client.betas == (0.8, 0.99)


ADAMW_COSINE = {
    "momentum": 0.0,
    "optimizer": "adamw",
    "weight_decay": 0.01,
    "eps": 1e-4,
    "lr": 0.01,
    "lr_schedule": "cosine",
}


def _recording_lrs(monkeypatch) -> list[tuple[int, float]]:
    seen: list[tuple[int, float]] = []
    finish = FedAvg.finish_local

    def record(self, step, result):
        seen.append((step.info.round, result.lr))
        return finish(self, step, result)

    monkeypatch.setattr(FedAvg, "finish_local", record)
    return seen


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_cosine_run_trains_each_round_at_its_rate(mode, monkeypatch):
    seen = _recording_lrs(monkeypatch)
    sim = build_simulation(build_config(worker_config("fedavg", 1, rounds=4, mode=mode, **ADAMW_COSINE)))
    for _ in range(4):
        sim.run_round()
    assert sim.executor.name == mode
    by_round = {r: {lr for rr, lr in seen if rr == r} for r in (1, 2, 3, 4)}
    factors = [0.5 * (1 + math.cos(math.pi * (t - 1) / 4)) for t in (1, 2, 3, 4)]
    for t, f in zip((1, 2, 3, 4), factors, strict=True):
        assert len(by_round[t]) == 1 and by_round[t].pop() == pytest.approx(0.01 * f, rel=1e-12)


def test_adamw_sequential_and_vectorized_agree():
    opts = {**ADAMW_COSINE, "epochs": 2, "batch_size": 16, "fraction": 1.0}
    seq = build_simulation(build_config(worker_config("fedavg", 1, **opts)))
    vec = build_simulation(build_config(worker_config("fedavg", 1, mode="vectorized", **opts)))
    a = {o.cid: o for o in first_round_outcomes(seq)}
    b = {o.cid: o for o in first_round_outcomes(vec)}
    assert vec.executor.name == "vectorized"
    sizes = {seq.executor.runtime.data.size(c) for c in a}
    assert len(sizes) > 1  # ragged clients: step counts differ per client after the first epoch
    for cid, out in a.items():
        assert out.loss == pytest.approx(b[cid].loss, rel=1e-5)
        for key, t in out.upload.payload.arrays.items():
            assert torch.allclose(t, b[cid].upload.payload.arrays[key], rtol=1e-5, atol=1e-5), (cid, key)
    ra, rb = seq.run_round().record, vec.run_round().record  # round 2 (factor < 1) through the executors
    for key in ("accuracy", "loss", "train_loss"):
        assert ra[key] == pytest.approx(rb[key], rel=1e-5)


def test_adamw_changes_the_numbers_and_workers_reproduce_them(tmp_path):
    runs = {}
    for name, opts, workers in [
        ("sgd", {}, 1),
        ("adamw", ADAMW_COSINE, 1),
        ("adamw_workers", ADAMW_COSINE, 2),
    ]:
        run_experiment(build_config(worker_config("fedavg", workers, rounds=2, **opts)), tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
    assert runs["sgd"][-1]["loss"] != pytest.approx(runs["adamw"][-1]["loss"], rel=1e-3)
    for a, b in zip(runs["adamw"], runs["adamw_workers"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["accuracy"] == pytest.approx(b["accuracy"], rel=1e-6)


def test_the_flower_apps_train_with_adamw_and_the_cosine_rate(tmp_path):
    pytest.importorskip("flwr")
    from tests.flower_loopback import LoopbackGrid
    from tests.test_flower import assert_same_metrics, embedded, flower_config, on_flower

    raw = flower_config("fedavg", rounds=3)
    raw["client"] = {**raw["client"], **ADAMW_COSINE}
    assert_same_metrics(on_flower(raw, tmp_path / "f", LoopbackGrid(3)), embedded(raw, tmp_path / "e"))
