"""fedskew on Flower's real runtimes: the simulation runtime (Ray) and a loopback deployment (SuperLink and
SuperNode processes, ``flwr run``) give the embedded engine's metrics within 1e-5. Slow: Flower starts Ray,
or a ServerApp process and a ClientApp process per node and message. Ports are chosen free at run time and
every process group is reaped, also when a test fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from fedskew.experiment.config import build_config
from fedskew.flower.apps import Job
from fedskew.flower.launch import simulate
from tests.test_flower import assert_same_metrics, embedded, flower_config, records

pytestmark = [pytest.mark.slow, pytest.mark.flower_runtime]
ROOT = Path(__file__).resolve().parents[1]
#: FedAvg, SCAFFOLD, FedProto with heterogeneous models, FedPer, MP-FedCL, FedSKC, FedEnt
LISTED = ["fedavg", "scaffold", "fedproto", "fedper", "mpfedcl", "fedskc", "fedent"]


def _job(name: str, out: Path, runtime: str, rounds: int = 2) -> Job:
    raw = flower_config(name, rounds=rounds)
    raw["engine"]["runtime"] = runtime
    return Job(build_config(raw), out)


def test_simulation_runtime_gives_the_embedded_metrics(tmp_path):
    jobs = [_job(n, tmp_path / f"sim-{n}", "flower-simulation") for n in LISTED]
    simulate(jobs)  # one Ray start-up for all of them
    for name, job in zip(LISTED, jobs, strict=True):
        assert_same_metrics(
            records(Path(str(job.out))), embedded(flower_config(name), tmp_path / f"emb-{name}")
        )


def _fedskew_run(args: list[str], out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "fedskew",
        "run",
        "configs/fedavg/digits-flower.yaml",
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        assert proc.wait(timeout=900) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_flower_config_runs_a_loopback_deployment_with_the_embedded_summary(tmp_path):
    _fedskew_run(["--set", "rounds=2"], tmp_path / "flower")
    _fedskew_run(["--set", "rounds=2", "--set", "engine.runtime=embedded"], tmp_path / "embedded")
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("flower", "embedded"))
    assert a["final"] == pytest.approx(b["final"], abs=1e-5)
    assert (a["bytes_up"], a["bytes_down"], a["rounds"]) == (b["bytes_up"], b["bytes_down"], b["rounds"])
    assert_same_metrics(records(tmp_path / "flower"), records(tmp_path / "embedded"))


# TLS + authentication, node kills and a ServerApp resume on a deployment: tests/test_flower_deployment.py
