"""Secure aggregation with Flower's SecAgg+ (``engine.secagg``; issue 51, item 7) through the real ServerApp
and ClientApp code (tests/flower_loopback.py: every message round-trips Flower's wire format; Flower's own
``SecAggPlusWorkflow`` and ``secaggplus_mod`` run unchanged).

Tolerance: each node's update is quantized by SecAgg+ to 2^22 levels over [-8, 8] (stochastic rounding,
error < 2·8/2^22 ≈ 3.8e-6 per value and node) and its weight to 2^22 levels, so after one round the global
model differs from the plain run's by at most ≈ 3 nodes × 3.8e-6 ≈ 1.2e-5 per weight; the test loss of a
2-round digits run then moves by far less than 1e-4 and the accuracy by at most a sample or two.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Message
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from fedskew.errors import ConfigError, RunFailure
from fedskew.experiment.config import build_config
from fedskew.flower.secure import SECAGG_KEY, from_bytes
from tests.flower_loopback import LoopbackGrid
from tests.test_flower import flower_config, on_flower

QUANTIZED = 2**22  # Flower's quantization levels; masked values are uniform on [0, 2^32)


def _raw(name: str = "fedavg", rounds: int = 2, **secagg: Any) -> dict[str, Any]:
    raw = flower_config(name, rounds=rounds, round_timeout=0.3)
    raw["client"]["fraction"] = 1.0
    raw["engine"]["secagg"] = dict(secagg)
    return raw


def _plain(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "engine": {k: v for k, v in raw["engine"].items() if k != "secagg"}}


def _close(secure: list[dict], plain: list[dict]) -> None:
    assert len(secure) == len(plain)
    for s, p in zip(secure, plain, strict=True):
        assert s["loss"] == pytest.approx(p["loss"], abs=1e-4)
        assert abs(s["accuracy"] - p["accuracy"]) <= 2 / 180 + 1e-9  # two of the 180 test images
        assert s.get("dropped") == p.get("dropped")
        assert s["train_loss"] == pytest.approx(p["train_loss"], abs=1e-3)


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_secure_metrics_equal_the_plain_run_within_the_quantization(name, tmp_path, caplog):
    """FedAvg (n_k / n weights) and SCAFFOLD (uniform weights; uploads a model and a control delta)."""
    raw = _raw(name)
    with caplog.at_level(logging.INFO, logger="flwr"):
        secure = on_flower(raw, tmp_path / "s", LoopbackGrid(3))
    completed = [r for r in caplog.records if r.getMessage() == "Secure aggregation completed."]
    assert len(completed) == 2  # every round's mean came from Flower's SecAgg+ workflow
    plain = on_flower(_plain(raw), tmp_path / "p", LoopbackGrid(3))
    _close(secure, plain)


def _is_masked_stage(reply: Message) -> bool:
    return (
        RECORD_KEY_CONFIGS in reply.content.config_records
        and Key.MASKED_PARAMETERS in (reply.content.config_records[RECORD_KEY_CONFIGS])
    )


def test_the_server_sees_each_node_only_masked(tmp_path):
    """Every reply the ServerApp receives: no array of any upload (the receipts hold scalars only), and the
    masked update of each node spread over [0, 2^32) like uniform noise, while an unmasked quantized delta
    sits within a few steps of 2^21 (zero)."""
    grid = LoopbackGrid(3)
    on_flower(_raw(rounds=1), tmp_path, grid)
    seen = grid.pulled  # what reached the server, after the wire
    masked = [r for r in seen if r.has_content() and _is_masked_stage(r)]
    assert len(masked) == 3
    for reply in masked:
        content = reply.content
        assert all(len(rec) == 0 for rec in content.array_records.values())  # Flower's mod emptied them
        receipts = from_bytes(bytes(content.config_records["fitres.metrics"][SECAGG_KEY]))
        assert not any(isinstance(v, ArrayRecord) for v in receipts.values())
        vector = np.concatenate(
            [
                bytes_to_ndarray(b).ravel()
                for b in content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
            ]
        ).astype(np.float64)
        assert vector.size > 3_000
        near_zero = np.abs(vector - QUANTIZED / 2) < QUANTIZED / 64
        assert near_zero.mean() < 0.01  # an unmasked update would have ~all of them there
        # uniform on [0, 2^32): mean 1/2, sd 12^-1/2 (in units of 2^32); the bounds are ten standard errors
        assert abs(vector.mean() / 2**32 - 0.5) < 0.05 and abs(vector.std() / 2**32 - 12**-0.5) < 0.05
    assert all(not _is_masked_stage(r) for r in seen if r not in masked)


def _tamper(edit) -> Any:
    def fault(reply: Message) -> Message:
        if _is_masked_stage(reply):
            edit(reply.content)
        return reply

    return fault


def test_a_node_lying_about_its_weight_discards_the_round_with_one_line(tmp_path, caplog):
    grid = LoopbackGrid(3)

    def inflate(content):
        content.metric_records["fitres.num_examples"]["num_examples"] = 2**20

    grid.faults[1] = _tamper(inflate)
    with caplog.at_level(logging.WARNING, logger="fedskew.engine"):
        recs = on_flower(_raw(rounds=1), tmp_path, grid)
    assert recs[0]["rejected"] == 6  # every client: no upload can be taken out of a sum
    lines = [r.getMessage() for r in caplog.records if "secure aggregation" in r.getMessage()]
    assert len(lines) == 1 and "node 1 (Flower node 101): weight 1048576 / 2^20 is not the plan's" in lines[0]


def test_a_receipt_naming_a_foreign_client_discards_the_round_and_fail_stops_it(tmp_path):
    grid = LoopbackGrid(3)

    def foreign(content):
        receipts = from_bytes(bytes(content.config_records["fitres.metrics"][SECAGG_KEY]))
        job = receipts["job"]
        job["accepted"] = [0 if c == 1 else c for c in job["accepted"]]  # node 1 claims client 0
        from fedskew.flower.secure import to_bytes

        content.config_records["fitres.metrics"][SECAGG_KEY] = to_bytes(receipts)

    grid.faults[1] = _tamper(foreign)
    raw = _raw(rounds=1)
    raw["engine"]["on_client_error"] = "fail"
    with pytest.raises(RunFailure) as err:
        on_flower(raw, tmp_path, grid)
    assert "\n" not in str(err.value)
    assert "which this node was not asked to train" in str(err.value)


def test_an_update_beyond_the_clipping_range_fails_its_node_with_one_line(tmp_path):
    raw = _raw(rounds=1, clipping_range=1e-6)
    with pytest.raises(RunFailure) as err:
        on_flower(raw, tmp_path, LoopbackGrid(3))
    assert "\n" not in str(err.value) and "engine.secagg.clipping_range=1e-06; raise it" in str(err.value)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"engine.runtime": "embedded"}, "allowed: flower-simulation, flower-deployment"),
        ({"algorithm.name": "fedproto", "eval.protocol": "personalized"}, "does not aggregate by a weighted"),
        ({"defence.name": "krum"}, "defence.name=krum needs every client's update"),
        (
            {"privacy.mechanism": "central", "privacy.delta": 1e-5, "privacy.noise_multiplier": 1.0},
            "needs every",
        ),
        ({"engine.fold_uploads": False}, "allowed: engine.fold_uploads=true"),
        ({"engine.nodes": 1}, "engine.nodes >= 2"),
        ({"engine.secagg.shares": 2}, "an integer >= 3 or a share in (0, 1]"),
        ({"engine.secagg.threshold": 1.5}, "an integer >= 2 or a share in (0, 1]"),
        ({"engine.secagg.shares": 3, "engine.secagg.threshold": 3}, "threshold=3 must be below shares=3"),
    ],
)
def test_what_secure_aggregation_cannot_do_is_refused_with_one_line(change, problem):
    from fedskew.experiment.config_parsing import set_dotted

    raw = _raw()
    raw["engine"]["runtime"] = "flower-simulation"
    for key, value in change.items():
        set_dotted(raw, f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_without_secagg_the_recorded_config_has_no_secagg_key():
    cfg = build_config(
        {**_plain(_raw()), "engine": {**_plain(_raw())["engine"], "runtime": "flower-simulation"}}
    )
    assert "secagg" not in cfg.to_dict()["engine"]


def test_a_secure_executor_never_trains_a_round_in_the_clear(tmp_path):
    """Defence in depth: should a round ever not fold its mean, the secure executor refuses it rather than
    collect the uploads in the clear."""
    from fedskew.engine.types import RoundJob
    from fedskew.errors import FedskewError
    from fedskew.flower.server import server_simulation

    raw = _raw(rounds=1)
    cfg = build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-simulation"}})
    sim = server_simulation(LoopbackGrid(3), cfg, tmp_path, None)
    with pytest.raises(FedskewError, match="would reach the server in the clear"):
        sim.executor.train(RoundJob(1, [0, 1], sim.server, {}))


#: what marks each SecAgg+ stage's reply (the configs record's keys)
STAGE_KEY = {
    "setup": Key.PUBLIC_KEY_1,
    "share_keys": Key.DESTINATION_LIST,
    "masked": Key.MASKED_PARAMETERS,
    "unmask": Key.NODE_ID_LIST,
}


def _stage(reply: Message) -> str | None:
    if not reply.has_content() or RECORD_KEY_CONFIGS not in reply.content.config_records:
        return None
    keys = reply.content.config_records[RECORD_KEY_CONFIGS]
    return next((s for s, k in STAGE_KEY.items() if k in keys), None)


@pytest.mark.parametrize("stage", list(STAGE_KEY))
def test_a_node_dying_at_any_stage_of_the_protocol_leaves_the_others_sum(stage, tmp_path):
    """Node 2 dies with its reply to ``stage`` of round 1 and stays dead (still listed online). Before its
    masked update reached the server its clients are out of round 1; after it (the unmask stage), they are
    in it. Either way every round equals the plain run with node 2 dying at that point."""
    grid = LoopbackGrid(3)

    def dies(reply: Message) -> Message | None:
        if 2 in grid.silent or _stage(reply) == stage:
            grid.silent.add(2)
            return None
        return reply

    grid.faults[2] = dies
    secure = on_flower(_raw(), tmp_path / "s", grid)
    dead = LoopbackGrid(3)
    trained = stage == "unmask"  # round 1's update of node 2 is in the plain run too

    def plain_dies(reply: Message) -> Message | None:
        if reply.metadata.message_type != "train":
            return reply
        if trained and 2 not in dead.silent:
            dead.silent.add(2)
            return reply
        return None

    dead.faults[2] = plain_dies
    plain = on_flower(_plain(_raw()), tmp_path / "p", dead)
    assert [r.get("dropped") for r in secure] == ([None, [2, 5]] if trained else [[2, 5], [2, 5]])
    _close(secure, plain)


def _masked(edit: Any) -> Any:
    def fault(reply: Message) -> Message:
        if _stage(reply) == "masked":
            configs = reply.content.config_records[RECORD_KEY_CONFIGS]
            configs[Key.MASKED_PARAMETERS] = edit(list(configs[Key.MASKED_PARAMETERS]))
        return reply

    return fault


def _shifted(vectors: list[bytes]) -> list[bytes]:
    from flwr.common import ndarray_to_bytes

    first = bytes_to_ndarray(vectors[1])
    first.flat[0] = (int(first.flat[0]) + 2**30) % 2**32
    return [vectors[0], ndarray_to_bytes(first), *vectors[2:]]


def _reshaped(vectors: list[bytes]) -> list[bytes]:
    from flwr.common import ndarray_to_bytes

    return [vectors[0], ndarray_to_bytes(bytes_to_ndarray(vectors[1])[:3]), *vectors[2:]]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (_shifted, "beyond the clipping range"),  # +2^30 on one masked value: the mean leaves [-c, c]
        (_reshaped, "secure aggregation failed (ValueError"),  # a masked array of the wrong shape
        (lambda v: [b"not an array", *v[1:]], "secure aggregation failed"),
        (lambda v: v[:-1], "secure aggregation failed"),  # an array missing
    ],
)
def test_a_hostile_masked_update_discards_the_round_with_one_line_never_a_traceback(
    edit, problem, tmp_path, caplog
):
    grid = LoopbackGrid(3)
    grid.faults[1] = _masked(edit)
    with caplog.at_level(logging.WARNING, logger="fedskew.engine"):
        recs = on_flower(_raw(rounds=1), tmp_path, grid)
    assert recs[0]["rejected"] == 6 and recs[0].get("dropped") is None
    lines = [r.getMessage() for r in caplog.records if "secure aggregation" in r.getMessage()]
    assert len(lines) == 1 and problem in lines[0], lines


def test_unreadable_receipts_from_every_node_fail_the_round_under_fail(tmp_path):
    grid = LoopbackGrid(3)

    def garbage(content):
        content.config_records["fitres.metrics"][SECAGG_KEY] = b"\x00garbage"

    for node in range(3):
        grid.faults[node] = _tamper(garbage)
    raw = _raw(rounds=1)
    raw["engine"]["on_client_error"] = "fail"
    with pytest.raises(RunFailure, match="unreadable receipts"):
        on_flower(raw, tmp_path, grid)


def test_nodes_refuse_a_server_that_skips_the_protocol(tmp_path):
    """A curious ServerApp sends the plain train message for a run whose config sets ``engine.secagg``: every
    node answers with an error, and no upload array leaves a node."""
    from fedskew.engine.policy import ClientError
    from fedskew.engine.states import JobStates
    from fedskew.engine.types import RoundJob
    from fedskew.flower.server import FlowerExecutor, server_simulation

    raw = _raw(rounds=1)
    cfg = build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-simulation"}})
    grid = LoopbackGrid(3)
    sim = server_simulation(grid, cfg, tmp_path, None)
    with pytest.raises(ClientError, match="the server asked for uploads in the clear"):
        FlowerExecutor.train(
            sim.executor, RoundJob(1, [0, 1, 2], sim.server, JobStates(sim.states, [0, 1, 2]))
        )
    seen = grid.pulled
    assert seen and not any(
        k.startswith("u.") for m in seen if m.has_content() for k in m.content.array_records
    )


def test_a_batchnorm_model_sums_its_step_counters_securely(tmp_path):
    """``num_batches_tracked`` (int64) travels scaled down and is rounded back: the same metrics as the plain
    run. BatchNorm's running variances move by more than 8 in a round here: the clipping range is raised."""
    raw = _raw(rounds=1, clipping_range=32.0)
    raw["model"] = {"name": "cnn_fedbn"}
    secure = on_flower(raw, tmp_path / "s", LoopbackGrid(3))
    plain = on_flower(_plain(raw), tmp_path / "p", LoopbackGrid(3))
    _close(secure, plain)
