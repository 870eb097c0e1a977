"""Live trackers (TensorBoard, MLflow, W&B offline): a digits sweep logs every run to all three, read back
with each library's own reader; a tracker that fails leaves the run's results exactly as without it; the
fairness summaries of the per-client accuracies on hand-checkable cases."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.fairness import client_fairness, gini, worst_share_mean
from fedskew.experiment.runner import run_experiment
from fedskew.experiment.sweep import plan_sweep
from fedskew.experiment.sweep_pool import run_sweep
from fedskew.experiment.tracking import TRACKERS

METHODS, SEEDS, ROUNDS = ("fedavg", "local"), (0, 1, 2), 3


def digits_config(**extra: Any) -> dict[str, Any]:
    return {
        "rounds": ROUNDS,
        "data": {"dataset": "digits", "num_clients": 8, "partition": {"name": "dirichlet", "alpha": 0.3}},
        "model": {"name": "mlp_mpfedcl"},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        "eval": {"protocol": "personalized"},
        "checkpoint": {"every": 0},
        **extra,
    }


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's own settings and caches in the test's folder, never the user's home."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


def metrics_of(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def wandb_records(run_file: Path) -> list[dict[str, Any]]:
    """The records of an offline run, through W&B's own reader (``wandb leet inspect --json``)."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_a_digits_sweep_logs_every_run_to_all_three_trackers(tmp_path: Path, wandb_home: None) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, db, wb = tmp_path / "tb", tmp_path / "mlflow.db", tmp_path / "wb"
    log = {"tensorboard": str(tb), "mlflow": f"sqlite:///{db}", "wandb": {"project": "t", "dir": str(wb)}}
    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(digits_config(log=log)))
    runs = plan_sweep([config], tmp_path / "sweep", list(SEEDS), [f"algorithm.name={','.join(METHODS)}"])
    outcome = run_sweep(runs)
    assert len(outcome.finished) == len(METHODS) * len(SEEDS) and not outcome.failed

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("fedskew")
    assert experiment is not None
    mlflow_runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    wandb_files = sorted(wb.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(mlflow_runs) == len(wandb_files) == len(runs)
    wandb_by_name = {}
    for f in wandb_files:
        records = wandb_records(f)
        run_record = next(r["run"] for r in records if r["type"] == "run")
        wandb_by_name[run_record["display_name"]] = (run_record, records)

    for run in runs:
        expected = metrics_of(run.folder)
        group = f"digits/algorithm.name={run.config['algorithm']['name']}"
        name = f"{group}/seed{run.seed}"
        rounds = [m["round"] for m in expected]
        accuracy = [m["accuracy"] for m in expected]
        assert rounds == list(range(1, ROUNDS + 1))

        events = EventAccumulator(str(tb / group / f"seed{run.seed}"))
        events.Reload()
        scalars = events.Scalars("accuracy")
        assert [s.step for s in scalars] == rounds
        np.testing.assert_allclose([s.value for s in scalars], accuracy, rtol=1e-6)  # stored as float32
        assert [s.step for s in events.Scalars("accuracy_worst10")] == rounds
        assert "accuracy_clients" in events.Tags()["histograms"]

        ml = mlflow_runs[name]
        assert ml.info.status == "FINISHED"
        assert ml.data.tags["fedskew.group"] == group
        assert ml.data.params["algorithm.name"] == run.config["algorithm"]["name"]
        assert ml.data.params["seed"] == str(run.seed)
        history = client.get_metric_history(ml.info.run_id, "accuracy")
        assert [(h.step, h.value) for h in history] == list(zip(rounds, accuracy, strict=True))
        summary = json.loads((run.folder / "summary.json").read_text())
        assert ml.data.metrics["final.accuracy"] == summary["final"]["accuracy"]

        run_record, records = wandb_by_name[name]
        assert run_record["run_group"] == group
        assert run_record["config"]["update"]["algorithm"]["name"] == run.config["algorithm"]["name"]
        rows = [r["history"] for r in records if r["type"] == "history"]
        assert [r["step"]["num"] for r in rows] == rounds
        assert [r["item"]["accuracy"] for r in rows] == accuracy
        assert next(r for r in records if r["type"] == "exit")["exit"].get("exit_code", 0) == 0


class Failing:
    """A tracker that raises in the phase it is told to."""

    requires = "json"  # any importable module
    phase = "open"

    def __init__(self, run: Any, section: Any) -> None:
        self._fail("open")

    def _fail(self, phase: str) -> None:
        if phase == self.phase:
            raise OSError(28, "No space left on device")

    def log_round(self, round_: int, scalars: dict[str, float], clients: list[float]) -> None:
        self._fail("round")

    def close(self, summary: dict[str, Any] | None) -> None:
        self._fail("close")


def comparable(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A run's metrics and summary without its timings (wall clock) and provenance (which process, with
    which config, wrote it: the trackers are in its config changes)."""
    summary = json.loads((folder / "summary.json").read_text())
    for timing in ("wall_seconds", "seconds", "provenance"):
        summary.pop(timing)
    metrics = [{k: v for k, v in m.items() if not k.startswith("seconds")} for m in metrics_of(folder)]
    return metrics, summary


@pytest.mark.parametrize("phase", ["open", "round", "close"])
def test_a_tracker_that_raises_leaves_the_results_identical(
    tmp_path: Path, phase: str, caplog: pytest.LogCaptureFixture
) -> None:
    plain = tmp_path / "plain"
    run_experiment(build_config(digits_config(algorithm={"name": "fedavg"})), plain)
    failing = type("FailingAt", (Failing,), {"phase": phase})
    tracked = tmp_path / "tracked"
    cfg = build_config(digits_config(algorithm={"name": "fedavg"}, log={"tensorboard": str(tmp_path / "tb")}))
    with TRACKERS.replaced("tensorboard", failing), caplog.at_level(logging.WARNING, "fedskew.tracking"):
        run_experiment(cfg, tracked)
    assert comparable(tracked) == comparable(plain)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fedskew.tracking"]
    assert len(warnings) == 1 and "tracker 'tensorboard' failed (OSError" in warnings[0]


def test_a_tracker_without_its_library_is_refused_before_the_run(tmp_path: Path) -> None:
    missing = type("Missing", (Failing,), {"requires": "fedskew_no_such_module", "phase": "never"})
    cfg = build_config(digits_config(log={"mlflow": "sqlite:///x.db"}))
    with TRACKERS.replaced("mlflow", missing), pytest.raises(ConfigError) as err:
        run_experiment(cfg, tmp_path / "out")
    assert "log.mlflow: the 'fedskew_no_such_module' package is not installed" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_run_resumes_with_other_trackers(tmp_path: Path) -> None:
    """Trackers watch a run; they are not part of what it computes, so adding one does not block --resume."""
    out = tmp_path / "run"
    run_experiment(build_config(digits_config()), out)
    before = comparable(out)
    watched = build_config(digits_config(name="renamed", log={"tensorboard": str(tmp_path / "tb")}))
    run_experiment(watched, out, resume=True)
    assert comparable(out) == before


def test_the_tracking_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="log.wandb.mode"):
        build_config(digits_config(log={"wandb": {"mode": "sometimes"}}))
    assert build_config(digits_config(log={"mlflow": "sqlite:///a.db"})).log.mlflow.uri == "sqlite:///a.db"


# ---------------------------------------------------------------------------- fairness summaries
def test_gini_on_hand_checkable_cases() -> None:
    assert gini([0.5, 0.5, 0.5]) == 0.0
    assert gini([0.0, 1.0]) == pytest.approx(0.5)  # |0-1| twice / (2 · 4 · 0.5)
    assert gini([0.0, 0.0, 1.0]) == pytest.approx(2 / 3)  # 4 / (2 · 9 · 1/3)
    assert gini([0.0, 0.0]) == 0.0
    rng = np.random.default_rng(0)
    a = rng.random(37)
    pairwise = np.abs(a[:, None] - a[None, :]).sum() / (2 * a.size**2 * a.mean())
    assert gini(a.tolist()) == pytest.approx(pairwise, rel=1e-12)


def test_worst_ten_percent_is_the_mean_of_the_lowest_clients() -> None:
    accs = [i / 20 for i in range(20)]  # 0.00 .. 0.95
    assert worst_share_mean(accs) == pytest.approx(0.025)  # the lowest 2 of 20
    assert worst_share_mean([0.9, 0.3, 0.6]) == pytest.approx(0.3)  # at least one client
    assert worst_share_mean(list(range(11))) == pytest.approx(0.5)  # ceil(1.1) = 2 clients: 0 and 1
    assert client_fairness([]) == {}


def test_the_summary_holds_the_final_rounds_fairness(tmp_path: Path) -> None:
    summary = run_experiment(build_config(digits_config()), tmp_path / "run")
    clients = [a for a in summary["final"]["accuracy_clients"] if a is not None]
    assert summary["final"]["accuracy_worst10"] == pytest.approx(worst_share_mean(clients))
    assert summary["final"]["accuracy_gini"] == pytest.approx(gini(clients))
