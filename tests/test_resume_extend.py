"""``--resume`` names what changed, and ``--resume --rounds N`` extends a run exactly: the same metrics as a
run of N rounds from the start (runs are deterministic on one machine, so floats compare with ``==``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedskew.cli import app
from fedskew.errors import FedskewError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from tests.conftest import digits_config

#: partial participation (the sampling stream) and an evaluation grid the shorter run ends off
BASE = {
    "data": {"dataset": "digits", "num_clients": 5, "partition": {"name": "dirichlet", "alpha": 0.5}},
    "client": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.5, "fraction": 0.6},
    "eval": {"protocol": "global", "every": 3},
    "checkpoint": {"every": 1},
}


def config(**over: object) -> dict:
    return digits_config(**{**BASE, **over})


def metrics(folder: Path) -> list[dict]:
    """Every record of metrics.jsonl without its wall-clock timings."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("seconds")} for line in lines]


@pytest.fixture(scope="module")
def four_rounds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    run_experiment(build_config(config(rounds=4)), out)
    return out


def write_config(folder: Path, raw: dict) -> Path:
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_extending_a_finished_run_equals_a_run_of_that_length(tmp_path, four_rounds):
    out = tmp_path / "run"
    path = write_config(tmp_path, config(rounds=2))
    first = CliRunner().invoke(app, ["run", str(path), "--out", str(out)])
    assert first.exit_code == 0, first.output
    assert [r["round"] for r in metrics(out)] == [2]  # the last round is always evaluated
    more = CliRunner().invoke(app, ["run", str(path), "--out", str(out), "--resume", "--rounds", "4"])
    assert more.exit_code == 0, more.output
    assert metrics(out) == metrics(four_rounds)  # round 2's record dropped: a 4-round run has none
    assert [r["round"] for r in metrics(out)] == [3, 4]
    assert yaml.safe_load((out / "config.yaml").read_text())["rounds"] == 4
    summary = json.loads((out / "summary.json").read_text())
    reference = json.loads((four_rounds / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["final"] == reference["final"]


def test_extending_an_interrupted_run_equals_a_run_of_that_length(tmp_path, four_rounds):
    out = tmp_path / "run"

    def stop_after_two(sim, record):
        if sim.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(config(rounds=3)), out, on_round=stop_after_two)
    assert not (out / "summary.json").exists()
    run_experiment(build_config(config(rounds=4)), out, resume=True)
    assert metrics(out) == metrics(four_rounds)


def test_resume_names_every_changed_key_with_old_and_new_values(tmp_path):
    out = tmp_path / "run"
    run_experiment(build_config(config(rounds=1)), out)
    changed = config(rounds=2, client={**BASE["client"], "lr": 0.1}, data={**BASE["data"], "num_clients": 4})
    with pytest.raises(FedskewError) as err:
        run_experiment(build_config(changed), out, resume=True)
    message = str(err.value)
    assert "client.lr: 0.05 -> 0.1" in message and "data.num_clients: 5 -> 4" in message
    assert "rounds:" not in message and "\n" not in message  # rounds alone may change
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1  # nothing was touched


def test_fewer_rounds_than_done_are_refused(tmp_path):
    out = tmp_path / "run"
    run_experiment(build_config(config(rounds=3)), out)
    with pytest.raises(
        FedskewError, match=r"rounds=2 is fewer than the 3 rounds done .*allowed: rounds >= 3"
    ):
        run_experiment(build_config(config(rounds=2)), out, resume=True)
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3


def test_extension_is_refused_where_rounds_shape_the_run(tmp_path):
    out = tmp_path / "run"
    cosine = {**BASE["client"], "lr_schedule": "cosine"}
    run_experiment(build_config(config(rounds=1, client=cosine)), out)
    with pytest.raises(FedskewError, match="client.lr_schedule=cosine"):
        run_experiment(build_config(config(rounds=2, client=cosine)), out, resume=True)
    # the same total still resumes (nothing to extend)
    assert run_experiment(build_config(config(rounds=1, client=cosine)), out, resume=True)["rounds"] == 1


def test_cli_refuses_a_changed_key_with_exit_2_and_one_line(tmp_path):
    out = tmp_path / "run"
    path = write_config(tmp_path, config(rounds=1))
    assert CliRunner().invoke(app, ["run", str(path), "--out", str(out)]).exit_code == 0
    res = CliRunner().invoke(
        app, ["run", str(path), "--out", str(out), "--resume", "--rounds", "2", "--set", "seed=3"]
    )
    assert isinstance(res.exception, FedskewError) and "seed: 0 -> 3" in str(res.exception)
    bad = CliRunner().invoke(app, ["run", str(path), "--out", str(out), "--resume", "--rounds", "0"])
    assert "rounds" in str(bad.exception)  # validated like --set rounds=0
