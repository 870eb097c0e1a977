"""``fedskew sweep`` refuses, before its first run starts, a sweep with a run that cannot work: a bad config
anywhere in the expansion, a missing optional package, a tracker that cannot be reached
(experiment/sweep_check.py): one line, ``sweep: <run folder>: <problem>``, exit 2, nothing started."""

from __future__ import annotations

import socket
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from fedskew.errors import ConfigError
from fedskew.experiment.sweep import plan_runs
from fedskew.experiment.sweep_check import check_runs
from tests.conftest import VL_WORLD, digits_config
from tests.test_sweep import TINY, write_configs


def sweep_main(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """``fedskew sweep ARGS`` in this process: (exit code, stderr)."""
    from fedskew.cli import main

    monkeypatch.setattr(sys, "argv", ["fedskew", "sweep", *args])
    with pytest.raises(SystemExit) as info:
        main()
    return int(info.value.code or 0), capsys.readouterr().err


def config_with(tmp_path: Path, name: str, **over) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(digits_config(**TINY, **over)))
    return path


def refusal(runs) -> str:
    with pytest.raises(ConfigError) as info:
        check_runs(runs)
    return str(info.value)


def test_a_bad_key_in_the_third_config_stops_the_sweep_before_any_run(tmp_path, monkeypatch, capsys):
    a, b = write_configs(tmp_path)
    bad = tmp_path / "third.yaml"
    bad.write_text(yaml.safe_dump(digits_config(**TINY)).replace("lr: 0.05", "lrr: 0.05"))
    line = next(i for i, text in enumerate(bad.read_text().splitlines(), 1) if "lrr" in text)
    out = tmp_path / "out"
    code, err = sweep_main(monkeypatch, capsys, str(a), str(b), str(bad), "--out", str(out), "--seeds", "0-1")
    assert code == 2
    assert err.startswith(f"error: sweep: {out / 'third' / 'seed0'}: {bad}:{line}:3: config key 'client.lrr'")
    assert err.count("\n") == 1
    assert not out.exists()  # nothing ran, not even the first config's runs


def test_a_tracker_misconfiguration_is_one_line_before_the_first_run(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = config_with(tmp_path, "tb", log={"tensorboard": str(blocker / "tb")})
    out = tmp_path / "out"
    code, err = sweep_main(monkeypatch, capsys, str(config), "--out", str(out), "--seeds", "0-3")
    assert (code, err) == (
        2,
        f"error: sweep: {out / 'tb' / 'seed0'}: log.tensorboard '{blocker / 'tb'}': '{blocker}' is a file, "
        "not a folder\n",
    )
    assert not out.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_mlflow_server_is_refused_and_a_reachable_one_passes(tmp_path):
    port = free_port()  # nothing listens there now
    config = config_with(tmp_path, "ml", log={"mlflow": f"http://127.0.0.1:{port}"})
    runs = plan_runs([config], tmp_path / "out", [0, 1]).runs
    assert refusal(runs) == (
        f"sweep: {runs[0].folder}: log.mlflow.uri 'http://127.0.0.1:{port}': cannot connect to "
        f"127.0.0.1:{port} (Connection refused)"
    )
    with socket.socket() as server:  # a listening server: reachable
        server.bind(("127.0.0.1", 0))
        server.listen()
        config = config_with(tmp_path, "ml2", log={"mlflow": f"http://127.0.0.1:{server.getsockname()[1]}"})
        check_runs(plan_runs([config], tmp_path / "out", [0, 1]).runs)


def test_mlflow_file_stores_must_be_creatable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fine = config_with(tmp_path, "ok", log={"mlflow": f"sqlite:///{tmp_path}/new/dir/mlflow.db"})
    check_runs(plan_runs([fine], tmp_path / "out").runs)  # MLflow creates missing folders
    bad = config_with(tmp_path, "bad", log={"mlflow": f"sqlite:///{blocker}/mlflow.db"})
    runs = plan_runs([bad], tmp_path / "out").runs
    assert refusal(runs).endswith(
        f"log.mlflow.uri 'sqlite:///{blocker}/mlflow.db': '{blocker}' is a file, not a folder"
    )


def test_wandb_online_without_a_key_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    online = config_with(tmp_path, "wb", log={"wandb": {"mode": "online"}})
    runs = plan_runs([online], tmp_path / "out").runs
    assert refusal(runs) == (
        f"sweep: {runs[0].folder}: log.wandb.mode=online: no W&B API key (WANDB_API_KEY or `wandb login`); "
        "or mode: offline"
    )
    offline = config_with(tmp_path, "wb2", log={"wandb": {"mode": "offline"}})
    check_runs(plan_runs([offline], tmp_path / "out").runs)  # offline needs neither key nor network


def test_a_missing_extra_is_named_with_its_install_line(tmp_path, monkeypatch):
    if find_spec("open_clip") is None:  # `make` installs the clip extra; without it that one is named first
        pytest.skip("needs the backbone's extra (clip) installed")
    monkeypatch.setitem(sys.modules, "diffusers", None)  # the generators extra absent, whatever is installed
    vl = dict(VL_WORLD, generator={"name": "diffusers"})
    config = config_with(tmp_path, "gen", data={"dataset": "digits", "num_clients": 4, "vision_language": vl})
    runs = plan_runs([config], tmp_path / "out").runs
    assert refusal(runs) == (
        f"sweep: {runs[0].folder}: generator diffusers needs the 'diffusers' package: "
        "pip install 'fedskew[generators]'"
    )


def test_a_plain_sweep_passes_the_checks(tmp_path):
    check_runs(plan_runs(write_configs(tmp_path), tmp_path / "out", [0, 1]).runs)
