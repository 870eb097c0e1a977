"""A node's index bound to its Flower node for the run (issue 51, item 1), through the real ServerApp path
(tests/flower_loopback.py runs the real ClientApp per node): with the deployment's binding of indexes to
authenticated node ids, a node outside it is never asked anything and a bound node claiming another index is
refused; without it, the first node to claim an index holds it and a second one claiming it is refused.
Either way the impostor's claim is one logged line naming it, no client of the held index is sent to it, and
the run's metrics are those of the honest federation. A reply whose sender is not the node asked is
refused, and a malformed binding is one line (exit 2 through the CLI's error mapping)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flwr.app import Message, RecordDict

from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.config import build_config
from fedskew.flower.apps import run_config_jobs
from fedskew.flower.identity import format_node_ids, parse_node_ids
from fedskew.flower.server import serve
from tests.flower_loopback import LoopbackGrid
from tests.test_flower import assert_same_metrics, flower_config, on_flower, records

BOUND = {0: 100, 1: 101, 2: 102}  # LoopbackGrid(3): node index i has Flower node id 100 + i
IMPOSTOR = 999


def _cfg(rounds: int = 2, **engine: object):
    raw = flower_config("fedavg", rounds=rounds, **engine)
    return build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-simulation"}})


def _sent_to(grid: LoopbackGrid) -> dict[int, list[str]]:
    """Per destination node id, the types of the messages the server pushed."""
    sent: dict[int, list[str]] = {}
    for m in grid.pushed:
        sent.setdefault(m.metadata.dst_node_id, []).append(m.metadata.message_type)
    return sent


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("honest")
    serve(LoopbackGrid(3), _cfg(), out, resume=False, force=False)
    return records(out)


def test_a_node_outside_the_binding_is_never_asked_and_the_run_is_the_honest_one(honest, tmp_path, caplog):
    grid = LoopbackGrid(3)
    grid.add_node(IMPOSTOR, 0)  # registered with the SuperLink, but not the key of node index 0
    with caplog.at_level(logging.WARNING, logger="fedskew.flower"):
        serve(grid, _cfg(), tmp_path, resume=False, force=False, node_ids=BOUND)
    assert IMPOSTOR not in _sent_to(grid)  # not even asked for its index
    assert_same_metrics(records(tmp_path), honest)
    lines = [r.getMessage() for r in caplog.records if str(IMPOSTOR) in r.getMessage()]
    assert lines == [
        f"Flower node {IMPOSTOR} is not bound to any node index (run config 'node-ids'): ignored"
    ]


def test_a_bound_node_claiming_another_index_is_refused_with_one_line_naming_it(tmp_path):
    grid = LoopbackGrid(3)
    grid.contexts[102].node_config["partition-id"] = 0  # the key of index 2 says it is node 0
    with pytest.raises(FedskewError) as err:
        serve(grid, _cfg(round_timeout=0.5), tmp_path, resume=False, force=False, node_ids=BOUND)
    assert "\n" not in str(err.value)
    assert "Flower nodes [2] did not connect" in str(err.value)
    assert "Flower node 102 is bound to node index 2 but claims node index 0: refused" in str(err.value)


def test_without_a_binding_a_second_node_claiming_a_held_index_is_refused(honest, tmp_path, caplog):
    grid = LoopbackGrid(3)
    grid.add_node(IMPOSTOR, 1)  # joins later and claims node 1's clients while node 1 is online
    with caplog.at_level(logging.WARNING, logger="fedskew.flower"):
        serve(grid, _cfg(), tmp_path, resume=False, force=False)
    assert set(_sent_to(grid)[IMPOSTOR]) == {"query"}  # asked for its index, never given a client
    assert_same_metrics(records(tmp_path), honest)
    lines = {r.getMessage() for r in caplog.records if str(IMPOSTOR) in r.getMessage()}
    assert lines == {f"Flower node {IMPOSTOR} claims node index 1, held by Flower node 101: refused"}


def test_a_node_claiming_an_index_outside_the_federation_is_refused(tmp_path, caplog):
    grid = LoopbackGrid(3)
    grid.add_node(IMPOSTOR, 7)
    with caplog.at_level(logging.WARNING, logger="fedskew.flower"):
        on_flower(flower_config("fedavg", rounds=1), tmp_path, grid)
    assert any(f"Flower node {IMPOSTOR} claims node index 7 (allowed: 0..2)" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_reply_from_another_node_than_the_one_asked_is_refused(tmp_path, caplog):
    """Node 2's train replies arrive claiming to come from node 0: refused, so node 2's clients are dropped
    (no reply) in every round, and node 0's own reply still counts once."""
    grid = LoopbackGrid(3)

    def forged(reply: Message) -> Message:
        if reply.metadata.message_type == "train":
            reply.metadata.__dict__["_src_node_id"] = 100
        return reply

    grid.faults[2] = forged
    with caplog.at_level(logging.WARNING, logger="fedskew.flower"):
        raw = flower_config("fedavg", rounds=2, round_timeout=0.3)
        raw["client"]["fraction"] = 1.0
        recs = on_flower(raw, tmp_path, grid)
    assert [r["dropped"] for r in recs] == [[2, 5], [2, 5]]  # clients c with c % 3 == 2
    assert any("a reply to Flower node 102's message came from Flower node 100: refused" in r.getMessage()
               for r in caplog.records)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0:1,1", "entry '1' is not 'index:node_id'"),
        ("0:1,0:2,2:3", "repeats an index or node id"),
        ("0:5,1:5,2:6", "repeats an index or node id"),
        ("a:1", "entry 'a:1' is not 'index:node_id'"),
        ("0:-4", "entry '0:-4' is not"),
        ("0:1,1:2", "binds node indexes [0, 1]; engine.nodes=3 needs exactly 0..2"),
        ("0:1,1:2,5:3", "binds node indexes [0, 1, 5]"),
    ],
)
def test_a_malformed_binding_is_one_line(text, problem, tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_node_ids(text, 3)
    assert problem in str(err.value) and "\n" not in str(err.value)
    if problem.startswith("binds"):  # the ServerApp checks the indexes against engine.nodes
        with pytest.raises(ConfigError, match="engine.nodes=3"):
            serve(LoopbackGrid(3), _cfg(), tmp_path, False, False, node_ids=parse_node_ids(text))
    else:  # the run config is refused before any experiment starts
        with pytest.raises(ConfigError, match="run config 'node-ids'"):
            run_config_jobs({"config": "a.yaml", "out": "o", "node-ids": text})


def test_the_binding_round_trips_through_the_run_config():
    bound = {2: 7_000_000_000_123, 0: 5, 1: 6}
    assert parse_node_ids(format_node_ids(bound), 3) == bound
    assert parse_node_ids("") == {}


def test_flower_app_folders_and_the_generic_app_declare_the_binding(tmp_path: Path):
    from fedskew.flower.app_folder import write_app
    from fedskew.flower.deploy import APP_DIR

    assert 'node-ids = ""' in (APP_DIR / "pyproject.toml").read_text()
    write_app(tmp_path / "app", _cfg(), "runs/x", "x")
    assert 'node-ids = ""' in (tmp_path / "app" / "pyproject.toml").read_text()
    assert "node-ids=" in (tmp_path / "app" / "README.md").read_text()


def test_an_index_answer_without_a_node_record_is_refused_with_one_line(honest, tmp_path, caplog):
    """A joining node answers the index query with an array record named ``node``: one line, no
    traceback, and the run is the honest one."""
    from flwr.app import ArrayRecord

    grid = LoopbackGrid(3)
    grid.add_node(IMPOSTOR, 1)

    def odd(reply: Message) -> Message:
        if reply.metadata.message_type == "query" and reply.metadata.src_node_id == IMPOSTOR:
            return Message(RecordDict({"node": ArrayRecord()}), reply_to=_request(reply))
        return reply

    grid.faults[1] = odd
    with caplog.at_level(logging.WARNING, logger="fedskew.flower"):
        serve(grid, _cfg(), tmp_path, resume=False, force=False)
    assert_same_metrics(records(tmp_path), honest)
    assert any(f"Flower node {IMPOSTOR} answered the index query without a node record" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def _request(reply: Message) -> Message:
    """A stand-in for the request ``reply`` answers (what ``Message(..., reply_to=)`` reads of it)."""
    request = Message(RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="query")
    request.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
    return request


def test_a_bound_node_set_right_after_a_refusal_is_bound_on_the_next_refresh():
    from fedskew.flower.identity import NodeMap

    grid = LoopbackGrid(3)
    grid.contexts[102].node_config["partition-id"] = 0
    nodes = NodeMap(grid, 3, 0.5, dict(BOUND))
    nodes.refresh()
    assert nodes.node_of(2) is None and 102 in nodes.refused
    grid.contexts[102].node_config["partition-id"] = 2  # its operator fixes the node config
    nodes.refresh()
    assert nodes.node_of(2) == 102 and 102 not in nodes.refused


def test_without_a_binding_an_index_moving_to_a_new_node_is_logged_and_the_old_holder_is_refused(caplog):
    from fedskew.flower.identity import NodeMap

    grid = LoopbackGrid(3)
    nodes = NodeMap(grid, 3, 0.5)
    nodes.refresh()
    grid.remove_node(101)  # node 1 goes offline; another node claims its index
    grid.add_node(IMPOSTOR, 1)
    with caplog.at_level(logging.WARNING, logger="fedskew.flower"):
        nodes.refresh()
        grid.add_node(101, 1)  # the old holder comes back with its old id
        nodes.refresh()
    assert nodes.node_of(1) == IMPOSTOR
    lines = [r.getMessage() for r in caplog.records]
    assert f"node index 1 moves from Flower node 101 (offline) to Flower node {IMPOSTOR}" in lines
    assert f"Flower node 101 claims node index 1, held by Flower node {IMPOSTOR}: refused" in lines
