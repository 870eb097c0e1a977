"""A run that failed says so (issue 54, item 2): rounds without an accepted upload and non-finite rounds are
counted in summary.json, a run past ``engine.max_skipped_share`` (or ending non-finite) is ``failed`` with
its files written, ``fedskew run`` exits 1 with one line, a sweep counts it failed, reports flag it."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from benchmarks.faults import faulty_fedavg

from fedskew.errors import ConfigError, RunFailure
from fedskew.experiment.config import build_config
from fedskew.experiment.failure import assess, check_finished, final_line
from fedskew.experiment.reporting import ReportRequest, make_report
from fedskew.experiment.runner import run_experiment
from fedskew.experiment.sweep import plan_sweep
from fedskew.experiment.sweep_pool import run_sweep
from tests.conftest import digits_config

TINY = {"rounds": 2, "model": {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16}}


def tiny(**over) -> dict:
    cfg = digits_config(**{**TINY, **over})
    cfg["data"]["num_clients"] = 3
    return cfg


# ---------------------------------------------------------------------------- the rule
def test_exactly_the_share_passes_and_one_round_more_fails() -> None:
    history = [{"round": r, "loss": 1.0, "accuracy": 0.5} for r in (1, 2, 3, 4)]
    at = assess(4, [2, 3], history, max_skipped_share=0.5)  # 2 of 4 = the share: not more than it
    assert at["status"] == "finished" and at["rounds_without_update"] == 2 and "failure" not in at
    past = assess(4, [1, 2, 3], history, max_skipped_share=0.5)
    assert past["status"] == "failed"
    assert (
        past["failure"] == "3 of 4 rounds accepted no upload (more than engine.max_skipped_share=0.5 of them)"
    )
    assert assess(4, [1, 2, 3, 4], history, 1.0)["status"] == "finished"  # 1: never on skipped rounds
    assert assess(4, [1], history, 0.0)["status"] == "failed"  # 0: any round without an update fails


def test_a_non_finite_final_round_fails_whatever_the_share() -> None:
    history = [{"round": 1, "loss": 2.0, "accuracy": 0.3}, {"round": 2, "loss": math.nan, "accuracy": 0.1}]
    health = assess(2, [], history, max_skipped_share=1.0)
    assert health["status"] == "failed" and health["nonfinite_rounds"] == [2]
    assert "final loss is non-finite (nan)" in health["failure"]
    # a non-finite round that the run recovered from is counted, not failed
    recovered = assess(2, [], list(reversed(history)), 1.0)
    assert recovered["status"] == "finished" and recovered["nonfinite_rounds"] == [2]


@pytest.mark.parametrize("value", ["-0.1", "1.5", "half"])
def test_a_bad_share_is_one_line_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(tiny(), [f"engine.max_skipped_share={value}"])
    assert "engine.max_skipped_share" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------- real runs
def test_one_skipped_round_of_four_is_exactly_the_share_and_passes(tmp_path: Path) -> None:
    """Round 2's uploads are all NaN (dropped): 1 of 4 rounds without an update."""
    raw = tiny(rounds=4)
    with faulty_fedavg("nan", set(range(3)), round_=2):
        at = run_experiment(build_config(raw, ["engine.max_skipped_share=0.25"]), tmp_path / "at")
        past = run_experiment(build_config(raw, ["engine.max_skipped_share=0.2"]), tmp_path / "past")
    assert at["status"] == "finished" and at["rounds_without_update"] == 1 and at["skipped_rounds"] == [2]
    assert past["status"] == "failed" and past["failure"].startswith("1 of 4 rounds accepted no upload")
    # the same numbers either way: the status judges the run, it changes nothing in it
    assert at["final"] == past["final"]
    saved = json.loads((tmp_path / "past" / "summary.json").read_text())
    assert saved["status"] == "failed" and saved["nonfinite_rounds"] == []
    with pytest.raises(RunFailure, match=r"^run failed: 1 of 4 rounds .*; see .*past/summary.json$"):
        check_finished(saved, tmp_path / "past")
    check_finished(at, tmp_path / "at")  # a finished run passes


@pytest.mark.slow
def test_lr_1e3_exits_1_with_one_line_and_keeps_every_file(tmp_path: Path) -> None:
    """The issue's repro through the installed CLI: every upload is non-finite in every round."""
    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(tiny(model={"name": "mlp_mpfedcl"})))  # its uploads: all NaN
    out = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedskew.cli",
            "run",
            str(config),
            "--out",
            str(out),
            "--set",
            "client.lr=1e3",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.splitlines() if not line.startswith("WARNING ")]  # the engine's log
    assert lines == [
        "error: run failed: 2 of 2 rounds accepted no upload (more than engine.max_skipped_share=0.5 of "
        f"them); see {out / 'summary.json'}"
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["rounds_without_update"], summary["skipped_rounds"]) == (
        "failed",
        2,
        [1, 2],
    )
    assert all((out / name).is_file() for name in ("config.yaml", "metrics.jsonl", "checkpoint.pt"))
    assert "final accuracy" in res.stdout  # the numbers are still shown
    assert summary["provenance"]["command"].startswith("fedskew run ")


def test_a_failed_run_fails_its_sweep_and_stays_failed_on_rerun(tmp_path: Path) -> None:
    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(tiny()))
    runs = plan_sweep([config], tmp_path / "out", [0], ["client.lr=0.05,1000"])
    outcome = run_sweep(runs)
    assert [r.folder.name for r in outcome.finished] == ["seed0"] and len(outcome.failed) == 1
    run, message = outcome.failed[0]
    assert "client.lr=1000" in str(run.folder) and "run failed: " in message
    assert json.loads((run.folder / "summary.json").read_text())["status"] == "failed"
    assert (run.folder / "summary.json").is_file() and (run.folder / "error.log").is_file()
    again = run_sweep(plan_sweep([config], tmp_path / "out", [0], ["client.lr=0.05,1000"]))
    assert len(again.skipped) == 2 and [r.folder for r, _ in again.failed] == [run.folder]


def test_the_closing_line_of_a_non_finite_run_does_not_crash() -> None:
    summary = {
        "final": {"accuracy": None, "loss": None},
        "rounds": 3,
        "wall_seconds": 1.0,
        "protocol": "global",
    }
    assert (
        final_line(summary, "runs/x") == "final accuracy n/a (non-finite) after 3 rounds in 1.0 s -> runs/x"
    )


# ---------------------------------------------------------------------------- reports flag them
def write_run(root: Path, name: str, seed: int, accuracy: float | None, **summary_keys) -> None:
    folder = root / name / f"seed{seed}"
    folder.mkdir(parents=True)
    cfg = {
        "seed": seed,
        "algorithm": {"name": name},
        "data": {"dataset": "digits"},
        "eval": {"protocol": "global"},
    }
    final = {"accuracy": accuracy, "loss": None if accuracy is None else 1.0}
    summary = {
        "final": final,
        "rounds": 2,
        "wall_seconds": 1.0,
        "bytes_up": 10,
        "protocol": "global",
        **summary_keys,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 2, "accuracy": accuracy}) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary))


def test_reports_mark_failed_and_non_finite_runs_in_every_format(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    write_run(root, "good", 0, 0.8, status="finished")
    write_run(root, "good", 1, 0.7, status="finished")
    write_run(root, "bad", 0, 0.1, status="failed", failure="2 of 2 rounds accepted no upload")
    write_run(root, "bad", 1, 0.6, status="finished")
    write_run(root, "nan", 0, None, nonfinite_rounds=[2])  # an older summary: no status, non-finite

    def report(fmt: str, **kw) -> str:
        return make_report(ReportRequest([root], fmt, plot=tmp_path / "p.png", **kw)).text

    md = report("markdown", html=tmp_path / "r.html")
    assert "| bad | digits iid() | mlp_mpfedcl | 2 (1 failed) |" in md
    assert "| nan | digits iid() | mlp_mpfedcl | 1 (1 non-finite) |" in md
    assert "| good | digits iid() | mlp_mpfedcl | 2 |" in md
    assert f"FAILED (included above): {root / 'bad' / 'seed0'}: 2 of 2 rounds accepted no upload" in md
    assert f"NON-FINITE (included above): {root / 'nan' / 'seed0'}" in md
    latex = report("latex")
    assert "2 (1 failed)" in latex and "Runs marked failed or non-finite" in latex
    assert "% FAILED (included above)" in latex
    rows = {r["algorithm"]: r for r in csv.DictReader(io.StringIO(report("csv")))}
    assert (rows["bad"]["failed_runs"], rows["nan"]["nonfinite_runs"], rows["good"]["failed_runs"]) == (
        "1",
        "1",
        "0",
    )
    page = (tmp_path / "r.html").read_text()
    assert "2 (1 failed)" in page and "FAILED (included above)" in page
    sidecar = json.loads((tmp_path / "p_provenance.json").read_text())
    assert {r["path"]: r["flags"] for r in sidecar["runs"]}[str(root / "bad" / "seed0")] == ["failed"]
