"""fedskew on a real Flower deployment: one SuperLink serving over TLS with SuperNode authentication and 3
authenticated SuperNodes, Flower's own processes on loopback (ports chosen free at run time, every process
reaped at the end, also when a test fails). On it: the embedded engine's metrics within 1e-5 (FedAvg, and
FedProto with heterogeneous models whose personal state lives on the nodes), an unregistered node refused,
a SuperNode SIGKILLed mid-round (its clients dropped for that round; restarted, it serves again) and a
ServerApp SIGKILLed mid-run and resumed with ``resume=true`` from its checkpoint (SCAFFOLD: the clients'
control variates come back from the nodes' state folders), silos each serving their own image folder to a
ServerApp without data, and the app folder ``fedskew flower-app`` writes run with ``flwr run``.

In ``make test`` (and so in CI). The tests share the deployment: tests/conftest.py collects this file
first, so that ``pytest -n 2`` sends all of them to the first worker in its first chunk (a second worker
would start a deployment of its own); that worker mostly waits on Flower's processes while the other runs
the rest of the suite."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr")

from fedskew.errors import FedskewError
from fedskew.experiment.config import build_config, load_config
from fedskew.experiment.runner import run_experiment
from fedskew.flower import deploy
from fedskew.flower.apps import Job
from fedskew.flower.deploy import LocalDeployment, deployment_pids
from tests.barrier_run import arrived, barrier_app, barrier_spec, release
from tests.flower_keys import write_node_key, write_tls
from tests.silo_folders import write_silos
from tests.test_flower import assert_same_metrics, embedded, flower_config, records
from tests.test_flower_app_folder import DIGITS
from tests.test_flower_app_folder import fedskew as fedskew_cli
from tests.test_flower_silos import silo_config

pytestmark = [pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 600.0  # seconds any one Flower run of these tests may take


class Federation:
    """The shared deployment, the key of a node that was never registered, and the nodes' own image
    folders."""

    def __init__(self, dep: LocalDeployment, intruder_key: Path, silos: list[Path]) -> None:
        self.dep, self.intruder_key, self.silos = dep, intruder_key, silos


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    folder = tmp_path_factory.mktemp("federation")
    tls = write_tls(folder)
    keys = {i: write_node_key(folder, f"node{i}") for i in range(4)}
    registered = [keys[i].with_name(f"node{i}.pub") for i in range(3)]  # node key 3 is not registered
    # each node also has its own image folder (node-local data); the digits configs read no data root
    roots = write_silos(folder / "silos")
    own = {i: {"data-root": str(root)} for i, root in enumerate(roots)}
    with LocalDeployment(
        3, tls=tls, node_keys={i: keys[i] for i in range(3)}, registered=registered, node_config=own
    ) as dep:
        yield Federation(dep, keys[3], roots)


def _job(raw: dict, out: Path, resume: bool = False) -> Job:
    cfg = build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-deployment"}})
    return Job(cfg, out, resume)


def _lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(dep: LocalDeployment, run_id: int, reached: Callable[[], bool], what: str) -> None:
    """Block until ``reached()`` (the run must still be going: its status is asked every 2 s, since each ask
    costs the SuperLink an authenticated request); ``DEADLINE`` only catches a hang."""
    end, asked = time.monotonic() + DEADLINE, 0.0
    while not reached():
        if time.monotonic() - asked > 2.0:
            status, details = dep.status(run_id)
            assert not status.startswith("finished"), f"run {run_id} {status} before {what}: {details}"
            asked = time.monotonic()
        assert time.monotonic() < end, f"{what} not reached within {DEADLINE} s"
        time.sleep(0.1)


def _submit_with_barrier(
    dep: LocalDeployment, job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *specs: dict[str, Any]
) -> tuple[int, list[int]]:
    """Submit ``job`` as a Flower app whose processes stop at the barriers ``specs`` (tests/barrier_run.py);
    return the run id and the pids at the first barrier once one process is there."""
    app = barrier_app(tmp_path / "barrier-app", *specs)
    with monkeypatch.context() as m:
        m.setattr(deploy, "APP_DIR", app)
        run_id = dep.submit([job])
    events = Path(specs[0]["folder"])
    _wait_for(dep, run_id, lambda: bool(arrived(events)), f"the barrier of round {specs[0]['round']}")
    return run_id, arrived(events)


def _logins(dep: LocalDeployment, name: str) -> int:
    """How many times process ``name`` connected to the SuperLink: Flower logs the SuperNode ID once the
    SuperLink has activated the node (listed online from then on); the log is appended across restarts."""
    return dep.tail(name, 1_000_000).count("SuperNode ID")


def test_tls_authenticated_deployment_gives_the_embedded_metrics_and_refuses_an_unregistered_node(
    federation, tmp_path
):
    dep = federation.dep
    intruder = dep.start_node(0, name="intruder", key=federation.intruder_key)  # claims node 0's clients
    try:
        digits = load_config(ROOT / "configs/fedavg/digits-flower.yaml", ["rounds=2"])
        fedproto = _job(flower_config("fedproto", rounds=1), tmp_path / "fedproto")
        secure_raw = flower_config("fedavg", rounds=1)
        secure = _job({**secure_raw, "engine": {**secure_raw["engine"], "secagg": {}}}, tmp_path / "secure")
        summaries = dep.run([Job(digits, tmp_path / "digits"), fedproto, secure])
        refused = dep.tail("intruder", 400)
        assert intruder.poll() != 0  # still retrying (None) or given up (exit 1 or Flower's 305)
        assert "SuperNode ID" not in refused and "Connection attempt failed" in refused
        # each node authenticated as the node id its key was registered under, and the run bound its index
        # to that id (run config ``node-ids``: fedskew.flower.identity)
        assert sorted(dep.node_ids) == [0, 1, 2]
        assert all(f"SuperNode ID: {dep.node_ids[i]}" in dep.tail(f"supernode-{i}", 400) for i in range(3))
    finally:
        dep.kill("intruder", signal.SIGKILL)
    raw = digits.to_dict()
    local = build_config({**raw, "engine": {**raw["engine"], "runtime": "embedded"}})
    reference = run_experiment(local, tmp_path / "digits-embedded")
    got = summaries[0]
    assert got["final"] == pytest.approx(reference["final"], abs=1e-5)
    assert (got["bytes_up"], got["bytes_down"]) == (reference["bytes_up"], reference["bytes_down"])
    assert_same_metrics(records(tmp_path / "digits"), records(tmp_path / "digits-embedded"))
    fedproto_reference = embedded(flower_config("fedproto", 1), tmp_path / "e")
    assert_same_metrics(records(tmp_path / "fedproto"), fedproto_reference)
    # SecAgg+ between the three authenticated nodes: the plain metrics within its quantization
    # (tests/test_secagg.py)
    plain = embedded(secure_raw, tmp_path / "s")
    for got_round, want in zip(records(tmp_path / "secure"), plain, strict=True):
        assert got_round["loss"] == pytest.approx(want["loss"], abs=1e-4)
        assert got_round["accuracy"] == pytest.approx(want["accuracy"], abs=2 / 180 + 1e-9)


def test_silos_each_serving_its_own_folder_give_the_embedded_metrics_and_a_mismatched_node_fails_naming_it(
    federation, tmp_path
):
    """Each SuperNode reads only its own image folder (its node config's data-root, a different mix of the
    ten classes); the ServerApp's config names no data root, so every number comes from the nodes. FedAvg
    and Ditto (personal models kept and scored on the nodes) equal the embedded engine on the same folders
    joined. A config whose label space lacks a class node 1 holds fails before training, in one line."""
    dep, roots = federation.dep, federation.silos
    raws = [silo_config(roots, "fedavg"), silo_config(roots, "ditto")]
    raws[1]["eval"]["protocol"] = "personalized"

    def deployed(raw: dict) -> dict:  # what the ServerApp is given: no data roots at all
        return {**raw, "data": {**raw["data"], "nodes": {**raw["data"]["nodes"], "roots": []}}}

    dep.run([_job(deployed(raw), tmp_path / raw["algorithm"]["name"]) for raw in raws])
    for raw in raws:
        name = raw["algorithm"]["name"]
        assert_same_metrics(records(tmp_path / name), embedded(raw, tmp_path / f"{name}-embedded"))
    narrow = deployed(silo_config(roots))
    narrow["data"]["nodes"]["classes"] = [str(c) for c in range(9)]  # node 1 and node 2 hold a '9'
    with pytest.raises(FedskewError) as err:
        dep.run([_job(narrow, tmp_path / "narrow")])
    message = str(err.value)
    assert "\n" not in message and f"node 1 (data root {roots[1]}): classes ['9'] are not in" in message
    assert not (tmp_path / "narrow" / "metrics.jsonl").exists()


def test_a_supernode_killed_mid_round_loses_its_clients_for_the_round_and_serves_again_after_a_restart(
    federation, tmp_path, monkeypatch
):
    """Events, not round counts: node 1 (clients 1 and 4) waits with round 2's message at a barrier, where
    the kill lands; the server waits at round 3's first hook until the restarted node has connected again
    (its log's SuperNode ID line), so that no load on the machine can let round 3 start without it."""
    dep, out = federation.dep, tmp_path / "out"
    raw = flower_config("fedavg", rounds=3, round_timeout=120)
    raw["client"]["fraction"] = 1.0
    at_server = tmp_path / "server-barrier"
    run_id, _ = _submit_with_barrier(
        dep,
        _job(raw, out),
        tmp_path,
        monkeypatch,
        barrier_spec(2, tmp_path / "node-barrier", hook="start_local", cids=[1, 4], once=True),
        barrier_spec(3, at_server, hook="broadcast", release=True),
    )
    assert _lines(out) == 1
    logins = _logins(dep, "supernode-1")
    dep.kill("supernode-1", signal.SIGKILL)
    _wait_for(dep, run_id, lambda: bool(arrived(at_server)), "the server at round 3")
    assert _lines(out) == 2
    dep.start_node(1)  # same key, same Flower node id: it serves again once the SuperLink activated it
    _wait_for(dep, run_id, lambda: _logins(dep, "supernode-1") > logins, "node 1 connected again")
    release(at_server)
    dep.wait(run_id, timeout=DEADLINE)
    recs = records(out)
    assert "dropped" not in recs[0] and recs[1]["dropped"] == [1, 4] and recs[1]["rejected"] == 0
    assert "dropped" not in recs[2] and recs[2]["round_bytes_up"] == recs[0]["round_bytes_up"]


def _server_apps(dep: LocalDeployment) -> list[int]:
    pids = []
    for pid in deployment_pids(dep.home):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"flwr-serverapp" in cmdline:
            pids.append(pid)
    return pids


def test_a_server_app_killed_mid_run_resumes_from_its_checkpoint_with_the_clients_states(
    federation, tmp_path, monkeypatch
):
    dep, out = federation.dep, tmp_path / "out"
    raw = flower_config("scaffold", rounds=2)
    raw["checkpoint"] = {"every": 1}
    reference = embedded(raw, tmp_path / "e")
    # the ServerApp waits at round 2's aggregation: the nodes have trained round 2 from round 1's variates
    # (their new states are saved) and the checkpoint holds round 1
    barrier = barrier_spec(2, tmp_path / "barrier", hook="aggregate")
    run_id, (victim,) = _submit_with_barrier(dep, _job(raw, out), tmp_path, monkeypatch, barrier)
    assert victim in _server_apps(dep) and _lines(out) == 1
    os.kill(victim, signal.SIGKILL)
    dep.stop(run_id)  # what an operator does on a crash: the nodes drop the dead run's messages at once
    dep.run([_job(raw, out, resume=True)])  # a new Flower run; the nodes' state folders keep the variates
    assert_same_metrics(records(out), reference)
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2


def test_flwr_run_runs_the_written_app_with_the_embedded_metrics(federation, tmp_path):
    app, results = tmp_path / "app", tmp_path / "results"
    made = fedskew_cli(
        "flower-app", str(DIGITS), "--out", str(app), "--set", "rounds=1", "--results", str(results)
    )
    assert made.returncode == 0, made.stderr
    dep = federation.dep
    text = dep.flwr(["run", str(app), "local", "--format", "json"])  # the app exactly as written
    dep.wait(int(json.loads(text[text.index("{") :])["run-id"]), timeout=DEADLINE)
    reference = tmp_path / "embedded"
    run_experiment(load_config(DIGITS, ["rounds=1", "engine.runtime=embedded"]), reference)
    assert_same_metrics(records(results), records(reference))
    got, want = (json.loads((d / "summary.json").read_text()) for d in (results, reference))
    assert got["final"] == pytest.approx(want["final"], abs=1e-5)
    assert (got["bytes_up"], got["bytes_down"], got["rounds"]) == (want["bytes_up"], want["bytes_down"], 1)
