"""The thread policy (fedskew/threads.py): free cores (affinity, cgroup quota, minus the busy ones) shared
among the processes a run starts; ``--threads`` / ``engine.threads`` on run, demo and sweep; bad values as
one line with exit code 2; a resume under another thread count; Flower's own log in the run folder."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedskew.experiment.config import results_config
from fedskew.runtimes import engine_processes
from fedskew.settings import EngineSection
from fedskew.threads import (
    apply_policy,
    apply_threads,
    auto_threads,
    busy_between,
    cgroup_cpu_limit,
    cpu_times,
    resolve_threads,
    run_processes,
    thread_info,
    threads_in_use,
    usable_cores,
)
from tests.conftest import cli
from tests.test_contract import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_threads(monkeypatch):
    """Every test leaves torch's thread count as it found it, and sees no OMP_NUM_THREADS of the caller."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def write_config(path: Path, rounds: int = 1) -> Path:
    path.write_text(yaml.safe_dump(tiny_config("fedavg", rounds=rounds)))
    return path


def recorded_threads(out: Path) -> int:
    return int(json.loads((out / "summary.json").read_text())["provenance"]["machine"]["threads"])


# ---------------------------------------------------------------------------- the policy's arithmetic
def test_the_free_cores_are_shared_among_the_processes_at_least_one_each():
    assert auto_threads(1, cores=8, busy=0.0) == 8
    assert auto_threads(run_processes(3), cores=8, busy=0.0) == 2  # main + 3 workers
    assert auto_threads(3, cores=8, busy=0.0) == 2  # a sweep's 3 jobs
    assert auto_threads(1, cores=8, busy=6.2) == 2  # 1.8 free cores round to 2
    assert auto_threads(1, cores=2, busy=2.0) == 1  # the case: 2 cores, both busy
    assert auto_threads(1, cores=2, busy=9.0) == 1  # more load than cores
    assert auto_threads(10_000, cores=8, busy=0.0) == 1
    assert auto_threads(0, cores=4, busy=0.0) == 4  # no processes is one


def test_processes_count_workers_only_beyond_the_in_process_one_and_flower_nodes():
    assert run_processes(1) == 1 and run_processes(4) == 5
    assert engine_processes(EngineSection(workers=3)) == 4
    assert engine_processes(EngineSection(runtime="flower-deployment", nodes=3)) == 4
    assert EngineSection(threads="auto").threads == 0 == EngineSection().threads  # auto is spelled 0 too


def test_a_cgroup_quota_caps_the_affinity(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(v2) == 1.5
    assert usable_cores(affinity=8, root=v2) == 1  # half a core is not a thread's worth
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2) is None and usable_cores(affinity=8, root=v2) == 8
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(affinity=16, root=v1) == 4
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
    assert usable_cores(affinity=2, quota=0.2) == 1
    assert cgroup_cpu_limit(tmp_path / "missing") is None


def test_busy_cores_come_from_two_samples_of_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    before = cpu_times(stat)
    assert before == (150, 1000)
    assert busy_between(before, (250, 1200), cpus=2) == 1.0  # half the jiffies busy on 2 CPUs
    assert busy_between(before, before, cpus=2) == 0.0  # no time passed: nothing known busy


def test_an_explicit_count_wins_then_omp_num_threads_then_the_machine(monkeypatch):
    assert resolve_threads(3, processes=8) == (3, "explicit")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert resolve_threads(0, processes=1) == (5, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: ignored
    monkeypatch.setattr("fedskew.threads.busy_cores", lambda *a: 0.0)
    assert resolve_threads(0, processes=1) == (usable_cores(), "auto")


def test_applying_sets_torch_and_is_recorded():
    assert apply_policy(1, processes=1) == 1 == threads_in_use()
    info = thread_info()
    assert info["threads"] == 1 and info["threads_source"] == "explicit" and info["usable_cores"] >= 1
    assert apply_policy(2, processes=1) == 2 == torch.get_num_threads()
    with pytest.raises(ValueError, match="at least 1"):
        apply_threads(0)


# ---------------------------------------------------------------------------- the commands apply it
@pytest.mark.slow
def test_run_applies_threads_and_a_resume_under_another_count_is_accepted(tmp_path, monkeypatch, capsys):
    """A run with --threads 2 records 2; extended by --resume with --threads 1 it is accepted and records 1
    (thread counts are runtime-only); a changed result-deciding key is still refused."""
    config, out = write_config(tmp_path / "tiny.yaml"), tmp_path / "run"
    code, _, err = cli(["run", str(config), "--out", str(out), "--threads", "2"], monkeypatch, capsys)
    assert code == 0, err
    assert (
        recorded_threads(out) == 2
        and yaml.safe_load((out / "config.yaml").read_text())["engine"]["threads"] == 2
    )
    args = ["run", str(config), "--out", str(out), "--resume", "--rounds", "2", "--threads", "1"]
    code, _, err = cli(args, monkeypatch, capsys)
    assert code == 0, err
    assert recorded_threads(out) == 1 and torch.get_num_threads() == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2
    code, _, err = cli([*args, "--set", "client.lr=0.5"], monkeypatch, capsys)
    assert code == 2 and "client.lr" in err and len(err.strip().splitlines()) == 1


def test_thread_counts_are_runtime_only_but_workers_still_compare():
    a = {"seed": 0, "engine": {"threads": 1, "workers": 1}, "name": "a"}
    b = {"seed": 0, "engine": {"threads": 8, "workers": 1}, "name": "b"}
    assert results_config(a) == results_config(b)
    assert results_config(a) != results_config({**b, "engine": {"threads": 8, "workers": 2}})


@pytest.mark.slow
def test_demo_and_sweep_apply_their_threads(tmp_path, monkeypatch, capsys):
    code, _, err = cli(
        ["demo", "--rounds", "1", "--out", str(tmp_path / "demo"), "--threads", "1"], monkeypatch, capsys
    )
    assert code == 0, err
    assert {recorded_threads(tmp_path / "demo" / n) for n in ("fedavg", "fedprox", "local")} == {1}
    config = write_config(tmp_path / "tiny.yaml")
    torch.set_num_threads(2)
    code, _, err = cli(
        ["sweep", str(config), "--out", str(tmp_path / "sw"), "--threads", "1"], monkeypatch, capsys
    )
    assert code == 0, err
    (summary,) = (tmp_path / "sw").rglob("summary.json")
    assert recorded_threads(summary.parent) == 1
    assert torch.get_num_threads() == 2  # an in-process sweep gives the caller its threads back


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "CONFIG", "--threads", "-1"],
        ["run", "CONFIG", "--set", "engine.threads=-3"],
        ["demo", "--threads", "-2"],
        ["sweep", "CONFIG", "--out", "OUT", "--threads", "-1"],
        ["run", "CONFIG", "--threads", "many"],
        ["run", "CONFIG", "--set", "engine.threads=many"],
    ],
)
def test_a_bad_thread_count_is_one_line_and_exit_2_before_anything_runs(argv, tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path / "tiny.yaml")
    argv = [{"CONFIG": str(config), "OUT": str(tmp_path / "out")}.get(a, a) for a in argv]
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(argv, monkeypatch, capsys)
    assert code == 2
    assert "threads" in err
    if "many" not in argv:  # click's own usage message has its own layout
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
        assert "allowed" in err or "greater than or equal to 0" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- Flower's own log
def test_flwr_logs_go_to_the_file_not_the_console_and_the_logger_is_restored(tmp_path, capsys):
    from fedskew.flower.logs import append_process_logs, flower_log

    logger = logging.getLogger("flwr")
    before = (list(logger.handlers), logger.propagate)
    path = tmp_path / "run" / "flower.log"
    with flower_log(path):
        logger.info("Using SuperLink: local [127.0.0.1]")
        logging.getLogger("flwr.server").warning("a child logger's warning")
        assert not path.exists()  # the run folder stays empty until the run has checked it
    out, err = capsys.readouterr()
    assert "SuperLink" not in out + err and "child logger" not in out + err
    text = path.read_text()
    assert "INFO flwr: Using SuperLink: local [127.0.0.1]" in text and "a child logger's warning" in text
    assert (list(logger.handlers), logger.propagate) == before
    (tmp_path / "superlink.log").write_text("\x1b[92mINFO \x1b[0m: Starting Flower SuperLink\n")
    append_process_logs([("superlink", tmp_path / "superlink.log"), ("gone", tmp_path / "no.log")], path)
    assert "==== superlink (superlink.log) ====\nINFO : Starting Flower SuperLink\n" in path.read_text()
    assert "gone" not in path.read_text()


@pytest.mark.slow
def test_a_flower_deployment_keeps_flowers_log_in_the_run_folder_and_off_the_console(tmp_path):
    pytest.importorskip("flwr")
    out = tmp_path / "flower"
    config = "configs/fedavg/digits-flower.yaml"
    args = ["run", config, "--set", "rounds=1", "--threads", "1", "--out", str(out)]

    res = subprocess.run(
        [sys.executable, "-m", "fedskew", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    console = res.stdout + res.stderr
    assert "INFO" not in console and "Using SuperLink" not in console
    assert f"Flower's own log: {out / 'flower.log'}" in console.replace("\n", "")
    log = (out / "flower.log").read_text()
    assert "==== superlink" in log and "==== supernode-0" in log and "INFO" in log
    assert "Starting Flower SuperLink" in log


@pytest.mark.slow
def test_a_resume_under_auto_keeps_the_threads_the_run_started_with(tmp_path):
    """The automatic count depends on the load when a process starts; a resume re-deciding it would train
    the remaining rounds with other reduction bits than the uninterrupted run. Under auto it takes the count
    the checkpoint's provenance recorded; an explicit count still wins."""
    from fedskew.experiment.config import build_config
    from fedskew.experiment.runner import run_experiment

    raw = tiny_config("fedavg")
    first = build_config(raw, ["rounds=1"])
    try:
        apply_threads(1)
        run_experiment(first, tmp_path / "r")
        apply_threads(2)  # the resuming process started on a quieter machine
        summary = run_experiment(build_config(raw, ["rounds=2"]), tmp_path / "r", resume=True)
        assert torch.get_num_threads() == 1 and summary["provenance"]["machine"]["threads"] == 1
        apply_threads(2)
        pinned = build_config(raw, ["rounds=3", "engine.threads=2"])
        summary = run_experiment(pinned, tmp_path / "r", resume=True)
        assert torch.get_num_threads() == 2 and summary["provenance"]["machine"]["threads"] == 2
    finally:
        apply_threads(1)
