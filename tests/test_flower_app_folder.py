"""``fedskew flower-app``: a standalone Flower app folder (pyproject.toml naming fedskew's generic apps, the
resolved config as YAML text in its run config, a README) that Flower's own checks accept, and that
``flwr run FOLDER`` runs to completion on a TLS + authentication deployment on loopback with the embedded
engine's metrics within 1e-5 (in tests/test_flower_deployment.py, on its shared deployment)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from io import BytesIO
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("flwr")

from flwr.cli.build import build_fab_from_disk
from flwr.common.config import validate_config

from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.config import build_config, dump_config
from fedskew.flower.app_folder import toml_string, write_app
from fedskew.flower.apps import run_config_jobs
from tests.test_flower import flower_config

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs/fedavg/digits-flower.yaml"


def fedskew(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "fedskew", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def _pyproject(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def test_the_app_passes_flowers_checks_and_its_run_config_holds_the_resolved_config(tmp_path):
    cfg = build_config(flower_config("ditto", rounds=2))  # engine.runtime: embedded
    app = tmp_path / "app"
    write_app(app, cfg, "/srv/runs/ditto", "ditto")
    doc = _pyproject(app)
    assert validate_config(doc, check_module=True, project_dir=app)[:2] == (True, [])
    assert doc["tool"]["flwr"]["app"]["publisher"] == "fedskew"
    assert doc["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "fedskew.flower.apps:server_app",
        "clientapp": "fedskew.flower.apps:client_app",
    }
    assert doc["project"]["dependencies"][0].startswith("fedskew[flower]")
    rc = doc["tool"]["flwr"]["app"]["config"]
    readable_yaml = "\nconfig = '''\nname: null\nplugins: []\nseed: 0\n"
    assert readable_yaml in (app / "pyproject.toml").read_text()
    assert (rc["out"], rc["resume"], rc["force"]) == ("/srv/runs/ditto", False, False)
    (job,) = run_config_jobs(rc)  # what the ServerApp runs: the embedded config, on a Flower deployment
    raw = cfg.to_dict()
    assert job.cfg == build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-deployment"}})
    assert (str(job.out), job.resume, job.force) == ("/srv/runs/ditto", False, False)
    with zipfile.ZipFile(BytesIO(build_fab_from_disk(app))) as fab:  # what `flwr run` submits
        assert {"pyproject.toml", "README.md"} <= set(fab.namelist())
    assert "flwr run . CONNECTION" in (app / "README.md").read_text()


def test_the_run_config_still_takes_config_paths(tmp_path):
    cfg = build_config(flower_config("fedavg", rounds=1))
    paths = [tmp_path / "a.yaml", tmp_path / "b.yaml"]
    for p in paths:
        p.write_text(dump_config(cfg))
    jobs = run_config_jobs({"config": ";".join(map(str, paths)), "out": "x;y", "resume": True})
    assert [(j.cfg, str(j.out), j.resume) for j in jobs] == [(cfg, "x", True), (cfg, "y", True)]
    with pytest.raises(FedskewError, match="2 configs but 1 output folders"):
        run_config_jobs({"config": ";".join(map(str, paths)), "out": "x"})
    with pytest.raises(ConfigError, match=r"run config 'config': invalid YAML"):
        run_config_jobs({"config": "seed: [0\nrounds: 1\n", "out": "x"})


@pytest.mark.parametrize(
    "text", ["a: 1\nb: 'it''s'\n", "x: '''\n", "ends'", "tab\there\n", 'q"\\\x7f\r\n', "é😀\n"]
)
def test_any_text_round_trips_through_a_toml_string(text):
    assert tomllib.loads(f"v = {toml_string(text)}")["v"] == text


def test_bad_input_exits_2_with_one_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    taken = fedskew("flower-app", str(DIGITS), "--out", str(tmp_path))
    assert taken.returncode == 2 and taken.stderr.count("\n") == 1 and "pass --force" in taken.stderr
    bad = fedskew("flower-app", str(DIGITS), "--out", str(tmp_path / "new"), "--set", "engine.nodes=0")
    assert bad.returncode == 2 and "engine.nodes" in bad.stderr and not (tmp_path / "new").exists()
