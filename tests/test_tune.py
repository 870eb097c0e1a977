"""``fedskew tune`` (issue 52, item 3): equal trial counts per method over lr × declared knobs, the objective
on the validation split's final round only, tuning seeds refused as reporting seeds, resume after a kill."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedskew.cli import app
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.tune_record import read_trial
from fedskew.experiment.tune_space import SearchSpace, grid, override
from tests.conftest import cli, digits_config

optuna = pytest.importorskip("optuna")

ROOT = Path(__file__).resolve().parents[1]
METHODS, SEEDS, TRIALS = ("fedavg", "fedprox"), (100, 101), 3
#: a hang, not a slow machine, takes this long
DEADLINE = 300.0


def write_base(folder: Path, **over: object) -> Path:
    cfg = digits_config(rounds=2, checkpoint={"every": 1})
    cfg["data"] = {**cfg["data"], "val_fraction": 0.2}
    cfg.update(over)
    path = folder / "base.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tune_args(base: Path, out: Path, *extra: str, trials: int = TRIALS) -> list[str]:
    seeds = ",".join(map(str, SEEDS))
    return ["tune", str(base), "--methods", ",".join(METHODS), "--trials", str(trials), "--seeds", seeds,
            "--out", str(out), *extra]  # fmt: skip


def studies(out: Path) -> dict[str, object]:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(out / "journal.log")))
    return {m: optuna.load_study(study_name=m, storage=storage) for m in METHODS}


def completed(study: object) -> list[object]:
    return study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))  # type: ignore[attr-defined]


def summaries(out: Path) -> dict[Path, int]:
    """Every run's summary.json under ``out`` -> its mtime (ns)."""
    return {p: p.stat().st_mtime_ns for p in out.glob("*/trial*/seed*/summary.json")}


def run_final(folder: Path) -> dict[str, float]:
    return json.loads((folder / "summary.json").read_text())["final"]


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A finished two-method study: fedavg (knob: lr) and fedprox (lr × μ), 3 trials, seeds 100 and 101."""
    folder = tmp_path_factory.mktemp("tune")
    base, out = write_base(folder), folder / "study"
    res = CliRunner().invoke(app, tune_args(base, out))
    assert res.exit_code == 0, res.output
    return base, out, res.output


def test_equal_budget_and_val_only_objective(study):
    _, out, output = study
    found = studies(out)
    for method, st in found.items():
        trials = completed(st)
        assert len(trials) == TRIALS  # the same number for every method
        knobs = {"client.lr"} | ({"algorithm.mu"} if method == "fedprox" else set())
        for t in trials:
            assert set(t.params) == knobs
            folders = [out / method / f"trial{t.number}" / f"seed{s}" for s in SEEDS]
            val = [run_final(f)["val_accuracy"] for f in folders]
            test = [run_final(f)["accuracy"] for f in folders]
            assert t.value == pytest.approx(sum(val) / len(val), abs=1e-12)  # final val, mean over seeds
            assert t.value != pytest.approx(sum(test) / len(test), abs=1e-12)  # ... not test
            for f in folders:  # each run ran the trial's values
                saved = yaml.safe_load((f / "config.yaml").read_text())
                assert saved["client"]["lr"] == t.params["client.lr"]
                if method == "fedprox":
                    assert saved["algorithm"]["mu"] == t.params["algorithm.mu"]
        best = max(trials, key=lambda t: t.value)
        budget = json.loads((out / "budget.json").read_text())["methods"][method]
        assert budget["trials"] == TRIALS and budget["runs"] == TRIALS * len(SEEDS)
        assert budget["seeds"] == list(SEEDS) and budget["best"]["trial"] == best.number
        chosen = yaml.safe_load((out / "chosen" / f"{method}.yaml").read_text())
        assert chosen["tuning"]["seeds"] == list(SEEDS) and chosen["tuning"]["values"] == best.params
        assert chosen["client"]["lr"] == best.params["client.lr"]
        assert chosen["seed"] not in SEEDS
    assert "fedprox" in output and "best val acc" in output


def test_the_same_first_trials_on_a_fresh_folder(study, tmp_path):
    """The sampler is seeded: the same command proposes the same values (trial 0 has no history)."""
    base, out, _ = study
    again = tmp_path / "again"
    res = CliRunner().invoke(app, tune_args(base, again, trials=1))
    assert res.exit_code == 0, res.output
    for method, st in studies(again).items():
        first = {t.number: t.params for t in completed(studies(out)[method])}[0]
        assert completed(st)[0].params == first


def test_sweep_takes_the_chosen_configs_and_refuses_tuning_seeds(study, tmp_path, monkeypatch, capsys):
    _, out, _ = study
    chosen = sorted(map(str, (out / "chosen").glob("*.yaml")))
    code, stdout, _ = cli(["sweep", *chosen, "--seeds", "0-1", "--out", str(tmp_path / "r"), "--dry-run"],
                          monkeypatch, capsys)  # fmt: skip
    assert code == 0 and stdout.strip().endswith("4 runs: 4 new")
    code, _, err = cli(
        ["sweep", *chosen, "--seeds", "7,101", "--out", str(tmp_path / "r")], monkeypatch, capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "101 is one of the seeds its values were tuned on" in err
    assert not (tmp_path / "r").exists()  # refused before any run
    # fedskew run alike: the config itself refuses the seed, whoever builds it
    raw = yaml.safe_load(Path(chosen[0]).read_text())
    with pytest.raises(ConfigError, match="config key 'seed': 100 is one of"):
        build_config({**raw, "seed": 100})


def test_rerun_prints_the_result_and_runs_nothing(study, monkeypatch, capsys):
    base, out, _ = study
    before = summaries(out)
    code, stdout, _ = cli(tune_args(base, out), monkeypatch, capsys)
    assert code == 0 and "best val acc" in stdout and "done " not in stdout
    assert summaries(out) == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--methods", "fedavg"], "started with --methods fedavg,fedprox (now fedavg)"),
        (["--seeds", "100,102"], "started with --seeds 100,101 (now 100,102)"),
        (["--sampler", "random"], "started with --sampler tpe (now random)"),
        (["--set", "client.epochs=2"], "another config (fedavg's client.epochs: 1 then, 2 now)"),
        (["--trials", "2"], "--trials 2: the study in"),
    ],
)
def test_a_changed_command_is_one_line(study, change, message, monkeypatch, capsys):
    base, out, _ = study
    args = tune_args(base, out)
    for flag, value in zip(change[::2], change[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    before = summaries(out)
    code, _, err = cli(args, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert summaries(out) == before


def test_more_trials_extend_the_study(tmp_path):
    base, out = write_base(tmp_path, rounds=1), tmp_path / "study"
    assert CliRunner().invoke(app, tune_args(base, out, trials=1)).exit_code == 0
    first = summaries(out)
    res = CliRunner().invoke(app, tune_args(base, out, trials=2))
    assert res.exit_code == 0, res.output
    assert all(len(completed(st)) == 2 for st in studies(out).values())
    assert {p: m for p, m in summaries(out).items() if p in first} == first  # trial 0 kept as it was
    assert json.loads((out / "budget.json").read_text())["trials_per_method"] == 2


# ---------------------------------------------------------------------------- the objective
def _summary(folder: Path, final: dict[str, object], best_val: float | None = None) -> Path:
    folder.mkdir(parents=True)
    summary: dict[str, object] = {"final": final, "status": "finished"}
    if best_val is not None:
        summary["best_val"] = {"round": 1, "val_accuracy": best_val, "accuracy": 0.99}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_the_objective_is_the_final_validation_accuracy(tmp_path):
    """Adversarial: val and test disagree, and an earlier round had a better val score; only the final
    round's val accuracy counts, and a diverged run (no finite val accuracy) scores 0, not a skip."""
    good_on_val = [
        _summary(tmp_path / "a0", {"val_accuracy": 0.8, "accuracy": 0.2}, best_val=0.95),
        _summary(tmp_path / "a1", {"val_accuracy": 0.6, "accuracy": 0.3}),
    ]
    good_on_test = [
        _summary(tmp_path / "b0", {"val_accuracy": 0.3, "accuracy": 0.9}, best_val=0.99),
        _summary(tmp_path / "b1", {"val_accuracy": 0.4, "accuracy": 0.95}),
    ]
    assert read_trial(good_on_val) == pytest.approx(0.7)
    assert read_trial(good_on_test) == pytest.approx(0.35)
    diverged = [_summary(tmp_path / "c0", {"val_accuracy": None, "accuracy": None}), good_on_val[1]]
    assert read_trial(diverged) == pytest.approx(0.3)


def test_a_failed_run_scores_zero_not_its_initial_models_accuracy(tmp_path):
    """Adversarial (review R1): a diverged run's uploads are all rejected, so it ends at its initial model's
    finite chance-level val accuracy with ``status: failed``; it must score 0, below a run that learned a
    little, or the sampler would prefer divergence to a small lr."""
    diverged = _summary(tmp_path / "d", {"val_accuracy": 0.118, "accuracy": 0.11})
    summary = json.loads((diverged / "summary.json").read_text())
    (diverged / "summary.json").write_text(json.dumps({**summary, "status": "failed", "failure": "x"}))
    slow = _summary(tmp_path / "s", {"val_accuracy": 0.10, "accuracy": 0.10})
    assert read_trial([diverged]) == 0.0 and read_trial([slow]) == pytest.approx(0.10)


def test_an_empty_validation_split_stops_the_tune_in_one_line(tmp_path, monkeypatch, capsys):
    """Adversarial (review R1): data.val_fraction > 0 passes the up-front check, but x each client's
    samples it rounds to 0: no run scores a validation sample, every trial would tie at 0 and the first be
    "chosen". Refused in one line, exit 2, nothing chosen."""
    base, out = write_base(tmp_path, rounds=1), tmp_path / "study"
    args = [*tune_args(base, out, trials=1), "--set", "data.val_fraction=0.0001"]
    code, _, err = cli(args, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "scored no validation sample" in err, err
    assert not (out / "chosen").exists() and not (out / "budget.json").exists()


def test_a_trial_the_config_refuses_says_a_rerun_repeats_it(tmp_path, monkeypatch, capsys):
    """Adversarial (review R1): LG-FedAvg's declared global_layers cannot apply under a fixed
    ``global_part=head``; the refusal comes from the run, after the trial was asked, and a rerun re-runs
    the trial with the same values. The line must not promise that a rerun resumes: exit 1, one line."""
    base, out = write_base(tmp_path, rounds=1, eval={"protocol": "personalized", "every": 1}), tmp_path / "s"
    args = ["tune", str(base), "--methods", "lgfedavg", "--trials", "1", "--seeds", "100", "--out", str(out),
            "--set", "algorithm.global_part=head"]  # fmt: skip
    for _ in range(2):  # the rerun repeats it
        code, _, err = cli(args, monkeypatch, capsys)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert "refused by this config" in err and "a rerun would repeat it" in err
        assert "rerun to resume" not in err


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "fedavg,fedprxo"], "unknown algorithm 'fedprxo' (did you mean 'fedprox'?)"),
        (["--knobs", "algorithm.zeta"], "--knobs 'algorithm.zeta': no method of --methods declares it"),
        (["--methods", "fedavg", "--knobs", "algorithm.mu"], "--knobs 'algorithm.mu': no method"),
        (["--set", "data.val_fraction=0"], "the objective is the validation accuracy"),
        (["--trials", "0"], "--trials 0: allowed: at least 1"),
        (["--sampler", "bayes"], "--sampler 'bayes': allowed: tpe, random, grid"),
        (["--set", "client.lr=0.1"], "--set client.lr: a knob fedavg tunes"),
        (["--seeds", "1-0"], "--seeds '1-0'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message, monkeypatch, capsys):
    base, out = write_base(tmp_path), tmp_path / "study"
    argv = tune_args(base, out)
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag in argv and flag != "--set":
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    code, _, err = cli(argv, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not out.exists()  # refused before anything is written


PLUGIN = """
from fedskew.algorithms.base import ALGORITHMS, Algorithm, HyperParams
from fedskew.search_space import tunable


@ALGORITHMS.register("tune_plugin_method")
class Mine(Algorithm):
    \"\"\"A user's method whose knob is declared in its own folder.\"\"\"

    class Params(HyperParams):
        k: int = tunable(2, low=1, high=4, integer=True, ge=1, description="a whole-number knob")
"""


def test_a_plugin_method_from_the_config_declares_its_knobs(tmp_path):
    """The config's ``plugins:`` are loaded before the methods are checked: a user's method is tuned over
    the knobs it declares, beside a built-in one, on the same budget."""
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.experiment.tune import TuneSpec, check_spec

    (tmp_path / "mine.py").write_text(PLUGIN)
    base = write_base(tmp_path, plugins=["mine.py"])
    with ALGORITHMS.restored():
        plan = check_spec(TuneSpec(base, ("fedavg", "tune_plugin_method"), 2, (100,), tmp_path / "out"))
        assert list(plan.knobs["tune_plugin_method"]) == ["client.lr", "algorithm.k"]
        assert list(plan.knobs["fedavg"]) == ["client.lr"]
        assert plan.base["tune_plugin_method"]["algorithm"]["name"] == "tune_plugin_method"
    assert not (tmp_path / "out").exists()


def test_override_values_parse_back_exactly():
    """YAML 1.1 reads ``1e-05`` as a string: a tuned value must reach the run as the float it was."""
    for key, value in [("client.lr", 1e-05), ("algorithm.mu", 0.1 + 0.2), ("algorithm.k", 3),
                       ("algorithm.mode", "code"), ("algorithm.flag", True)]:  # fmt: skip
        text = override(key, value).partition("=")[2]
        assert yaml.safe_load(text) == value and type(yaml.safe_load(text)) is type(value)


def test_grid_reaches_the_trial_count_with_both_ends():
    lr = SearchSpace(1e-3, 0.5, log=True)
    points = grid({"client.lr": lr, "algorithm.mode": SearchSpace(choices=("a", "b"))}, 5)
    assert math.prod(len(v) for v in points.values()) >= 5
    assert points["client.lr"][0] == 1e-3 and points["client.lr"][-1] == 0.5
    assert points["algorithm.mode"] == ["a", "b"]
    with pytest.raises(ConfigError, match="has 3 points, fewer than --trials 4"):
        grid({"algorithm.k": SearchSpace(1, 3, integer=True)}, 4)


# ---------------------------------------------------------------------------- resume after a kill
@pytest.mark.slow
def test_a_killed_tune_resumes_with_the_same_budget(tmp_path, monkeypatch, capsys):
    """SIGKILL once the first run has written its summary (polled, never a fixed sleep); the rerun keeps
    the finished runs (their summary.json untouched), re-runs the interrupted trial with its own values
    (no trial folder beyond trial0..2) and ends with exactly --trials completed trials per method."""
    base, out = write_base(tmp_path, rounds=3), tmp_path / "study"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedskew", *tune_args(base, out)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        end = time.monotonic() + DEADLINE
        while not summaries(out):
            assert proc.poll() is None, f"tune exited ({proc.returncode}) first: {proc.stderr.read()}"
            assert time.monotonic() < end, "no run finished (a hang)"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    done = summaries(out)
    assert not (out / "budget.json").exists()  # the kill landed before the end
    assert sum(len(completed(st)) for st in studies(out).values()) < TRIALS * len(METHODS)
    running = {
        (m, t.number): t.params
        for m, st in studies(out).items()
        for t in st.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    }
    assert running  # the first trial's first run finished, its second had not: that trial was cut short
    code, _, err = cli(tune_args(base, out), monkeypatch, capsys)
    assert code == 0, err
    assert {p: m for p, m in summaries(out).items() if p in done} == done  # not re-run
    for method, st in studies(out).items():
        assert len(completed(st)) == TRIALS
        for t in completed(st):  # the interrupted trials finished with the values they started with
            assert running.get((method, t.number), t.params) == t.params
        folders = sorted(p.name for p in (out / method).iterdir())
        assert folders == [f"trial{t.number}" for t in completed(st)]
        for t in completed(st):
            for s in SEEDS:
                saved = yaml.safe_load(
                    (out / method / f"trial{t.number}" / f"seed{s}" / "config.yaml").read_text()
                )
                assert saved["client"]["lr"] == t.params["client.lr"]


def test_report_refuses_to_average_trial_runs_into_the_chosen_configs_numbers(study, tmp_path, monkeypatch,
                                                                              capsys):  # fmt: skip
    """A tune's trial runs carry no ``tuning`` record, so `fedskew report` over the tune and the reporting
    sweep together would group the best trial's tuning-seed runs with the reporting seeds' runs."""
    _, out, _ = study
    chosen = sorted(map(str, (out / "chosen").glob("*.yaml")))[:1]
    report = tmp_path / "report"
    code, _, err = cli(["sweep", *chosen, "--seeds", "0-1", "--out", str(report)], monkeypatch, capsys)
    assert code == 0, err
    code, _, err = cli(["report", str(out), str(report)], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "on tuning seed 10" in err and "without the tune's folder" in err
    code, _, err = cli(["report", str(report)], monkeypatch, capsys)
    assert code == 0, err
