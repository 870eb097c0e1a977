"""The command line: list, report (mean ± std over seeds), data show, demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from fedskew.experiment.config import build_config
from fedskew.experiment.report import find_runs, group_runs, mean_curve, plot_accuracy
from fedskew.experiment.report_tables import markdown_table
from fedskew.experiment.runner import run_experiment
from tests.conftest import digits_config


def fedskew(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedskew.cli", *args], capture_output=True, text=True, cwd=cwd
    )


def test_list_prints_every_registry():
    res = fedskew("list")
    assert res.returncode == 0, res.stderr
    for name in (
        "fedavg",
        "scaffold",
        "mlp_mpfedcl",
        "cnn_mnist",
        "digits",
        "mnist",
        "dirichlet",
        "nway_kshot",
    ):
        assert name in res.stdout


@pytest.mark.slow
def test_report_groups_seeds_with_mean_and_std(tmp_path):
    accs = []
    for seed in (0, 1):
        cfg = build_config(digits_config(rounds=1, seed=seed))
        accs.append(run_experiment(cfg, tmp_path / f"s{seed}")["final"]["accuracy"])
    groups = group_runs(find_runs([tmp_path]))
    assert len(groups) == 1 and len(groups[0].runs) == 2
    mean, std = groups[0].stat("accuracy")
    assert mean == pytest.approx(sum(accs) / 2)
    table = markdown_table(groups)
    assert f"{100 * mean:.2f} ± {100 * std:.2f}" in table
    res = fedskew("report", str(tmp_path), "--plot", str(tmp_path / "acc.png"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "acc.png").stat().st_size > 1000
    rounds, loss, _ = mean_curve(groups[0], "loss")  # any per-round key, e.g. for Fig. 3's loss panel
    assert rounds == [1] and loss[0] == pytest.approx(sum(r.metrics[-1]["loss"] for r in groups[0].runs) / 2)
    out = plot_accuracy(groups, tmp_path / "loss.png", key="loss", ylabel="test loss", scale=1.0)
    assert out.stat().st_size > 1000


@pytest.mark.slow
def test_report_on_empty_folder_is_a_clear_error(tmp_path):
    res = fedskew("report", str(tmp_path))
    assert res.returncode == 2 and "no finished runs" in res.stderr


@pytest.mark.slow
def test_data_show_prints_table_and_writes_heatmap(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(digits_config()))
    res = fedskew("data", "show", str(path), "--out", str(tmp_path / "p.png"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
def test_demo_runs_three_methods(tmp_path):
    res = fedskew("demo", "--out", str(tmp_path / "demo"), "--rounds", "2")
    assert res.returncode == 0, res.stderr
    for name in ("fedavg", "fedprox", "local"):
        summary = json.loads((tmp_path / "demo" / name / "summary.json").read_text())
        assert summary["rounds"] == 2 and summary["final"]["accuracy"] > 0.3  # chance is 0.1
    assert (tmp_path / "demo" / "accuracy.png").exists()
    assert "final accuracy" in res.stdout
