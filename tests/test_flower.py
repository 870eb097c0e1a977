"""fedskew's Flower apps, in process: every registered algorithm through the ServerApp and ClientApp code
with messages round-tripped through Flower's wire format (tests/flower_loopback.py) gives the embedded
engine's metrics; node state versions; dropped nodes, error and NaN replies; a server crash resumed from its
checkpoint while the nodes kept newer states. The real runtimes (Ray simulation, SuperLink + SuperNode
processes) are in tests/test_flower_runtime.py."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import Payload
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from fedskew.flower import require_flwr
from fedskew.flower.node import load_version, prune, store_version
from fedskew.flower.records import get_payload, put_payload, state_from_bytes, state_to_bytes
from fedskew.flower.server import serve
from fedskew.flower.versions import ContextVersions, DiskVersions, versions_of
from tests.flower_loopback import LoopbackGrid
from tests.test_contract import HETERO_PARAMS, NAMES, tiny_config

TIMING = ("seconds",)


def flower_config(name: str, rounds: int = 2, **engine: Any) -> dict[str, Any]:
    """The contract suite's tiny digits federation on 3 nodes (6 clients: 2 per node)."""
    cfg = tiny_config(name, rounds=rounds)
    cfg["engine"].update(nodes=3, **engine)
    if ALGORITHMS.get(name).heterogeneous_models:
        cfg["model"]["per_client"] = {"0-2": {"hidden": 24}}
        cfg["algorithm"].update(HETERO_PARAMS.get(name, {}))
    return cfg


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert set(ra) == set(rb)
        for k, va in ra.items():
            if k.startswith(TIMING):
                continue
            vb = rb[k]
            if isinstance(va, float) or isinstance(vb, float):
                assert va == pytest.approx(vb, abs=tol, rel=tol), k
            elif isinstance(va, list):
                assert va == pytest.approx(vb, abs=tol), k
            else:
                assert va == vb, k


def embedded(raw: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    raw = {**raw, "engine": {**raw["engine"], "runtime": "embedded"}}
    run_experiment(build_config(raw), out)
    return records(out)


def on_flower(
    raw: dict[str, Any], out: Path, grid: LoopbackGrid, resume: bool = False
) -> list[dict[str, Any]]:
    cfg = build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-simulation"}})
    serve(grid, cfg, out, resume=resume, force=False)
    return records(out)


#: the edit loop checks these two (homogeneous and heterogeneous models); the others are marked slow
FAST = {"fedavg", "fedproto"}


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_every_algorithm_gives_the_embedded_metrics_through_the_flower_apps(name, tmp_path):
    raw = flower_config(name)
    assert_same_metrics(on_flower(raw, tmp_path / "f", LoopbackGrid(3)), embedded(raw, tmp_path / "e"))


def test_the_rounds_log_gives_wire_bytes_beside_the_accounted_payload_bytes_and_node_timings(tmp_path):
    """``flower_rounds.jsonl``: per round, uploads (all distinct) cost their accounted bytes plus a bounded
    overhead (headers: about 470 bytes per array); the broadcast costs at most its accounted bytes plus the
    config text per message (Flower stores identical arrays once per message); the slowest node's timings
    are ordered: process age >= handler time >= runtime build time >= 0."""
    raw = flower_config("fedavg", rounds=2)
    recs = on_flower(raw, tmp_path / "f", LoopbackGrid(3))
    rows = [json.loads(x) for x in (tmp_path / "f" / "flower_rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    config_text = len((tmp_path / "f" / "config.yaml").read_text())
    for row, rec in zip(rows, recs, strict=True):
        m = row["messages"]
        assert row["replies"] == m and 1 <= m <= 3  # one message per node holding sampled clients
        assert config_text < row["wire_bytes_down"] < rec["round_bytes_down"] + m * (config_text + 4096)
        assert rec["round_bytes_up"] < row["wire_bytes_up"] < 1.5 * rec["round_bytes_up"] + m * 4096
        assert row["node_seconds_process"] >= row["node_seconds_handler"] >= row["node_seconds_build"] >= 0


def test_wire_bytes_count_identical_arrays_of_a_message_once():
    from flwr.app import ConfigRecord

    from fedskew.flower.server import wire_bytes

    LoopbackGrid(1)  # sets the run identity Flower's messages need
    arrays = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    one, two = RecordDict(), RecordDict()
    put_payload(one, "p.0", Payload(arrays=arrays))
    for cid in (0, 1):
        put_payload(two, f"p.{cid}", Payload(arrays=arrays))
    size = Payload(arrays=arrays).nbytes()
    w1 = wire_bytes(Message(one, dst_node_id=1, message_type="train"))
    w2 = wire_bytes(Message(two, dst_node_id=1, message_type="train"))
    assert size < w1 < size + 2048 and w1 < w2 < w1 + 1024  # the second copy costs only its references
    other = RecordDict({"p.0.a": ArrayRecord({"w": torch.randn(64, 64), "b": torch.randn(64)})})
    other["x"] = ConfigRecord({"k": 1})
    assert wire_bytes(Message(other, dst_node_id=1, message_type="train")) > size


def test_payload_records_and_states_round_trip():
    p = Payload(
        arrays={
            "model.w": torch.randn(3, 4),
            "ids": torch.tensor([2, 5]),
            "mask": torch.tensor([True, False]),
        },
        config={"tau": 3.0},
        metrics={"norm": 1.5},
    )
    rd = RecordDict()
    put_payload(rd, "p.7", p)
    q = get_payload(rd, "p.7")
    assert q.config == p.config and q.metrics == p.metrics
    assert all(torch.equal(q.arrays[k], v) and q.arrays[k].dtype == v.dtype for k, v in p.arrays.items())
    state = {"c": {"w": torch.ones(2)}, "eta": 0.5, "count": 3}
    back = state_from_bytes(state_to_bytes(state))
    assert torch.equal(back["c"]["w"], torch.ones(2)) and back["eta"] == 0.5 and back["count"] == 3


class _Node:
    """What load_version needs of a node runtime: initial states."""

    class rt:  # noqa: N801
        @staticmethod
        def initial_state(cid: int) -> dict[str, Any]:
            return {"v": torch.tensor(0.0)}


@pytest.mark.parametrize("where", ["context", "disk"])
def test_node_keeps_state_versions_until_no_resume_can_name_them(where, tmp_path):
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    store = ContextVersions(ctx) if where == "context" else DiskVersions(tmp_path / "exp")
    for r in (1, 3, 4):
        store_version(store, 2, r, {"v": torch.tensor(float(r))})
    assert float(load_version(_Node, store, 2, 3)["v"]) == 3.0
    assert float(load_version(_Node, store, 2, 0)["v"]) == 0.0  # version 0: the initial state
    # a round-5 message references version 4 while the last checkpoint is round 4: versions 1 and 3 go
    prune(store, 2, referenced=4, keep_from=4)
    assert float(load_version(_Node, store, 2, 4)["v"]) == 4.0
    assert float(load_version(_Node, store, 2, 3)["v"]) == 0.0  # gone: re-initialised, with a warning
    # a reference newer than the last checkpoint keeps everything from the checkpoint's version on
    store_version(store, 2, 6, {"v": torch.tensor(6.0)})
    prune(store, 2, referenced=6, keep_from=5)
    assert float(load_version(_Node, store, 2, 4)["v"]) == 4.0


def test_a_node_state_dir_keeps_versions_across_flower_runs_per_experiment(tmp_path):
    """Flower gives a new Context per run (a resumed experiment is a new run): with a ``state-dir`` the
    versions are found again, and another experiment on the same node does not see them."""
    config = {"state-dir": str(tmp_path / "states")}
    first, second = (
        Context(run_id=run, node_id=5, node_config=config, state=RecordDict(), run_config={})
        for run in (1, 2)
    )
    store_version(versions_of(first, "exp-a"), 2, 3, {"v": torch.tensor(3.0)})
    assert float(load_version(_Node, versions_of(second, "exp-a"), 2, 3)["v"]) == 3.0
    assert float(load_version(_Node, versions_of(second, "exp-b"), 2, 3)["v"]) == 0.0  # not that one's
    bare = Context(run_id=2, node_id=5, node_config={}, state=RecordDict(), run_config={})
    assert isinstance(versions_of(bare, "exp-a"), ContextVersions)


def test_a_dead_node_is_dropped_for_the_round_and_rejoins_after_a_restart(tmp_path):
    grid = LoopbackGrid(3)
    raw = flower_config("fedavg", rounds=3, round_timeout=0.2)
    raw["client"]["fraction"] = 1.0
    original = grid.push_messages

    def push(messages):
        messages = list(messages)
        r = int(messages[0].content["job"]["round"]) if "job" in messages[0].content else 0
        if r == 2 and 101 in grid.contexts:  # node 1 dies with round 2's message on its way ...
            grid.remove_node(101)
            grid.add_node(201, 1)  # ... and restarts: a new Flower node id, an empty Context
        return original(messages)

    grid.push_messages = push  # type: ignore[method-assign]
    recs = on_flower(raw, tmp_path / "f", grid)
    assert "dropped" not in recs[0] and "dropped" not in recs[2]
    assert recs[1]["dropped"] == [1, 4]  # clients c with c % 3 == 1
    assert recs[1]["rejected"] == 0
    assert recs[2]["round_bytes_up"] == recs[0]["round_bytes_up"]  # every client uploads again
    assert all(math.isfinite(r["accuracy"]) for r in recs)


def _nan_upload(reply: Message) -> Message:
    content = reply.content
    for key in [k for k in content if k.startswith("u.") and k.endswith(".a")]:
        arrays = content[key].to_torch_state_dict()
        content[key] = ArrayRecord({k: torch.full_like(v, float("nan")) for k, v in arrays.items()})
    return reply


def test_error_replies_follow_on_client_error_and_non_finite_uploads_are_rejected(tmp_path):
    """A failing ClientApp is a client that raises: by default the round is not committed and the run stops
    (resumable), as in the embedded engine; under ``drop`` its clients are rejected. NaN uploads are
    rejected under both."""
    from fedskew.engine.policy import ClientError

    raw = flower_config("fedavg", rounds=1)
    raw["client"]["fraction"] = 1.0
    clean = on_flower(raw, tmp_path / "c", LoopbackGrid(3))
    grid = LoopbackGrid(3)
    grid.raising.add(0)  # node 0's ClientApp fails: Flower replies with an error
    grid.faults[2] = _nan_upload  # node 2 uploads NaN
    with pytest.raises(ClientError, match=r"round 1: clients \[0, 3\] failed on their node"):
        on_flower(raw, tmp_path / "f", grid)
    assert not (tmp_path / "f" / "metrics.jsonl").exists() or not records(tmp_path / "f")
    raw["engine"]["on_client_error"] = "drop"
    recs = on_flower(raw, tmp_path / "d", grid)
    assert recs[0]["rejected"] == 4 and "dropped" not in recs[0]  # clients 0, 3 and 2, 5
    assert recs[0]["round_bytes_up"] * 3 == clean[0]["round_bytes_up"]  # node 1's two uploads only


def test_a_node_flower_reports_unavailable_is_dropped_not_rejected(tmp_path):
    """Flower answers a message whose node stopped sending heartbeats with a NODE_UNAVAILABLE error: the
    node's clients are lost for the round (dropped), not failed."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    raw = flower_config("fedavg", rounds=1)
    raw["client"]["fraction"] = 1.0
    grid = LoopbackGrid(3)

    def unavailable(reply: Message) -> Message:
        if reply.metadata.message_type != "train":  # the node answered the server's index query
            return reply
        lost = Message(Error(ErrorCode.NODE_UNAVAILABLE, "no heartbeat"), reply_to=reply)
        lost.metadata.__dict__["_reply_to_message_id"] = reply.metadata.reply_to_message_id
        return lost

    grid.faults[1] = unavailable
    recs = on_flower(raw, tmp_path / "f", grid)
    assert recs[0]["dropped"] == [1, 4] and recs[0]["rejected"] == 0


class ServerKilled(BaseException):
    """The ServerApp process dies (not an Exception: nothing may catch it on the way)."""


@pytest.mark.parametrize("name", ["fedper", "scaffold"])
def test_a_crashed_server_resumes_from_its_checkpoint_while_nodes_kept_newer_states(name, tmp_path):
    raw = flower_config(name, rounds=4)
    raw["checkpoint"] = {"every": 2}
    reference = embedded(raw, tmp_path / "e")
    out, grid = tmp_path / "f", LoopbackGrid(3)
    saved = tmp_path / "checkpoint-round-2.pt"
    original = grid.pull_messages

    def pull(ids):
        if (
            (out / "metrics.jsonl").exists() and len(records(out)) == 3 and not saved.exists()
        ):  # rounds 1-3 committed: round 4 is running
            shutil.copy(out / "checkpoint.pt", saved)  # the periodic checkpoint of round 2
            raise ServerKilled  # the server dies while round 4's replies come in
        return original(ids)

    grid.pull_messages = pull  # type: ignore[method-assign]
    with pytest.raises(ServerKilled):
        on_flower(raw, out, grid)
    shutil.copy(saved, out / "checkpoint.pt")  # a hard kill leaves the last periodic checkpoint only
    grid.pull_messages = original  # type: ignore[method-assign]
    assert_same_metrics(on_flower(raw, out, grid, resume=True), reference)


def test_flower_runtimes_need_flwr_and_the_flower_launcher(monkeypatch):
    cfg = build_config({**flower_config("fedavg"), "engine": {"runtime": "flower-deployment"}})
    with pytest.raises(ConfigError, match="fedskew.flower.run_flower"):
        run_experiment(cfg, None)
    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(ConfigError, match=r"fedskew\[flower\]"):
        require_flwr()
