"""The engine: paired sampling, byte accounting, non-finite updates, evaluation, resume after a kill."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from fedskew.algorithms.base import ALGORITHMS, Algorithm, load_state
from fedskew.engine.sampling import derive_seed, sampling_schedule
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data, build_simulation, run_experiment
from fedskew.models.base import count_parameters
from tests.barrier_run import DEADLINE, ROOT, barrier_env, wait_for_barrier
from tests.conftest import digits_config


def test_sampling_schedule_is_paired_and_uniform():
    a = sampling_schedule(100, 0.2, 50, seed=3)
    b = sampling_schedule(100, 0.2, 50, seed=3)
    assert a.shape == (50, 20)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, sampling_schedule(100, 0.2, 50, seed=4))
    assert all(len(set(row)) == 20 for row in a.tolist())
    counts = np.bincount(a.ravel(), minlength=100)
    assert counts.min() > 0  # every client gets picked over 50 rounds at 20%
    full = sampling_schedule(7, 1.0, 3, seed=0)
    assert full.tolist() == [list(range(7))] * 3
    assert derive_seed(1, 2, 3) != derive_seed(1, 3, 2)


def test_fedavg_bytes_and_record_fields():
    cfg = build_config(digits_config(rounds=2))
    summary = run_experiment(cfg)
    model_bytes = 4 * count_parameters(build_simulation(cfg).executor.runtime.models.model_for(None))
    # every client downloads and uploads the full model once per round (no buffers in the MLP)
    assert summary["bytes_down"] == 2 * 5 * model_bytes
    assert summary["bytes_up"] == summary["bytes_down"]
    assert summary["final"]["accuracy"] > 0.2  # learnt something over chance (0.1) in 2 rounds


def test_same_seed_same_metrics_and_partition_shared_by_algorithms():
    cfg = build_config(digits_config(rounds=2, checkpoint={"every": 0}))
    other = build_config(digits_config(rounds=2, algorithm={"name": "fedprox", "mu": 0.1}))
    d1, d2 = build_data(cfg), build_data(other)
    assert all(torch.equal(a, b) for a, b in zip(d1.train_idx, d2.train_idx, strict=True))
    s1, s2 = build_simulation(cfg, d1), build_simulation(other, d2)
    w1, w2 = s1.server["weights"], s2.server["weights"]
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # identical initial model
    r1 = [s1.run_round().record for _ in range(2)]
    s3 = build_simulation(cfg)
    r3 = [s3.run_round().record for _ in range(2)]
    for a, b in zip(r1, r3, strict=True):
        assert a["accuracy"] == b["accuracy"] and a["loss"] == b["loss"]


class _NaNOnClientZero(Algorithm):
    """Test-only algorithm: client 0 produces a non-finite loss."""

    def init_scratch(self, step):
        return {"poison": torch.tensor(float("nan") if step.client.cid == 0 else 1.0)}

    def local_loss(self, step, batch):
        return F.cross_entropy(step.model(batch.x), batch.y) * step.scratch["poison"]


def test_non_finite_update_is_rejected_and_round_continues():
    with ALGORITHMS.restored():  # the test method leaves no name behind (`fedskew list` tests read them)
        ALGORITHMS.register("_nan_client0")(_NaNOnClientZero)
        cfg = build_config(digits_config(rounds=2, algorithm={"name": "_nan_client0"}))
        sim = build_simulation(cfg)
        before = {k: v.clone() for k, v in sim.server["weights"].items()}
        rec = sim.run_round().record
    assert rec["rejected"] == 1
    assert all(torch.isfinite(v).all() for v in sim.server["weights"].values())
    assert any(not torch.equal(before[k], sim.server["weights"][k]) for k in before)  # others aggregated
    assert np.isfinite(rec["accuracy"])


def test_personalized_evaluation_matches_direct_computation():
    cfg = build_config(digits_config(rounds=1, eval={"protocol": "personalized", "every": 1}))
    data = build_data(cfg)
    sim = build_simulation(cfg, data)
    rec = sim.run_round().record
    model = build_simulation(cfg, data).executor.runtime.models.model_for(None)  # a second instance
    load_state(model, sim.server["weights"])
    model.eval()
    accs = []
    ds = data.dataset
    with torch.no_grad():
        for idx in data.test_idx:
            accs.append(
                float((model(ds.to_float(ds.x_test[idx])).argmax(1) == ds.y_test[idx]).double().mean())
            )
    assert rec["accuracy"] == pytest.approx(float(np.mean(accs)), abs=1e-9)
    assert rec["accuracy_std"] == pytest.approx(float(np.std(accs)), abs=1e-9)
    assert rec["accuracy_clients"] == pytest.approx(accs, abs=1e-6)


def test_clients_without_data_train_nothing_and_are_left_out_of_personalized_accuracy():
    """``min_size: 0`` (cross-device scale): empty clients are sampled, upload with weight 0, and have no
    personalized accuracy (``None``), so the mean is over the clients that have test samples."""
    part = {"name": "dirichlet", "alpha": 0.1, "min_size": 0}
    cfg = build_config(
        digits_config(
            rounds=2,
            data={"dataset": "digits", "num_clients": 300, "partition": part},
            client={"epochs": 1, "batch_size": 16, "lr": 0.05, "fraction": 0.5},
            eval={"protocol": "personalized", "every": 1},
        )
    )
    data = build_data(cfg)
    empty = {cid for cid, idx in enumerate(data.train_idx) if len(idx) == 0}
    assert len(empty) > 10
    sim = build_simulation(cfg, data)
    sampled = set(sim.schedule[0].tolist())
    assert sampled & empty and sampled - empty
    rec = sim.run_round().record
    accs = rec["accuracy_clients"]
    no_test = {cid for cid, idx in enumerate(data.test_idx) if len(idx) == 0}
    assert no_test and {cid for cid, a in enumerate(accs) if a is None} == no_test
    have = [a for a in accs if a is not None]
    assert rec["accuracy"] == pytest.approx(float(np.mean(have)), abs=1e-6)
    assert np.isfinite(rec["loss"]) and np.isfinite(rec["train_loss"])
    assert all(torch.isfinite(v).all() for v in sim.server["weights"].values())


def test_final_round_is_reported_not_best(tmp_path):
    cfg = build_config(digits_config(rounds=3, data={**digits_config()["data"], "val_fraction": 0.2}))
    summary = run_experiment(cfg, tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2, 3]
    assert summary["final"]["accuracy"] == lines[-1]["accuracy"]
    best = max(lines, key=lambda r: r["val_accuracy"])
    assert summary["best_val"] == {
        "round": best["round"],
        "val_accuracy": best["val_accuracy"],
        "accuracy": best["accuracy"],
    }


def test_output_folder_is_protected(tmp_path):
    from fedskew.errors import FedskewError

    cfg = build_config(digits_config(rounds=1))
    run_experiment(cfg, tmp_path / "r")
    with pytest.raises(FedskewError, match="--resume or --force"):
        run_experiment(cfg, tmp_path / "r")
    run_experiment(cfg, tmp_path / "r", force=True)
    other = build_config(digits_config(rounds=1, seed=1))  # rounds alone may change (test_resume_extend)
    with pytest.raises(FedskewError, match="config differs .*seed: 0 -> 1"):
        run_experiment(other, tmp_path / "r", resume=True)


def test_a_run_saved_before_new_config_keys_existed_still_resumes(tmp_path):
    """A newer version adds keys with defaults; the saved config of an older run lacks them and must still
    count as the same config (its metrics continue), while a changed value is still refused."""
    import yaml

    from fedskew.errors import FedskewError

    cfg = build_config(digits_config(rounds=2))
    run_experiment(cfg, tmp_path / "r")
    saved = tmp_path / "r" / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    del old["engine"]["on_client_error"], old["data"]["shots"]  # keys an older version did not write
    saved.write_text(yaml.safe_dump(old))
    assert run_experiment(cfg, tmp_path / "r", resume=True)["rounds"] == 2
    old["client"]["lr"] = cfg.client.lr * 2
    saved.write_text(yaml.safe_dump(old))
    with pytest.raises(FedskewError, match="config differs"):
        run_experiment(cfg, tmp_path / "r", resume=True)


def _strip_timing(records):
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in records]


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C at its default. A child inherits an ignored SIGINT (Python then
    keeps ignoring it), and a test process of a parallel session may have it ignored for a moment."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_run(
    cfg: dict, tmp_path: Path, out: Path, stop_at: int
) -> tuple[subprocess.Popen, list[str], dict[str, str]]:
    """Start ``fedskew run`` on ``cfg`` in its own process group with a barrier (tests/barrier_run.py) at the
    start of round ``stop_at``; return once the run waits there, rounds 1 .. stop_at - 1 committed. Returns
    the process, and the plain command and environment (no barrier) to resume with."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["run", str(path), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    events = tmp_path / "barrier"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.barrier_run", *args],
        cwd=ROOT,
        env=barrier_env(stop_at, events, env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    try:
        wait_for_barrier(events, proc)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # a run stuck at its barrier would stay forever
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc, [sys.executable, "-m", "fedskew.cli", *args], env


@pytest.mark.slow
def test_resume_after_kill_gives_the_same_metrics(tmp_path):
    """Kill a real `fedskew run` process mid-way, resume it, compare with an uninterrupted run."""
    cfg = digits_config(rounds=6, checkpoint={"every": 1}, client={"epochs": 3, "batch_size": 8, "lr": 0.05})
    out = tmp_path / "killed"
    proc, cmd, env = _start_run(cfg, tmp_path, out, stop_at=4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ran = len((out / "metrics.jsonl").read_text().splitlines())
    assert ran == 3, "killed in round 4, after round 3's metrics and checkpoint"
    res = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert res.returncode == 0, res.stderr
    resumed = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    straight = build_config(cfg)
    run_experiment(straight, tmp_path / "straight")
    expected = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in resumed] == list(range(1, 7))
    assert _strip_timing(resumed) == _strip_timing(expected)
    s1 = json.loads((out / "summary.json").read_text())
    s2 = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert s1["final"] == s2["final"] and s1["bytes_up"] == s2["bytes_up"]


@pytest.mark.slow
def test_ctrl_c_with_workers_exits_130_stops_them_and_resumes_to_the_same_metrics(tmp_path):
    """Ctrl-C (SIGINT to the process group) while the workers train round 3: exit 130 with a one-line
    message, no worker left behind, and ``--resume`` finishes with the uninterrupted run's metrics."""
    cfg = digits_config(
        rounds=4,
        checkpoint={"every": 1},
        client={"epochs": 3, "batch_size": 8, "lr": 0.05},
        engine={"workers": 2, "mode": "sequential"},
    )
    out = tmp_path / "interrupted"
    proc, cmd, env = _start_run(cfg, tmp_path, out, stop_at=3)  # the barrier holds a worker, not the parent
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=DEADLINE)
    ran = len((out / "metrics.jsonl").read_text().splitlines())
    assert proc.returncode == 130 and err.strip().splitlines() == [
        "interrupted: progress kept in the checkpoint; continue with --resume"
    ], (proc.returncode, ran, err)
    assert ran == 2 and torch.load(out / "checkpoint.pt", weights_only=True)["round"] == 2
    # the parent stops and reaps its workers before it exits, so nothing of the group is left by now
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    res = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert res.returncode == 0, res.stderr
    resumed = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    run_experiment(build_config(cfg), tmp_path / "straight")
    expected = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in resumed] == list(range(1, 5))
    assert _strip_timing(resumed) == _strip_timing(expected)


@pytest.mark.slow
def test_cli_bad_input_exits_2(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(digits_config()))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedskew.cli",
            "run",
            str(path),
            "--set",
            "client.lrr=1",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "client.lrr" in res.stderr and "did you mean 'lr'" in res.stderr


def test_engine_device_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from fedskew.errors import ConfigError

    with pytest.raises(ConfigError, match="no CUDA device"):
        build_simulation(build_config(digits_config(engine={"device": "cuda"})))


def test_checkpoint_is_atomic_and_loadable(tmp_path):
    cfg = build_config(digits_config(rounds=2))
    run_experiment(cfg, tmp_path / "r")
    files = sorted(p.name for p in (tmp_path / "r").iterdir())
    kept = ["checkpoint.prev.pt", "checkpoint.pt"]  # the last two checkpoints
    assert files == [".lock", *kept, "config.yaml", "metrics.jsonl", "summary.json"]
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)  # no pickled code
    assert ck["round"] == 2 and len(ck["history"]) == 2
    assert Path(tmp_path / "r" / "config.yaml").read_text().startswith("name:")


def test_payload_finiteness_check_is_exact():
    from fedskew.algorithms.base import Payload

    assert Payload({"w": torch.randn(100)}, {"lr": 0.1}).is_finite()
    bad = torch.randn(100)
    bad[37] = float("nan")
    assert not Payload({"w": bad}).is_finite()
    bad[37] = float("-inf")
    assert not Payload({"w": bad}).is_finite()
    # a finite float16 tensor whose sum overflows float16 is still finite
    assert Payload({"h": torch.full((4,), 60000.0, dtype=torch.float16)}).is_finite()
    assert Payload({"ids": torch.tensor([1, 2])}).is_finite()
    assert not Payload({"w": torch.ones(2)}, {"gamma": float("nan")}).is_finite()
