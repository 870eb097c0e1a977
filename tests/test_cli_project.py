"""The conveniences of a first hour: ``--version``, shell completion, ``fedskew init`` (a starter that runs),
``fedskew runs`` (every run's state), and every file a command writes under its ``--out`` or a stated
default beside its input, never the working directory."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import fedskew
from fedskew.algorithms.base import ALGORITHMS
from fedskew.cli import app
from fedskew.errors import FedskewError
from fedskew.experiment.config import build_config, load_config
from fedskew.experiment.runner import output_lock, run_experiment
from tests.conftest import digits_config


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), prog_name="fedskew")


# ---------------------------------------------------------------------------- version, completion
def test_version_prints_the_package_version_and_exits_0():
    res = invoke("--version")
    assert res.exit_code == 0 and res.output == f"fedskew {fedskew.__version__}\n"


def test_shell_completion_script_and_completions(monkeypatch):
    # Typer detects the calling shell (shellingham) unless told not to; a test harness's parent process
    # may be a shell it does not support (it failed so in CI): name the shell instead, as Typer's tests do
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    res = invoke("--show-completion", "bash")
    assert res.exit_code == 0 and "_fedskew_completion" in res.output and "complete " in res.output
    env = {"_FEDSKEW_COMPLETE": "complete_bash", "COMP_WORDS": "fedskew ru", "COMP_CWORD": "1"}
    done = CliRunner().invoke(app, [], prog_name="fedskew", env=env)
    assert sorted(done.output.split()) == ["run", "runs"]


# ---------------------------------------------------------------------------- init
def test_init_writes_a_commented_starter_that_runs_as_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("init", "project")
    assert res.exit_code == 0, res.output
    config = tmp_path / "project" / "fedskew.yaml"
    text = config.read_text()
    keys = ("plugins:", "rounds:", "dataset:", "num_clients:", "alpha:", "name: my_method", "lr:")
    keys += ("protocol:", "threads:")
    for key in keys:
        line = next(line for line in text.splitlines() if line.strip().startswith(key))
        assert "#" in line, f"{key} has no comment"  # every main key explained where it is set
    with ALGORITHMS.restored():  # the user's method, loaded by plugins:, is forgotten after the test
        cfg = load_config(config)
        # the starter runs the user's own method, from the file beside the config (plugins:)
        assert cfg.data.dataset == "digits" and cfg.algorithm.name == "my_method"
        assert cfg.plugins == [str((tmp_path / "project" / "my_method.py").resolve())]
        ran = invoke("run", str(config), "--out", str(tmp_path / "project" / "runs" / "first"))
    assert ran.exit_code == 0, ran.output
    summary = json.loads((tmp_path / "project" / "runs" / "first" / "summary.json").read_text())
    assert summary["rounds"] == cfg.rounds and summary["final"]["accuracy"] > 0.5  # chance is 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # nothing else in the cwd


def _load_skeleton(path: Path) -> None:
    spec = importlib.util.spec_from_file_location("my_method", path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_the_method_skeleton_registers_lints_and_is_fedavg_at_its_defaults(tmp_path):
    invoke("init", str(tmp_path))
    skeleton = tmp_path / "my_method.py"
    lint = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--isolated",
            "--line-length",
            "110",
            str(skeleton),
        ],
        capture_output=True,
        text=True,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    base = digits_config(rounds=2)
    with ALGORITHMS.restored():  # the registration is undone after the test
        _load_skeleton(skeleton)
        assert "my_method" in ALGORITHMS
        fedavg = run_experiment(build_config(base))["final"]
        same = run_experiment(build_config(base, ["algorithm.name=my_method"]))["final"]
        slow = run_experiment(build_config(base, ["algorithm.name=my_method", "algorithm.server_lr=0.2"]))
        prox = run_experiment(build_config(base, ["algorithm.name=my_method", "algorithm.mu=1.0"]))
    assert "my_method" not in ALGORITHMS
    assert same["loss"] == pytest.approx(fedavg["loss"], rel=1e-5)
    assert slow["final"]["loss"] != pytest.approx(fedavg["loss"], rel=1e-3)  # the knobs change the run
    assert prox["final"]["loss"] != pytest.approx(fedavg["loss"], rel=1e-3)


def test_init_never_overwrites_without_force(tmp_path):
    mine = tmp_path / "fedskew.yaml"
    mine.write_text("rounds: 99  # my own experiment\n")
    res = invoke("init", str(tmp_path))
    assert isinstance(res.exception, FedskewError)
    assert "will not overwrite" in str(res.exception) and str(mine) in str(res.exception)
    assert mine.read_text() == "rounds: 99  # my own experiment\n"
    assert not (tmp_path / "my_method.py").exists()  # all or nothing
    assert invoke("init", str(tmp_path), "--force").exit_code == 0
    assert "dirichlet" in mine.read_text()


def test_init_into_a_file_is_refused(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep")
    res = invoke("init", str(target))
    assert isinstance(res.exception, FedskewError) and "is a file" in str(res.exception)
    assert target.read_text() == "keep"


# ---------------------------------------------------------------------------- runs
def _stop_at(round_: int):
    def on_round(sim, record):
        if sim.round == round_:
            raise KeyboardInterrupt

    return on_round


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """finished, interrupted (a stale .lock left by a killed process), corrupt summary, failed (a sweep's
    error.log), and a run that reports its own failure."""
    root = tmp_path_factory.mktemp("runs")
    cfg = build_config(digits_config(rounds=2))
    run_experiment(cfg, root / "sweep" / "finished")
    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(digits_config(rounds=3)), root / "sweep" / "killed", on_round=_stop_at(1))
    (root / "sweep" / "killed" / ".lock").write_text("999999")  # a dead process's pid, no flock held
    run_experiment(cfg, root / "corrupt")
    (root / "corrupt" / "summary.json").write_text('{"final": {"accur')
    (root / "crashed").mkdir()
    (root / "crashed" / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    (root / "crashed" / "error.log").write_text("Traceback ...")
    run_experiment(cfg, root / "diverged")
    summary = json.loads((root / "diverged" / "summary.json").read_text())
    (root / "diverged" / "summary.json").write_text(json.dumps({**summary, "status": "failed"}))
    return root


def test_runs_reports_every_state_rounds_and_accuracy(runs_root):
    res = invoke("runs", str(runs_root), "--json")
    assert res.exit_code == 0, res.output
    by_name = {Path(e["folder"]).relative_to(runs_root).as_posix(): e for e in json.loads(res.output)}
    assert {k: v["state"] for k, v in by_name.items()} == {
        "corrupt": "interrupted",
        "crashed": "failed",
        "diverged": "failed",
        "sweep/finished": "finished",
        "sweep/killed": "interrupted",
    }
    finished, killed = by_name["sweep/finished"], by_name["sweep/killed"]
    metrics = [
        json.loads(line) for line in (runs_root / "sweep/finished/metrics.jsonl").read_text().splitlines()
    ]
    assert finished["accuracy"] == metrics[-1]["accuracy"] and (
        finished["rounds_done"],
        finished["rounds_total"],
    ) == (2, 2)
    assert (killed["rounds_done"], killed["rounds_total"]) == (1, 3)
    assert (finished["algorithm"], finished["dataset"]) == ("fedavg", "digits")
    assert by_name["corrupt"]["note"] == "summary.json unreadable"
    table = invoke("runs", str(runs_root))
    assert table.exit_code == 0
    for name, state in (
        ("sweep/killed", "interrupted"),
        ("crashed", "failed"),
        ("sweep/finished", "finished"),
    ):
        assert any(name in line and state in line for line in table.output.splitlines())


def test_a_run_holding_its_lock_is_running(runs_root):
    with output_lock(runs_root / "sweep" / "killed"):  # what a live run holds while it writes
        res = invoke("runs", str(runs_root / "sweep"), "--json")
    states = {Path(e["folder"]).name: e["state"] for e in json.loads(res.output)}
    assert states == {"finished": "finished", "killed": "running"}


def test_runs_on_a_missing_folder_is_one_line(tmp_path):
    res = invoke("runs", str(tmp_path / "nope"))
    assert isinstance(res.exception, FedskewError) and "is not a folder" in str(res.exception)
    empty = invoke("runs", str(tmp_path))
    assert empty.exit_code == 0 and "no runs under" in empty.output
    assert json.loads(invoke("runs", str(tmp_path), "--json").output) == []


# ---------------------------------------------------------------------------- where files go
def test_report_writes_its_figures_under_out_or_the_first_run(runs_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    finished = runs_root / "sweep" / "finished"
    nested = tmp_path / "a" / "b" / "c"  # none of it exists yet
    res = invoke("report", str(finished), "--out", str(nested))
    assert res.exit_code == 0, res.output
    assert (nested / "report.png").stat().st_size > 1000 and f"plot: {nested / 'report.png'}" in res.output
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
    default = invoke("report", str(finished))
    assert default.exit_code == 0, default.output
    assert (finished / "report.png").is_file() and [p.name for p in tmp_path.iterdir()] == ["a"]
    (finished / "report.png").unlink()  # the fixture's folder stays as the other tests expect


def test_data_show_writes_beside_the_run_folder_or_under_out(tmp_path, monkeypatch):
    work, configs = tmp_path / "work", tmp_path / "configs"
    work.mkdir(), configs.mkdir()
    monkeypatch.chdir(work)
    path = configs / "skew.yaml"
    path.write_text(yaml.safe_dump(digits_config()))
    assert invoke("data", "show", str(path), "--out", str(tmp_path / "figs")).exit_code == 0
    assert (tmp_path / "figs" / "skew-partition.png").is_file()  # a folder: the default name inside
    assert invoke("data", "show", str(path), "--out", str(tmp_path / "p.png")).exit_code == 0
    assert (tmp_path / "p.png").is_file() and list(work.iterdir()) == [] and list(configs.iterdir()) == [path]
    res = invoke("data", "show", str(path))
    assert res.exit_code == 0 and "heatmap: runs/skew-partition.png" in res.output
    assert (work / "runs" / "skew-partition.png").stat().st_size > 1000  # where `fedskew run` puts runs/skew
    assert list(work.iterdir()) == [work / "runs"]
