"""Asynchronous aggregation on the virtual clock (fedskew.engine.asynchronous): FedBuff with K = m, no
staleness and η_g = 1 is synchronous FedAvg (and FedAvgM) bit for bit, FedAsync's mixing on a hand case, the
staleness functions on hand values, staleness that really occurs, deterministic replays and exact resume,
the refusals (one line, exit 2), a non-finite client and a federation nobody is online in."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from benchmarks.faults import faulty_fedavg

from fedskew.algorithms.base import RoundInfo
from fedskew.engine.asynchronous import MIXERS, MixInput, staleness_weight
from fedskew.engine.client import train_client
from fedskew.engine.clock import HOUR
from fedskew.engine.clock_config import ClockSection
from fedskew.engine.policy import ClientError
from fedskew.engine.sampling import sampling_schedule
from fedskew.errors import ConfigError
from fedskew.experiment.build import build_simulation
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from tests.conftest import StopRun, cli, digits_config, run_metrics, stop_after

IID = {"name": "iid"}  # 5 clients of 287-288 samples: 9 local steps each, so equal speeds mean equal times
SKEWED = {"name": "dirichlet", "alpha": 0.5}
HETEROGENEOUS = {"distribution": "lognormal", "value": 0.01, "sigma": 1.0}


def config(aggregation: str | None, rounds: int = 3, partition: dict | None = None, **clock: Any) -> dict:
    """5 digits clients, m = 3 a round (fraction 0.6), a small MLP; ``aggregation=None``: no clock."""
    cfg = digits_config(
        rounds=rounds,
        data={"dataset": "digits", "num_clients": 5, "partition": partition or IID},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        client={"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.5, "fraction": 0.6},
        engine={"mode": "sequential", "workers": 1},
        checkpoint={"every": 1},
    )
    if aggregation is not None:
        cfg["clock"] = {"aggregation": aggregation, **clock}
    return cfg


def tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) server state, in key order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state) for t in tensors(state[k])]
    return []


# ---------------------------------------------------------------------------- FedBuff = sync FedAvg
@pytest.mark.parametrize("method", ["fedavg", "fedavgm"])
def test_fedbuff_with_k_m_no_staleness_and_unit_server_lr_is_synchronous_fedavg_bit_for_bit(method):
    base = config(None, rounds=3)
    base["algorithm"] = {"name": method}
    sync = build_simulation(build_config(base))
    buff = build_simulation(build_config({**base, "clock": {"aggregation": "fedbuff", "concurrency": 3,
                                                            "buffer": 3, "server_lr": 1.0}}))  # fmt: skip
    samples = set()
    for r in range(1, 4):
        want, got = sync.run_round().record, buff.run_round().record
        assert got["arrived"] == sync.schedule[r - 1].tolist()  # the synchronous sample, all of it
        assert got["staleness_max"] == 0 and got["in_flight"] == 0
        assert (got["accuracy"], got["loss"], got["train_loss"]) == (want["accuracy"], want["loss"],
                                                                     want["train_loss"])  # fmt: skip
        samples.add(tuple(got["arrived"]))
    assert len(samples) > 1  # fraction < 1: the sample changed between updates
    assert all(torch.equal(a, b) for a, b in zip(tensors(sync.server), tensors(buff.server), strict=True))
    assert buff.now > 0


def test_a_server_learning_rate_moves_the_model_part_of_the_way():
    cfg = config("fedbuff", rounds=1, concurrency=3, buffer=3)
    whole = build_simulation(build_config(cfg))
    half = build_simulation(build_config(cfg, ["clock.server_lr=0.5"]))
    x0 = {k: v.clone() for k, v in half.server["weights"].items()}
    whole.run_round(), half.run_round()
    for k, x in x0.items():  # x + 0.5 (mean − x): halfway between the start and the FedAvg mean
        assert torch.allclose(
            half.server["weights"][k], x + 0.5 * (whole.server["weights"][k] - x), atol=1e-6
        )
    key = next(iter(x0))
    assert not torch.equal(half.server["weights"][key], whole.server["weights"][key])


# ---------------------------------------------------------------------------- FedAsync and staleness
def test_fedasync_mixes_the_first_arrivals_model_into_the_global_one():
    cfg = build_config(config("fedasync", rounds=1, partition=SKEWED, mixing=0.5, staleness="constant"))
    sim = build_simulation(cfg)
    x0 = {k: v.clone() for k, v in sim.server["weights"].items()}
    (c,) = sim.run_round().record["arrived"]
    # equal speeds: the first to land is the sampled client with the fewest local steps (ties: lowest id)
    sizes = sim.algorithm.ctx.client_sizes.tolist()
    row = sampling_schedule(5, 0.6, 1, 0)[0].tolist()
    assert c == min(row, key=lambda i: (math.ceil(sizes[i] / 32), i))
    # the client's model, trained independently from the same payload, state and seed
    fresh = build_simulation(cfg)
    payload = fresh.algorithm.broadcast(fresh.server, RoundInfo(1, c, cfg.seed))
    out = train_client(fresh.executor.runtime, c, 1, payload, fresh.client_state(c))
    assert out.upload is not None
    u_c = out.upload.payload.model_state()
    for k, x in x0.items():
        assert torch.equal(sim.server["weights"][k], 0.5 * x + 0.5 * u_c[k])


@pytest.mark.parametrize(
    ("name", "tau", "a", "b", "want"),
    [
        ("constant", 7, 0.5, 4, 1.0),
        ("polynomial", 0, 0.5, 4, 1.0),
        ("polynomial", 3, 0.5, 4, 0.5),  # (3 + 1)^-0.5
        ("hinge", 4, 10.0, 4, 1.0),  # τ <= b
        ("hinge", 5, 10.0, 4, 1 / 11),  # 1 / (10 (5 − 4) + 1)
        ("hinge", 0, 10.0, 4, 1.0),
    ],
)
def test_staleness_functions_on_hand_values(name, tau, a, b, want):
    assert staleness_weight(name, tau, a, b) == pytest.approx(want, rel=1e-15)


def test_the_mixing_formulas_on_hand_tensors():
    x, b = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])  # b: an older model the client started from
    u1, u2 = torch.tensor([3.0, 6.0]), torch.tensor([5.0, 2.0])
    n = {"steps": torch.tensor([10])}  # an integer buffer: mixed in float64, rounded back to its dtype
    s = staleness_weight("polynomial", 3, 0.5, 0)  # 0.5
    clock = ClockSection(aggregation="fedasync", mixing=0.6, staleness="polynomial")
    one = MixInput(
        {"w": x, **n}, [{"w": u1, "steps": torch.tensor([20])}], [{"w": b, **n}], [s], torch.ones(1)
    )
    got = MIXERS["fedasync"](one, clock)  # α_t = 0.6 x 0.5 = 0.3: 0.7 x + 0.3 u
    assert torch.allclose(got["w"], 0.7 * x + 0.3 * u1) and got["steps"].tolist() == [13]
    assert got["steps"].dtype == torch.int64
    two = MixInput(
        {"w": x}, [{"w": u1}, {"w": u2}], [{"w": b}, {"w": x}], [s, 1.0], torch.tensor([0.25, 0.75])
    )
    buff = MIXERS["fedbuff"](two, ClockSection(aggregation="fedbuff", server_lr=0.5))
    # x + η_g Σ w_i s_i (u_i − b_i) = x + 0.5 (0.25 · 0.5 · (u1 − 0) + 0.75 · 1 · (u2 − x))
    assert torch.allclose(buff["w"], x + 0.5 * (0.125 * u1 + 0.75 * (u2 - x)))
    fresh = MixInput({"w": x}, [{"w": u2}], [{"w": x}], [1.0], torch.ones(1))
    assert MIXERS["fedbuff"](fresh, ClockSection(aggregation="fedbuff"))["w"] is not u2  # a new tensor
    assert torch.equal(MIXERS["fedbuff"](fresh, ClockSection(aggregation="fedbuff"))["w"], u2)  # exactly u


def stale_config(aggregation: str, rounds: int = 4) -> dict:
    return config(aggregation, rounds=rounds, partition=SKEWED, concurrency=4, buffer=2, dropout=0.2,
                  step_seconds=HETEROGENEOUS)  # fmt: skip


@pytest.mark.parametrize("aggregation", ["fedbuff", "fedasync"])
def test_staleness_occurs_is_logged_and_runs_replay_and_resume_exactly(tmp_path, aggregation):
    cfg = build_config(stale_config(aggregation))
    run_experiment(cfg, tmp_path / "whole")
    run_experiment(cfg, tmp_path / "again")
    with pytest.raises(StopRun):
        run_experiment(cfg, tmp_path / "cut", on_round=stop_after(2))
    assert len(run_metrics(tmp_path / "cut")) == 2
    run_experiment(cfg, tmp_path / "cut", resume=True)
    whole = run_metrics(tmp_path / "whole")
    assert run_metrics(tmp_path / "again") == whole  # deterministic per seed
    assert run_metrics(tmp_path / "cut") == whole  # exact resume, clients in flight included
    assert whole[1]["in_flight"] > 0  # the checkpoint after update 2 held clients in flight
    assert max(r["staleness_max"] for r in whole) > 0  # concurrency > K with unequal speeds: stale uploads
    times = [r["virtual_time"] for r in whole]
    assert times == sorted(times) and times[0] > 0
    assert all(len(r["arrived"]) == (2 if aggregation == "fedbuff" else 1) for r in whole)


def test_a_higher_concurrency_makes_uploads_staler():
    """Sanity of the event order: with K = 1 and every slot busy, each update lands one client while the
    others keep training on older models, so mean staleness grows with concurrency."""

    def mean_staleness(concurrency: int) -> float:
        raw = config(
            "fedasync", rounds=4, partition=SKEWED, concurrency=concurrency, step_seconds=HETEROGENEOUS
        )
        sim = build_simulation(build_config(raw))
        records = [sim.run_round().record for _ in range(4)]
        return sum(r["staleness_mean"] for r in records) / 4

    assert mean_staleness(1) == 0.0
    assert mean_staleness(5) > 0.5


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("over", "problem"),
    [
        (["algorithm.name=fedproto", "eval.protocol=personalized"], "does not aggregate by a mean"),
        (["clock.buffer=4", "clock.concurrency=3"], "clock.buffer"),
        (["clock.concurrency=6"], "clock.concurrency"),
        (["clock.deadline=2"], "clock.deadline"),
        (["clock.staleness=linear"], "clock.staleness"),
    ],
)
def test_bad_asynchronous_input_is_one_line(over, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        build_config(config("fedbuff"), over)
    assert "\n" not in str(err.value)


def test_uploads_that_are_not_models_are_refused_before_anything_commits():
    """SCAFFOLD declares a mean, but its upload carries control-variate deltas the global model has no
    counterpart of: mixing them with stale models would be meaningless."""
    cfg = config("fedbuff", rounds=2)
    cfg["algorithm"] = {"name": "scaffold"}
    sim = build_simulation(build_config(cfg))
    with pytest.raises(ConfigError, match=r"scaffold's uploads carry control\.") as err:
        sim.run_round()
    assert "\n" not in str(err.value) and sim.round == 0 and sim.now == 0.0


def test_the_cli_refuses_asynchronous_scaffold_and_a_short_buffer_with_exit_2(tmp_path, monkeypatch, capsys):
    cfg = config("fedbuff", rounds=1)
    cfg["algorithm"] = {"name": "scaffold"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, _, err = cli(["run", str(path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and "uploads carry control." in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(["run", str(path), "--out", str(tmp_path / "o2"), "--set", "algorithm.name=fedavg",
                        "--set", "clock.buffer=5"], monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "clock.buffer" in err


# ---------------------------------------------------------------------------- adversarial inputs
def test_a_non_finite_client_is_rejected_frees_its_slot_and_k_others_make_the_update():
    cfg = build_config(config("fedbuff", rounds=1, concurrency=3, buffer=3))
    first = sampling_schedule(5, 0.6, 1, 0)[0].tolist()
    victim = first[0]
    with faulty_fedavg("nan", {victim}, round_=1):
        sim = build_simulation(cfg)
        record = sim.run_round().record
    assert record["rejected"] == 1 and victim not in record["arrived"]
    assert len(record["arrived"]) == 3 and set(first) - {victim} < set(record["arrived"])
    # the victim's rejection is noticed once its download is done (t_v), its slot goes to a fourth client
    # at once, which lands at t_v + T; the two others land at T (equal speeds and steps: 9 each)
    nbytes = record["round_bytes_up"] // 3
    t_v, t = sim.vclock.duration(victim, 0, nbytes, 0), sim.vclock.duration(first[1], 9, nbytes, nbytes)
    assert record["virtual_time"] == pytest.approx(t_v + t, rel=1e-12)
    assert all(bool(torch.isfinite(t).all()) for t in tensors(sim.server))


def test_a_non_finite_client_fails_the_update_under_on_client_error_fail():
    cfg = build_config(config("fedbuff", rounds=1, concurrency=3, buffer=3), ["engine.on_client_error=fail"])
    with faulty_fedavg("nan", {sampling_schedule(5, 0.6, 1, 0)[0][0]}, round_=1):
        sim = build_simulation(cfg)
        with pytest.raises(ClientError, match="round 1: update of client"):
            sim.run_round()
    assert sim.round == 0 and sim.now == 0.0 and sim.history == []


def trace(tmp_path: Path, online: str) -> str:
    path = tmp_path / "trace.csv"
    rows = "".join(f"{c},0.01,1250000,{online}\n" for c in range(5))
    path.write_text("client,step_seconds,bytes_per_second,online\n" + rows)
    return str(path)


def test_a_federation_nobody_is_ever_online_in_skips_the_update_after_a_virtual_day(tmp_path):
    cfg = config("fedasync", rounds=2, availability="trace", trace=trace(tmp_path, "0" * 24))
    sim = build_simulation(build_config(cfg))
    before = tensors(sim.server)
    records = [sim.run_round().record for _ in range(2)]
    assert [r.get("skipped") for r in records] == [True, True] and sim.skipped == [1, 2]
    assert [r["virtual_time"] for r in records] == [24 * HOUR, 48 * HOUR]
    assert all(torch.equal(a, b) for a, b in zip(before, tensors(sim.server), strict=True))


def test_an_empty_buffer_waits_for_the_hour_clients_come_online(tmp_path):
    cfg = config("fedasync", rounds=1, availability="trace", trace=trace(tmp_path, "001" + "1" * 21))
    sim = build_simulation(build_config(cfg))
    record = sim.run_round().record
    assert "skipped" not in record and len(record["arrived"]) == 1
    assert 2 * HOUR < record["virtual_time"] < 2 * HOUR + 60  # started at 02:00, landed seconds later


def test_fedasync_weighs_a_fresh_update_at_staleness_one_as_its_paper_counts():
    """Xie et al. 2019, Alg. 1: a worker holding the latest model x_{t−1} has t − τ = 1, so with the
    polynomial s(t − τ) = (t − τ + 1)^−a a fresh update mixes at α 2^−a, not α."""
    cfg = build_config(config("fedasync", rounds=1, partition=SKEWED, mixing=0.5, staleness="polynomial"))
    sim = build_simulation(cfg)
    x0 = {k: v.clone() for k, v in sim.server["weights"].items()}
    record = sim.run_round().record
    (c,) = record["arrived"]
    assert record["staleness_max"] == 0  # logged: server updates since the client started
    fresh = build_simulation(cfg)
    payload = fresh.algorithm.broadcast(fresh.server, RoundInfo(1, c, cfg.seed))
    u_c = train_client(
        fresh.executor.runtime, c, 1, payload, fresh.client_state(c)
    ).upload.payload.model_state()
    a = 0.5 * 2.0**-0.5
    for k, x in x0.items():
        assert torch.allclose(sim.server["weights"][k], (1 - a) * x + a * u_c[k], atol=1e-7)


def test_fedbuff_never_extrapolates_batchnorm_statistics():
    """x + s (u − b) is no convex combination: for a running variance it can go negative (a reviewer's
    case: stale updates at K = 2 made min running_var −0.4 and every evaluation NaN). Buffers are the plain
    weighted mean of the uploads."""
    cfg = digits_config(
        rounds=6,
        data={"dataset": "digits", "num_clients": 10, "partition": {"name": "dirichlet", "alpha": 0.1}},
        model={"name": "cnn_fedbn", "conv_channels": [4, 4, 8], "fc_widths": [16, 16]},
        client={"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 0.5},
        engine={"mode": "sequential", "workers": 1},
    )
    cfg["clock"] = {"aggregation": "fedbuff", "concurrency": 10, "buffer": 2,
                    "step_seconds": {"distribution": "lognormal", "value": 0.01, "sigma": 1.5}}  # fmt: skip
    sim = build_simulation(build_config(cfg))
    stale = 0
    for _ in range(6):
        record = sim.run_round().record
        stale = max(stale, record.get("staleness_max", 0))
        assert math.isfinite(record["loss"])
        variances = [v for k, v in sim.server["weights"].items() if k.endswith("running_var")]
        assert variances and all(bool((v >= 0).all()) for v in variances)
    assert stale > 0  # the case really had stale updates
