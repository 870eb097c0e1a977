"""Where a result came from (issue 54, item 3): summary.json's ``provenance`` (command, version, git commit
and dirty flag, package versions, machine, the config's difference from the defaults, resumes), and every
report's provenance line, saying so when the compared runs differ."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

import fedskew
from fedskew.experiment.config import build_config
from fedskew.experiment.provenance import (
    COMMAND_ENV,
    collect,
    compare,
    config_changes,
    describe,
    record_command,
)
from fedskew.experiment.reporting import ReportRequest, make_report
from fedskew.experiment.runner import run_experiment
from tests.conftest import digits_config

PACKAGE = Path(fedskew.__file__).resolve().parent
TINY = {"rounds": 2, "model": {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16}}


def test_the_summary_records_versions_machine_and_the_changed_keys(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(COMMAND_ENV, raising=False)
    summary = run_experiment(build_config(digits_config(**TINY)), tmp_path / "run")
    prov = json.loads((tmp_path / "run" / "summary.json").read_text())["provenance"]
    assert prov == summary["provenance"]
    assert prov["command"] is None and prov["entry"]  # the library, called from a Python program
    assert prov["fedskew"]["version"] == fedskew.__version__
    assert prov["versions"]["torch"] == torch.__version__ and prov["versions"]["numpy"] == np.__version__
    assert prov["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert prov["machine"]["device"] == "cpu" and prov["machine"]["cores"] == os.cpu_count()
    assert isinstance(prov["machine"]["threads"], int) and prov["machine"]["threads"] >= 1
    # digits_config's keys that differ from the defaults, and nothing resolved at run time (engine.device)
    assert prov["config_changes"] == {
        "checkpoint.every": 1,
        "client.lr": 0.05,
        "client.momentum": 0.5,
        "data.num_clients": 5,
        "data.partition.alpha": 0.5,
        "data.partition.name": "dirichlet",
        "model.embed_dim": 16,
        "model.hidden": 32,
        "rounds": 2,
    }
    assert prov["started_round"] == 0 and "resumed_from" not in prov


def test_the_cli_command_line_is_recorded_quoted(monkeypatch) -> None:
    monkeypatch.delenv(COMMAND_ENV, raising=False)
    record_command(["/somewhere/bin/fedskew", "run", "my config.yaml", "--set", "client.lr=0.1"])
    prov = collect(build_config({}))
    assert prov["command"] == "fedskew run 'my config.yaml' --set client.lr=0.1" and prov["entry"] is None
    assert os.environ[COMMAND_ENV] == prov["command"]  # inherited by sweep workers and Flower apps


def test_discriminated_and_dict_sections_diff_by_their_keys() -> None:
    cfg = build_config({"data": {"partition": {"name": "shards", "shards_per_client": 2}, "options": {}}})
    assert config_changes(cfg.to_dict()) == {
        "data.partition.name": "shards",
        "data.partition.shards_per_client": 2,
    }
    # a default key the config lacks is None, unless the config sets keys below it
    raw = build_config({}).to_dict()
    raw["data"]["options"] = {"test_size": 300}
    del raw["seed"]
    assert config_changes(raw) == {"data.options.test_size": 300, "seed": None}
    assert config_changes(build_config({"engine": {"device": "auto"}}).to_dict()) == {}


def test_the_commit_of_this_checkout_is_recorded() -> None:
    head = subprocess.run(["git", "-C", str(PACKAGE), "rev-parse", "HEAD"], capture_output=True, text=True)
    if shutil.which("git") is None or head.returncode != 0:
        pytest.skip("not run from a git checkout")
    prov = collect(build_config({}))
    assert prov["fedskew"]["commit"] == head.stdout.strip() and isinstance(prov["fedskew"]["dirty"], bool)


def _provenance_of_a_copy(where: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The provenance a copy of the package at ``where`` records, in a fresh interpreter."""
    shutil.copytree(PACKAGE, where / "fedskew", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import json, fedskew; from fedskew.experiment.provenance import collect; "
        "from fedskew.experiment.config import build_config; "
        "print(json.dumps([fedskew.__file__, collect(build_config({}))]))"
    )
    env = {**os.environ, "PYTHONPATH": str(where), **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=where)
    assert done.returncode == 0, done.stderr
    path, prov = json.loads(done.stdout)
    assert path.startswith(str(where))  # the copy ran, not the checkout
    return prov


@pytest.mark.slow
def test_an_install_outside_a_checkout_records_no_commit_and_does_not_fail(tmp_path: Path) -> None:
    prov = _provenance_of_a_copy(tmp_path)
    assert prov["fedskew"] == {"version": fedskew.__version__, "commit": None, "dirty": None}
    assert prov["versions"]["torch"] == torch.__version__


@pytest.mark.slow
def test_a_package_inside_another_repository_does_not_take_its_commit(tmp_path: Path) -> None:
    """A virtual environment inside a user's project repository: the package is not tracked there."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "x.txt").write_text("x")
    subprocess.run(["git", "-C", str(tmp_path), "add", "x.txt"], check=True)
    subprocess.run(
        ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
        check=True,
    )
    # ... and a PATH without git at all behaves the same
    assert _provenance_of_a_copy(tmp_path)["fedskew"]["commit"] is None
    shutil.rmtree(tmp_path / "fedskew")
    assert _provenance_of_a_copy(tmp_path, {"PATH": str(tmp_path / "nothing")})["fedskew"]["commit"] is None


def test_a_resume_keeps_the_earlier_process_provenance(tmp_path: Path) -> None:
    raw = digits_config(**{**TINY, "rounds": 3})

    def stop(sim: Any, record: Any) -> None:
        if sim.round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(raw), tmp_path, on_round=stop)
    summary = run_experiment(build_config(raw), tmp_path, resume=True)
    prov = summary["provenance"]
    assert prov["started_round"] == 1
    assert [p["started_round"] for p in prov["resumed_from"]] == [0]
    assert prov["resumed_from"][0]["fedskew"] == prov["fedskew"]


# ---------------------------------------------------------------------------- reports
def write_run(root: Path, name: str, seed: int, prov: dict[str, Any] | None) -> None:
    folder = root / name / f"seed{seed}"
    folder.mkdir(parents=True)
    cfg = {"seed": seed, "algorithm": {"name": name}, "eval": {"protocol": "global"}}
    summary = {"final": {"accuracy": 0.5, "loss": 1.0}, "rounds": 2, "wall_seconds": 1.0, "bytes_up": 1}
    if prov is not None:
        summary["provenance"] = prov
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 2, "accuracy": 0.5}) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary))


def prov_of(commit: str, torch_version: str = "2.13.0") -> dict[str, Any]:
    return {
        "command": "fedskew run x.yaml",
        "fedskew": {"version": "0.1.0", "commit": commit, "dirty": False},
        "versions": {"python": "3.11.7", "torch": torch_version, "numpy": "2.0", "flwr": None},
        "machine": {"cores": 2, "threads": 1, "device": "cpu"},
        "config_changes": {"client.lr": 0.1},
    }


def test_a_report_over_runs_of_different_commits_says_so_in_every_format(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    write_run(root, "fedavg", 0, prov_of("a" * 40))
    write_run(root, "fedavg", 1, prov_of("a" * 40))
    write_run(root, "fedprox", 0, prov_of("b" * 40))

    def report(fmt: str, **kw: Any) -> str:
        return make_report(ReportRequest([root], fmt, plot=tmp_path / "p.png", **kw)).text

    expected = "RUNS DIFFER in commit: aaaaaaaaaaaa (2 runs), bbbbbbbbbbbb (1 run)"
    md = report("markdown", html=tmp_path / "r.html")
    assert "provenance: fedskew 0.1.0, dirty false, python 3.11.7, torch 2.13.0" in md and expected in md
    assert "% provenance: fedskew 0.1.0" in report("latex") and expected in report("latex")
    page = (tmp_path / "r.html").read_text()
    assert (
        "The runs differ in commit." in page and "<b>differs: aaaaaaaaaaaa (2), bbbbbbbbbbbb (1)</b>" in page
    )
    assert "fedskew run x.yaml" in page and "client.lr: 0.1" in page
    report("csv")
    sidecar = json.loads((tmp_path / "p_provenance.json").read_text())
    assert (
        sidecar["differ"] == ["commit"] and sidecar["runs"][0]["provenance"]["fedskew"]["commit"] == "a" * 40
    )
    assert any(expected in note for note in sidecar["notes"])


def test_runs_that_agree_say_nothing_differs_and_unrecorded_runs_count_as_different() -> None:
    same = compare([prov_of("c" * 40), prov_of("c" * 40)])
    assert "DIFFER" not in describe(same) and "commit cccccccccccc" in describe(same)
    mixed = describe(compare([prov_of("c" * 40), None]))
    assert "RUNS DIFFER in fedskew: 0.1.0 (1 run), unrecorded (1 run)" in mixed
    assert (
        describe(compare([None, None]))
        == "provenance: not recorded (runs written before fedskew recorded it)"
    )
    # a run resumed on another torch counts both
    resumed = {**prov_of("c" * 40), "resumed_from": [prov_of("c" * 40, torch_version="2.12.0")]}
    assert "torch: 2.12.0 (1 run), 2.13.0 (2 runs)" in describe(compare([resumed, prov_of("c" * 40)]))
