"""``fedskew sweep`` (plan, skip finished, resume interrupted, parallel workers, failures) and
``fedskew report --paired`` (seed-paired differences against a hand computation)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from fedskew.cli import app
from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.config import build_config
from fedskew.experiment.report import find_runs, group_runs, paired_differences, paired_table, select_group
from fedskew.experiment.runner import run_experiment
from fedskew.experiment.sweep import (
    RunState,
    SweepListener,
    parse_grid,
    parse_seeds,
    plan_sweep,
)
from fedskew.experiment.sweep_pool import run_sweep
from tests.barrier_run import DEADLINE, ROOT, barrier_env, wait_for_barrier
from tests.conftest import digits_config
from tests.test_cli import fedskew

TINY = {"rounds": 2, "model": {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16}}


def write_configs(tmp_path: Path) -> list[Path]:
    """Two tiny digits configs, FedAvg and FedProx, 4 clients."""
    paths = []
    for alg in ("fedavg", "fedprox"):
        cfg = digits_config(**TINY, algorithm={"name": alg})
        cfg["data"]["num_clients"] = 4
        paths.append(tmp_path / f"digits-{alg}.yaml")
        paths[-1].write_text(yaml.safe_dump(cfg))
    return paths


def metrics(folder: Path) -> list[dict]:
    """Per-round metrics without the wall-clock timings."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in rows]


class InterruptAt(SweepListener):
    """Raises KeyboardInterrupt (as Ctrl-C would) at the first round event of the run in ``folder``."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder, self.fired = folder, False

    def run_round(self, run, round_, accuracy):
        if not self.fired and self.folder in (None, run.folder):
            self.fired = True
            raise KeyboardInterrupt


def test_plan_names_folders_by_config_grid_point_and_seed(tmp_path):
    a, b = write_configs(tmp_path)
    runs = plan_sweep([a, b], tmp_path / "out", [0, 1], ["client.lr=0.05,0.1"], ["rounds=3"])
    rel = [str(r.folder.relative_to(tmp_path / "out")) for r in runs]
    assert rel[:4] == [
        "digits-fedavg/client.lr=0.05/seed0",
        "digits-fedavg/client.lr=0.1/seed0",
        "digits-fedprox/client.lr=0.05/seed0",
        "digits-fedprox/client.lr=0.1/seed0",
    ]
    assert len(runs) == 8 and rel[4].endswith("seed1")
    assert runs[1].config["client"]["lr"] == 0.1
    assert runs[0].overrides == ("rounds=3", "client.lr=0.05") and runs[0].rounds == 3
    named = plan_sweep([a, b], tmp_path / "o", [7], name="x-{algorithm.name}-{data.partition.alpha}")
    assert [r.folder.name for r in named] == ["seed7", "seed7"]
    assert [r.folder.parent.name for r in named] == ["x-fedavg-0.5", "x-fedprox-0.5"]
    with pytest.raises(ConfigError, match="would share the folder"):
        plan_sweep([a, b], tmp_path / "o", [0], name="same")


def test_parsers_accept_lists_ranges_and_reject_malformed_input():
    assert parse_seeds("0-2,7,1") == [0, 1, 2, 7]
    assert parse_grid(["algorithm.mu=0,0.1", "model.hidden=[8,16],[32]"]) == [
        ("algorithm.mu", ["0", "0.1"]),
        ("model.hidden", ["[8,16]", "[32]"]),
    ]
    for bad in (["client.lr"], ["client.lr=0.1,"], ["=1"], ["a=[1,2"], ["seed=0,1"], ["a=1", "a=2"]):
        with pytest.raises(ConfigError, match="--grid"):
            parse_grid(bad)
    for bad in ("", "a", "3-1", "1,,2"):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


@pytest.mark.slow
def test_sweep_interrupted_then_resumed_matches_uninterrupted_runs(tmp_path):
    configs = write_configs(tmp_path)
    out = tmp_path / "sweep"
    runs = plan_sweep(configs, out, [0, 1])
    assert len(runs) == 4
    for r in runs:  # the reference: every run uninterrupted
        run_experiment(build_config(r.config), tmp_path / "ref" / r.folder.relative_to(out))

    # in this process, Ctrl-C during the second run: the first is done, the second has a checkpoint
    outcome = run_sweep(runs, jobs=1, listener=InterruptAt(runs[1].folder))
    assert outcome.finished == runs[:1] and outcome.interrupted == runs[1:]
    assert [r.state for r in runs] == [RunState.FINISHED, RunState.INTERRUPTED, RunState.NEW, RunState.NEW]
    assert torch.load(runs[1].folder / "checkpoint.pt", weights_only=False)["round"] == 1
    first_summary = (runs[0].folder / "summary.json").stat().st_mtime_ns

    # in two worker processes, Ctrl-C at the first round reported: the pool stops, every run resumable
    outcome = run_sweep(runs, jobs=2, listener=InterruptAt())
    assert outcome.skipped == runs[:1] and not outcome.failed
    assert {r.folder for r in outcome.finished + outcome.interrupted} == {r.folder for r in runs[1:]}

    # the same sweep again completes it, skipping what is finished
    outcome = run_sweep(plan_sweep(configs, out, [0, 1]), jobs=1)
    assert runs[0] in outcome.skipped and not outcome.failed and not outcome.interrupted
    assert (runs[0].folder / "summary.json").stat().st_mtime_ns == first_summary
    for r in runs:
        ref = tmp_path / "ref" / r.folder.relative_to(out)
        assert metrics(r.folder) == metrics(ref), r.folder
        final = json.loads((r.folder / "summary.json").read_text())["final"]
        assert final == json.loads((ref / "summary.json").read_text())["final"]
    assert all(r.state is RunState.FINISHED for r in runs)


def test_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    good, _ = write_configs(tmp_path)
    bad = tmp_path / "too-many.yaml"  # a valid config whose partition fails at run time
    bad.write_text(yaml.safe_dump(digits_config(**TINY, data={"dataset": "digits", "num_clients": 3000})))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["sweep", str(bad), str(good), "--out", str(out)])
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines()[-1].startswith("sweep: 1 of 2 runs failed")
    assert res.stderr.strip().endswith(str(out / "too-many" / "seed0"))
    log = (out / "too-many" / "seed0" / "error.log").read_text()
    assert "DataError: partition 'iid': 3000 clients" in log
    assert (out / "digits-fedavg" / "seed0" / "summary.json").is_file()


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids.update(int(k) for k in (task / "children").read_text().split())
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_the_workers_of_a_killed_sweep_die_with_it(tmp_path):
    """A sweep killed by SIGKILL (or the OOM killer) cannot stop its workers; the kernel must, or they
    would sit forever on the pipe of a dead parent, holding their memory. The runs stay resumable."""
    import signal
    import subprocess
    import sys
    import time

    configs = write_configs(tmp_path)
    for path in configs:
        raw = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**raw, "rounds": 3}))
    out, events = tmp_path / "out", tmp_path / "barrier"
    args = ["sweep", *map(str, configs), "--jobs", "2", "--out", str(out)]
    proc = subprocess.Popen(  # each run waits in its round 2 (tests/barrier_run.py)
        [sys.executable, "-m", "tests.barrier_run", *args],
        cwd=ROOT,
        env=barrier_env(2, events),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        running = wait_for_barrier(events, proc, count=2)  # both runs, one in each worker
        workers = _children(proc.pid)  # the pool's workers and its resource tracker
        assert set(running) <= workers
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        end = time.monotonic() + DEADLINE  # a safety deadline: the kernel kills them at once
        while alive := [w for w in workers if _alive(w)]:
            assert time.monotonic() < end, f"processes {alive} outlived their sweep"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    outcome = run_sweep(plan_sweep(configs, out, [0]), jobs=1, listener=InterruptAt())
    assert outcome.interrupted and not outcome.failed
    # resumed after the killed sweep's round 1, then stopped by InterruptAt at its first round event
    assert [r["round"] for r in metrics(outcome.interrupted[0].folder)] == [1, 2]


def test_dry_run_lists_runs_with_their_state(tmp_path):
    configs = write_configs(tmp_path)
    out = tmp_path / "out"
    run_experiment(build_config(yaml.safe_load(configs[0].read_text())), out / "digits-fedavg" / "seed0")
    res = CliRunner().invoke(
        app, ["sweep", *map(str, configs), "--seeds", "0-1", "--out", str(out), "--dry-run"]
    )
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 5 and lines[-1] == "4 runs: 1 finished, 3 new"
    assert lines[0].split()[:2] == ["finished", str(out / "digits-fedavg" / "seed0")]
    assert not (out / "digits-fedprox").exists()


@pytest.mark.slow
def test_bad_grid_is_one_line_and_exit_2(tmp_path):
    configs = write_configs(tmp_path)
    res = fedskew("sweep", str(configs[0]), "--out", str(tmp_path / "out"), "--grid", "client.lr")
    assert res.returncode == 2
    assert res.stderr == "error: --grid 'client.lr': expected key=v1,v2,... e.g. client.lr=0.01,0.1\n"
    with pytest.raises(ConfigError, match="config key 'client.lrr': unknown key"):  # exit 2 alike
        plan_sweep(configs, tmp_path / "out", grid=["client.lrr=0.1,0.2"])
    assert not (tmp_path / "out").exists()


def test_sweep_refuses_a_folder_holding_another_config(tmp_path):
    configs = write_configs(tmp_path)
    folder = tmp_path / "digits-fedavg" / "seed0"
    run_experiment(build_config(yaml.safe_load(configs[0].read_text())), folder)
    with pytest.raises(ConfigError, match=r"holds a run of another config \(client.lr: 0.05 saved, 0.5"):
        plan_sweep(configs[:1], tmp_path, [0], sets=["client.lr=0.5"])
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    del saved["engine"]["memory_mb"]  # written before that key existed: its default is what it ran with
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    assert plan_sweep(configs[:1], tmp_path, [0])[0].state is RunState.FINISHED


# ---------------------------------------------------------------------------- report --paired
def fake_run(folder: Path, alg: str, seed: int, acc: float, lr: float = 0.05) -> None:
    """A result folder written by hand: config, summary and one metrics line."""
    folder.mkdir(parents=True)
    cfg = build_config(digits_config(**TINY, seed=seed, algorithm={"name": alg})).to_dict()
    cfg["client"]["lr"] = lr
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    final = {"accuracy": acc, "accuracy_std": 0.0, "loss": 1.0}
    summary = {"final": final, "rounds": 2, "wall_seconds": 1.0, "bytes_up": 1024}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 2, **final}) + "\n")


def test_paired_table_matches_a_hand_computation(tmp_path):
    results = {
        ("fedavg", 0.05): {0: 0.80, 1: 0.82, 2: 0.78},
        ("fedprox", 0.05): {0: 0.83, 1: 0.82, 2: 0.80},  # differences +3, 0, +2 points
        ("fedavg", 0.1): {0: 0.90, 1: 0.91, 3: 0.50},  # seeds 0, 1 paired: +10, +9 points
    }
    for (alg, lr), accs in results.items():
        for seed, acc in accs.items():
            fake_run(tmp_path / f"{alg}-{lr}" / f"seed{seed}", alg, seed, acc, lr)
    groups = group_runs(find_runs([tmp_path]))
    base = select_group(groups, "fedavg (client.lr=0.05)")
    assert base.label.startswith("fedavg (client.lr=0.05) | digits")
    rows = {p.group.label.split(" | ")[0]: p for p in paired_differences(groups, base)}
    # client.lr differs between the groups: every label shows it (issue 54, item 9), FedProx's too
    prox, lr01 = rows["fedprox (client.lr=0.05)"], rows["fedavg (client.lr=0.1)"]

    # by hand: mean, sample std, t_{0.975,2} = 4.302653, t_{0.975,1} = 12.706205
    assert prox.n == 3 and prox.mean == pytest.approx(0.05 / 3)
    assert prox.std == pytest.approx(
        math.sqrt(((0.03 - 0.05 / 3) ** 2 + (0.05 / 3) ** 2 + (0.02 - 0.05 / 3) ** 2) / 2)
    )
    half = 4.302653 * prox.std / math.sqrt(3)
    assert prox.interval == pytest.approx((0.05 / 3 - half, 0.05 / 3 + half), abs=1e-6)
    assert prox.excludes_zero is False
    assert lr01.n == 2 and lr01.unpaired == 2 and lr01.mean == pytest.approx(0.095)
    assert lr01.std == pytest.approx(math.sqrt(2 * 0.005**2))
    assert lr01.interval == pytest.approx((0.095 - 12.706205 * 0.005, 0.095 + 12.706205 * 0.005), abs=1e-6)
    assert lr01.excludes_zero is True

    table = paired_table(groups, base)
    assert "| 3 | 0: +3.00, 1: +0.00, 2: +2.00 | +1.67 | 1.53 | [-2.13, +5.46] | no |" in table
    assert "| 2 (2 unpaired) | 0: +10.00, 1: +9.00 | +9.50 | 0.71 | [+3.15, +15.85] | yes |" in table
    res = fedskew("report", str(tmp_path), "--paired", "fedprox", "--plot", str(tmp_path / "p.png"))
    assert res.returncode == 0, res.stderr
    assert "Paired by seed against 'fedprox (client.lr=0.05) | digits" in res.stdout
    assert "| -1.67 | 1.53 |" in res.stdout


def test_paired_baseline_must_name_one_group(tmp_path):
    for lr in (0.05, 0.1):
        fake_run(tmp_path / f"fedavg-{lr}" / "seed0", "fedavg", 0, 0.8, lr)
    groups = group_runs(find_runs([tmp_path]))
    assert select_group(groups, "client.lr=0.1").label.startswith("fedavg (client.lr=0.1) | digits")
    assert select_group(groups, "fedavg-0.05").label.startswith("fedavg (client.lr=0.05) | digits")
    with pytest.raises(
        FedskewError, match=r"'fedavg' matches 2 groups: 'fedavg \(client.lr=0.05\) \| digits"
    ):
        select_group(groups, "fedavg")
    with pytest.raises(
        FedskewError, match="'scaffold': no group's label, sweep folder or algorithm matches; groups: 'fedavg"
    ):
        select_group(groups, "scaffold")
