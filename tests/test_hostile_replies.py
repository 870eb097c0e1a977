"""Hostile replies through the real Flower server path (issue 51, item 2): a node's reply is rewritten after
its ClientApp ran and its content crossed Flower's wire format (tests/flower_loopback.py), then reaches the
ServerApp's ``FlowerExecutor`` exactly as on a deployment. Every reply that is not what the server asked
for (a wrong shape or dtype, a missing or unknown array, NaN, a foreign or repeated client id, a negative,
huge or non-integer sample count, an infinite loss, an unreadable upload, a malformed job record) is refused
with one logged line naming the node, the client and the problem; the run's results are then those of the
honest nodes: bit for bit the run in which the node itself left that client out. Under
``engine.on_client_error=fail`` the round fails with one line instead. Robust rules weight every upload
alike, so a claimed count cannot steer them either."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedskew.algorithms.base import Payload, RoundInfo, Upload
from fedskew.algorithms.layouts import ArraySpec, UploadLayout, class_rows, expected_layout
from fedskew.engine.policy import ClientError
from fedskew.engine.replies import check_reply, expected_count, layout_problem
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from tests.flower_loopback import LoopbackGrid
from tests.test_contract import tiny_config
from tests.test_flower import assert_same_metrics, flower_config, on_flower, records

HOSTILE_NODE, CLIENT, NEIGHBOUR = 2, 5, 2  # node 2 serves clients 2 and 5 (c % 3)
Edit = Callable[[RecordDict], None]


def train_fault(edit: Edit) -> Callable[[Message], Message]:
    """A fault rewriting a node's train replies (its index and manifest answers stay honest)."""

    def fault(reply: Message) -> Message:
        if reply.metadata.message_type == "train" and not reply.has_error():
            edit(reply.content)
        return reply

    return fault


def set_entry(key: str, value: Any, cid: int = CLIENT) -> Edit:
    """Client ``cid``'s entry of list ``key`` in the job record set to ``value``."""

    def edit(content: RecordDict) -> None:
        job = content["job"]
        values = list(job[key])
        values[list(job["accepted"]).index(cid)] = value
        job[key] = values

    return edit


def edit_arrays(change: Callable[[dict[str, torch.Tensor]], None], cid: int = CLIENT) -> Edit:
    """Client ``cid``'s uploaded arrays changed in place by ``change``."""

    def edit(content: RecordDict) -> None:
        arrays = content[f"u.{cid}.a"].to_torch_state_dict()
        change(arrays)
        content[f"u.{cid}.a"] = ArrayRecord(arrays)

    return edit


def first_float(arrays: dict[str, torch.Tensor]) -> str:
    return sorted(k for k, v in arrays.items() if v.is_floating_point())[0]


def omit(*cids: int) -> Edit:
    """The honest reference: the node itself leaves ``cids`` out of its reply (as it does with a client that
    diverged on it), so the server rejects them without any check involved."""

    def edit(content: RecordDict) -> None:
        job = content["job"]
        keep = [i for i, c in enumerate(job["accepted"]) if c not in cids]
        for key in ("accepted", "loss", "samples", "steps", "passes"):  # every per-client list of the reply
            job[key] = [list(job[key])[i] for i in keep]

    return edit


def _wrong_shape(a: dict[str, torch.Tensor]) -> None:
    a[first_float(a)] = torch.zeros(3, 3)


def _wrong_dtype(a: dict[str, torch.Tensor]) -> None:
    a[first_float(a)] = a[first_float(a)].double()


def _missing(a: dict[str, torch.Tensor]) -> None:
    del a[first_float(a)]


def _unknown(a: dict[str, torch.Tensor]) -> None:
    a["backdoor.trigger"] = torch.zeros(4)


def _nan(a: dict[str, torch.Tensor]) -> None:
    a[first_float(a)].view(-1)[0] = float("nan")


def _foreign(content: RecordDict) -> None:  # claims client 1 (node 1's) in place of client 5
    set_entry("accepted", 1)(content)
    for part in ("a", "c", "m"):
        content[f"u.1.{part}"] = content[f"u.{CLIENT}.{part}"]


def _twice(content: RecordDict) -> None:
    set_entry("accepted", NEIGHBOUR)(content)


def _no_job(content: RecordDict) -> None:
    del content["job"]


def _short(content: RecordDict) -> None:
    content["job"]["samples"] = list(content["job"]["samples"])[:1]


def _float_counts(content: RecordDict) -> None:  # Flower's records keep one type per list: both claim it
    content["job"]["samples"] = [1e12 for _ in content["job"]["samples"]]


def _unreadable(content: RecordDict) -> None:
    content[f"u.{CLIENT}.a"] = ConfigRecord({"not": "arrays"})


#: (edit of node 2's train replies, the clients the reference leaves out, the logged problem)
ONE, BOTH = (CLIENT,), (NEIGHBOUR, CLIENT)
CASES: dict[str, tuple[Edit, tuple[int, ...], str]] = {
    "wrong shape": (edit_arrays(_wrong_shape), ONE, r"'model\.\S+' is \[3, 3\] float32, the method uploads"),
    "wrong dtype": (edit_arrays(_wrong_dtype), ONE, r"\] float64, the method uploads \[[\d, ]+\] float32"),
    "missing array": (edit_arrays(_missing), ONE, r"array 'model\.\S+' is missing"),
    "unknown array": (edit_arrays(_unknown), ONE, r"array 'backdoor\.trigger' is not one the method uploads"),
    "NaN": (edit_arrays(_nan), ONE, r"refused: non-finite values"),
    "negative count": (set_entry("samples", -5), ONE, r"it claims -5 samples, the server holds \d+ for"),
    "huge count": (set_entry("samples", 10**12), ONE, r"it claims 1000000000000 samples, the server"),
    "float count": (_float_counts, BOTH, r"its sample count 1000000000000\.0 is not an integer"),
    "infinite loss": (set_entry("loss", math.inf), ONE, r"its loss inf is not a number"),
    "unreadable upload": (_unreadable, ONE, r"its upload cannot be read \(KeyError"),
    "foreign client": (_foreign, BOTH, r"client 1, which this node was not asked to train \(asked: \[2, 5"),
    "client twice": (_twice, BOTH, r"the reply names client 2 twice"),
    "no job record": (_no_job, BOTH, r"the reply has no job record"),
    "unequal lists": (_short, BOTH, r"'accepted', 'loss' and 'samples' differ in length"),
}  # fmt: skip


def hostile_config(name: str = "fedavg") -> dict[str, Any]:
    raw = flower_config(name, rounds=2)
    raw["client"]["fraction"] = 1.0  # every client, every round: node 2's clients are always asked
    return raw


def run_with(raw: dict[str, Any], out: Path, edit: Edit) -> list[dict[str, Any]]:
    grid = LoopbackGrid(3)
    grid.faults[HOSTILE_NODE] = train_fault(edit)
    return on_flower(raw, out, grid)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], list[dict[str, Any]]]:
    """The honest runs: node 2 leaves client 5 (or both its clients) out itself."""
    root = tmp_path_factory.mktemp("reference")
    return {cids: run_with(hostile_config(), root / str(len(cids)), omit(*cids)) for cids in (ONE, BOTH)}


def refused_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_reply_is_refused_and_the_run_is_the_honest_nodes(case, references, tmp_path, caplog):
    edit, left_out, problem = CASES[case]
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        recs = run_with(hostile_config(), tmp_path / "f", edit)
    lines = refused_lines(caplog)
    assert len(lines) == 2  # one line per round (both rounds hit), each naming the node, clients, problem
    who = f"client {CLIENT}" if len(left_out) == 1 else f"clients {list(left_out)}"
    for r, line in enumerate(lines, start=1):
        assert line.startswith(
            f"round {r}: node {HOSTILE_NODE} (Flower node 10{HOSTILE_NODE}): reply for {who}"
        )
        assert "\n" not in line and line.endswith("; rejected from the round")
    assert_same_metrics(recs, references[left_out], tol=0.0)
    assert all(r["rejected"] == len(left_out) for r in recs)
    assert re.search(problem, lines[0]), lines[0]


def test_under_fail_a_hostile_reply_fails_the_round_with_one_line(tmp_path):
    raw = hostile_config()
    raw["engine"]["on_client_error"] = "fail"
    with pytest.raises(ClientError) as err:
        run_with(raw, tmp_path / "f", set_entry("samples", 10**12))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(
        f"round 1: node 2 (Flower node 102): reply for client {CLIENT} refused: it claims 1000000000000"
    )
    assert text.endswith(
        "the round was not committed (engine.on_client_error=fail; allowed: drop_non_finite, drop, fail)"
    )
    assert not (tmp_path / "f" / "metrics.jsonl").exists() or not records(tmp_path / "f")


# ------------------------------------------------------------------ a declared layout (FedProto)
def _class_out_of_range(a: dict[str, torch.Tensor]) -> None:
    a["classes"] = a["classes"].clone()
    a["classes"][-1] = 99


def _rows_disagree(a: dict[str, torch.Tensor]) -> None:
    a["protos"] = torch.cat([a["protos"], a["protos"][:1]])


def _negative_counts(a: dict[str, torch.Tensor]) -> None:  # FedProto's Eq. 6 weights: counts are >= 1
    a["counts"] = a["counts"] * 0 - 1


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_class_out_of_range, r"array 'classes' holds values above 9"),
        (_rows_disagree, r"'protos' is \[\d+, 16\] float32, the method uploads \[k, 16\] float32 \(k = \d+ "),
        (_negative_counts, r"array 'counts' holds values below 1"),
    ],
)  # fmt: skip
def test_a_declared_layout_checks_ids_counts_and_shared_sizes(change, problem, tmp_path, caplog):
    """FedProto uploads only prototypes of the classes a client holds: their number is the client's, the
    same in ``classes``, ``protos`` and ``counts``, ids in [0, C) and counts >= 1 (what its aggregation
    indexes and weights with)."""
    raw = hostile_config("fedproto")
    reference = run_with(raw, tmp_path / "r", omit(CLIENT))
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        recs = run_with(raw, tmp_path / "f", edit_arrays(change))
    lines = refused_lines(caplog)
    assert len(lines) == 2 and all(f"reply for client {CLIENT} refused" in line for line in lines)
    assert re.search(problem, lines[0]), lines[0]
    assert_same_metrics(recs, reference, tol=0.0)


# ------------------------------------------------------------------ the checks themselves
LAYOUT = UploadLayout(
    {"model.w": ArraySpec((2, 3), torch.float32), **class_rows(10, protos=(4,))}, config=frozenset({"h"})
)


def honest() -> Payload:
    k = 3
    arrays = {
        "model.w": torch.zeros(2, 3),
        "classes": torch.tensor([0, 4, 9]),
        "counts": torch.ones(k, dtype=torch.long),
    }
    return Payload(arrays={**arrays, "protos": torch.zeros(k, 4)}, config={"h": 1.0})


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda p: None, None),
        (lambda p: p.arrays.update(classes=torch.tensor([0, -1, 9])), "array 'classes' holds values below 0"),
        (lambda p: p.arrays.update(counts=torch.ones(2, dtype=torch.long)), "(k = 3 elsewhere in"),
        (lambda p: p.arrays.update(protos=torch.zeros(3, 5)), "is [3, 5] float32, the method uploads [k, 4]"),
        (lambda p: p.arrays["model.w"].unsqueeze_(0), "array 'model.w' is [1, 2, 3] float32"),
        (lambda p: p.config.pop("h"), "config value 'h' is missing"),
        (lambda p: p.config.update(h=math.inf), "non-finite values"),
        (lambda p: p.arrays.update({"x" * 500: torch.zeros(1)}), "array 'xxxxxxxx"),
    ],
)  # fmt: skip
def test_layout_problems_name_the_array_and_what_was_expected(change, problem):
    payload = honest()
    change(payload)
    found = layout_problem(LAYOUT, payload)
    assert found == problem if problem is None else problem in (found or "")
    assert found is None or len(found) < 200  # a hostile name cannot flood the log line


def test_a_layout_bounds_named_sizes():
    layout = UploadLayout({"protos": ArraySpec(("m", 4), torch.float32)}, limits={"m": 20})
    assert layout_problem(layout, Payload(arrays={"protos": torch.zeros(20, 4)})) is None
    assert "(m at most 20)" in (layout_problem(layout, Payload(arrays={"protos": torch.zeros(21, 4)})) or "")


def test_a_method_that_declares_nothing_uploads_what_it_was_sent():
    sim = build_simulation(build_config(tiny_config("fedavg")))
    sent = sim.algorithm.broadcast(sim.server, RoundInfo(1, 0, 0))
    layout = expected_layout(sim.algorithm, sent, RoundInfo(1, 0, 0))
    assert dict(layout.arrays) == {k: ArraySpec.like(v) for k, v in sent.arrays.items()}
    assert layout_problem(layout, sent) is None


def test_counts_are_the_manifests_or_one_where_the_method_does_not_disclose_them():
    plain = build_simulation(build_config(tiny_config("fedavg"))).algorithm
    assert expected_count(plain, 3) == int(plain.ctx.client_sizes[3]) > 1
    raw = tiny_config("fedavg")
    raw["privacy"] = {"mechanism": "local", "clip": 1.0, "noise_multiplier": 0.5, "delta": 1e-5}
    sim = build_simulation(build_config(raw))
    dp = sim.algorithm
    assert expected_count(dp, 3) == 1  # local DP: every upload counts 1, and reports no loss
    sent = dp.broadcast(sim.server, RoundInfo(1, 3, 0))
    job = {"accepted": [3], "loss": [math.nan], "samples": [int(dp.ctx.client_sizes[3])]}
    checked = check_reply(dp, RoundInfo(1, None, 0), [3], job, lambda cid: sent, {3: sent})
    assert checked.refused == {3: f"it claims {job['samples'][0]} samples, the server holds 1 for the client"}
    job["samples"] = [1]
    checked = check_reply(dp, RoundInfo(1, None, 0), [3], job, lambda cid: sent, {3: sent})
    assert not checked.refused and checked.accepted[0].upload.num_samples == 1


# ------------------------------------------------------------------ robust rules and claimed counts
def _aggregate(defence: dict[str, Any], counts: list[int]) -> dict[str, torch.Tensor]:
    raw = tiny_config("fedavg")
    raw["client"]["fraction"] = 1.0
    raw["data"]["num_clients"] = 5
    raw["defence"] = defence
    sim = build_simulation(build_config(raw))
    server = sim.server
    uploads = []
    for k, (d, n) in enumerate(zip([1.0, 2.0, 3.0, 4.0, 100.0], counts, strict=True)):
        arrays = {
            f"model.{name}": (w + d if w.is_floating_point() else w) for name, w in server["weights"].items()
        }
        uploads.append(Upload(k, n, Payload(arrays=arrays)))
    return sim.algorithm.aggregate(server, uploads, RoundInfo(1, None, raw["seed"])).state["weights"]


@pytest.mark.parametrize(
    "defence",
    [
        {"name": "geomed", "max_iter": 200},
        {"name": "multi_krum", "byzantine_fraction": 0.2, "select": 3},
        {"name": "norm_bound", "max_norm": 1.0},
        {"name": "median", "byzantine_fraction": 0.2},
    ],
    ids=lambda d: d["name"],
)
def test_robust_rules_weight_every_upload_alike_whatever_count_it_claims(defence):
    """One client claiming 10¹² samples (here the outlier's neighbour, selected by Krum) moves nothing: the
    rules never weight by self-reported counts (before: the geometric median, and the mean after Krum or
    norm bounding, became that client's upload)."""
    honest_counts = _aggregate(defence, [10, 10, 10, 10, 10])
    claimed = _aggregate(defence, [10, 10**12, 10, 10, 10])
    assert all(torch.equal(honest_counts[k], claimed[k]) for k in honest_counts)
