"""The embedded engine and the Flower apps (in process, tests/flower_loopback.py) apply one failure policy
(``fedskew.engine.policy``) and one per-client summary: a client that raises or diverges gets the same
decision on both, and clients without test samples (``min_size: 0``) are left out of the personalized
means, and are ``None`` in ``accuracy_clients``, on both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from benchmarks.faults import faulty_fedavg

from fedskew.engine.policy import ON_CLIENT_ERROR, ClientError, Decision, Failure, decide
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data

pytest.importorskip("flwr")

from fedskew.algorithms import ALGORITHMS
from tests.flower_loopback import LoopbackGrid
from tests.test_contract import HETERO_PARAMS, NAMES
from tests.test_contract_rules import empty_client_config, protocols_of
from tests.test_flower import assert_same_metrics, embedded, flower_config, on_flower

TABLE = {
    ("drop_non_finite", Failure.RAISED): Decision.FAIL,
    ("drop_non_finite", Failure.NON_FINITE): Decision.REJECT,
    ("drop", Failure.RAISED): Decision.REJECT,
    ("drop", Failure.NON_FINITE): Decision.REJECT,
    ("fail", Failure.RAISED): Decision.FAIL,
    ("fail", Failure.NON_FINITE): Decision.FAIL,
}


def test_the_policy_table():
    assert {(s, f): decide(s, f) for s in ON_CLIENT_ERROR for f in Failure} == TABLE
    with pytest.raises(ValueError, match="allowed: drop_non_finite, drop, fail"):
        decide("ignore", Failure.RAISED)


def _outcome(run: Any) -> tuple[str, Any]:
    """``("failed", None)`` when the round failed with a ClientError, else ``("committed", rejected)``."""
    try:
        records = run()
    except ClientError as err:
        assert "not committed" in str(err) and "\n" not in str(err)
        return "failed", None
    return "committed", records[0]["rejected"]


@pytest.mark.parametrize("kind", ["raise", "nan"])
@pytest.mark.parametrize("setting", ON_CLIENT_ERROR)
def test_a_failing_client_gets_the_same_decision_on_both_runtimes(setting, kind, tmp_path):
    raw = flower_config("fedavg", rounds=1)
    raw["name"] = f"policy-{setting}-{kind}"  # its own node runtime (nodes cache one per config)
    raw["client"]["fraction"] = 1.0
    raw["engine"]["on_client_error"] = setting
    with faulty_fedavg(kind, {1}, round_=1):
        here = _outcome(lambda: embedded(raw, tmp_path / "embedded"))
        there = _outcome(lambda: on_flower(raw, tmp_path / "flower", LoopbackGrid(3)))
    failure = Failure.RAISED if kind == "raise" else Failure.NON_FINITE
    expected = ("failed", None) if decide(setting, failure) is Decision.FAIL else ("committed", 1)
    assert here == there == expected


def _sparse(name: str) -> dict[str, Any]:
    """60 clients under Dirichlet(0.05) with ``min_size: 0``: many have no samples at all."""
    raw = flower_config(name, rounds=2)
    raw["name"] = f"sparse-{name}"
    raw["data"] = {
        "dataset": "digits",
        "num_clients": 60,
        "partition": {"name": "dirichlet", "alpha": 0.05, "min_size": 0},
    }
    raw["client"]["fraction"] = 0.5
    raw["eval"] = {"protocol": "personalized", "every": 1}
    return raw


@pytest.mark.parametrize("name", ["fedper", "fedavg"])  # personal models scored per client; one model
def test_clients_without_test_samples_are_left_out_alike_on_both_runtimes(name, tmp_path):
    raw = _sparse(name)
    data = build_data(build_config({**raw, "engine": {**raw["engine"], "runtime": "embedded"}}))
    no_test = {cid for cid, idx in enumerate(data.test_idx) if len(idx) == 0}
    assert no_test and len(no_test) < 60
    here = embedded(raw, tmp_path / "embedded")
    there = on_flower(raw, tmp_path / "flower", LoopbackGrid(3))
    assert_same_metrics(here, there)
    for record in here:
        accs = record["accuracy_clients"]
        assert {cid for cid, a in enumerate(accs) if a is None} == no_test
        have = [a for a in accs if a is not None]
        assert record["accuracy"] == pytest.approx(sum(have) / len(have), abs=1e-6)
    assert Path(tmp_path / "embedded" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "protocol"), [(n, p) for n in NAMES for p in protocols_of(n)])
def test_every_algorithm_with_empty_clients_agrees_on_both_runtimes(name, protocol, tmp_path):
    """The contract-rule suite's federation (a client without any data, one without test data) on Flower's
    apps gives the embedded numbers, for every registered algorithm under each protocol it supports."""
    raw = empty_client_config(name, protocol, "sequential")
    raw["name"] = f"empty-{name}-{protocol}"  # its own node runtime (nodes cache one per config)
    raw["engine"]["nodes"] = 3
    if ALGORITHMS.get(name).heterogeneous_models:
        raw["model"]["per_client"] = {"0-2": {"hidden": 24}}
        raw["algorithm"].update(HETERO_PARAMS.get(name, {}))
    here = embedded(raw, tmp_path / "embedded")
    there = on_flower(raw, tmp_path / "flower", LoopbackGrid(3))
    assert_same_metrics(here, there)
    assert all(r["rejected"] == 0 for r in there)
