"""Knobs that act only under some evaluation protocols (``tunable(..., protocols=...)``, issue 52).

A fine-tuning length or Ditto's λ shapes the personal models only: when the global model is scored they change
nothing, and a tuner that searched them would spend its trials on noise while a method without such knobs
spends all of them on the lr. The declarations are checked against runs (inert under ``global``, acting under
``personalized``; a knob that acts under ``global`` is shown to fail the inertness check), ``fedskew tune``
leaves an inert knob out, and asking for one is a one-line error."""

from __future__ import annotations

from typing import Any

import pytest

from fedskew.algorithms import ALGORITHMS
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from fedskew.search_space import PROTOCOLS, SearchSpace, search_spaces, space_of, tunable
from fedskew.settings import EvalSection
from tests.conftest import cli, digits_config

#: every built-in knob declared personalized-only
PERSONAL_ONLY = [
    ("apfl", "alpha"),
    ("ditto", "lam"),
    ("fedavg_ft", "finetune_epochs"),
    ("fedavg_ft", "finetune_lr"),
    ("fedbabu", "finetune_epochs"),
    ("fedbabu", "finetune_lr"),
]
#: knobs that move the global model (pFedMe's λ and Per-FedAvg's β although their methods personalize)
ACTING_UNDER_GLOBAL = [("pfedme", "lam"), ("perfedavg", "beta"), ("fedprox", "mu")]


def test_the_declared_protocols_are_pinned_and_name_eval_protocols():
    assert EvalSection.model_fields["protocol"].annotation.__args__ == PROTOCOLS  # type: ignore[union-attr]
    found = [
        (name, knob)
        for name in sorted(ALGORITHMS.names())
        for knob, space in search_spaces(ALGORITHMS.get(name).Params).items()
        if space.protocols is not None
    ]
    assert found == PERSONAL_ONLY
    assert all(search_spaces(ALGORITHMS.get(m).Params)[k].protocols == ("personalized",) for m, k in found)


def final_record(method: str, protocol: str, knob: str, value: Any) -> dict[str, Any]:
    """The last round's record of a 2-round digits run of ``method`` with ``knob`` = ``value``."""
    raw = digits_config(
        rounds=2,
        algorithm={"name": method, knob: value},
        eval={"protocol": protocol, "every": 2},
        checkpoint={"every": 0},
    )
    sim = build_simulation(build_config(raw))
    try:
        return [sim.run_round().record for _ in range(2)][-1]
    finally:
        sim.close()


def scores(method: str, protocol: str, knob: str) -> list[tuple[float, float]]:
    """(accuracy, loss) at the two ends of ``knob``'s declared range."""
    space = search_spaces(ALGORITHMS.get(method).Params)[knob]
    assert space.low is not None and space.high is not None
    ends = [int(v) if space.integer else v for v in (space.low, space.high)]
    records = [final_record(method, protocol, knob, v) for v in ends]
    return [(float(r["accuracy"]), float(r["loss"])) for r in records]


@pytest.mark.parametrize(("method", "knob"), PERSONAL_ONLY)
def test_a_personalized_only_knob_is_inert_under_global_and_acts_under_personalized(method, knob):
    low, high = scores(method, "global", knob)
    assert low == high  # bit for bit: the global model never saw the knob
    low, high = scores(method, "personalized", knob)
    assert low != high


@pytest.mark.parametrize(("method", "knob"), ACTING_UNDER_GLOBAL)
def test_the_inertness_check_fails_for_a_knob_that_moves_the_global_model(method, knob):
    low, high = scores(method, "global", knob)
    assert low != high


# ---------------------------------------------------------------------------- the declaration
@pytest.mark.parametrize("protocols", [(), ("globl",), ("global", "local")])
def test_a_bad_protocols_declaration_raises_at_definition(protocols):
    with pytest.raises(ValueError, match="protocols is None"):
        tunable(1.0, low=0.1, high=2.0, protocols=protocols)


def test_the_declaration_survives_the_field_schema_and_says_where_it_acts():
    space = SearchSpace(1, 10, integer=True, protocols=("personalized",))
    assert space_of({"search": space.as_dict()}) == space
    assert space_of(
        {"search": SearchSpace(choices=("a", "b"), protocols=("global",)).as_dict()}
    ) == SearchSpace(choices=("a", "b"), protocols=("global",))
    assert space.acts_under("personalized") and not space.acts_under("global")
    assert SearchSpace(1, 10).acts_under("global") and "protocols" not in SearchSpace(1, 10).as_dict()


def test_list_params_marks_a_personalized_only_knob(monkeypatch, capsys):
    code, out, _ = cli(["list", "--params", "ditto", "--plain"], monkeypatch, capsys)
    rows = {r[0]: r for r in (line.split("\t") for line in out.splitlines())}
    assert code == 0 and rows["algorithm.lam"][3] == "[0.05, 2] log (personalized only)", out
    assert rows["client.lr"][3] == "[0.001, 0.5] log"


# ---------------------------------------------------------------------------- fedskew tune
def write_base(folder: Any, protocol: str) -> Any:
    """test_tune's digits base config (a validation split) under ``eval.protocol`` = ``protocol``."""
    from tests.test_tune import write_base as tune_base

    return tune_base(folder, rounds=1, eval={"protocol": protocol, "every": 1})


LR_MU = ["client.lr", "algorithm.mu"]


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [
        (
            "global",
            {"fedavg_ft": ["client.lr"], "ditto": ["client.lr"], "fedprox": ["client.lr", "algorithm.mu"]},
        ),
        (
            "personalized",
            {
                "fedavg_ft": ["client.lr", "algorithm.finetune_epochs", "algorithm.finetune_lr"],
                "ditto": ["client.lr", "algorithm.lam"],
                "fedprox": LR_MU,
            },
        ),
    ],
)
def test_tune_searches_only_the_knobs_that_act_under_the_studys_protocol(tmp_path, protocol, expected):
    pytest.importorskip("optuna")
    from fedskew.experiment.tune import TuneSpec, check_spec

    spec = TuneSpec(write_base(tmp_path, protocol), tuple(expected), 2, (100,), tmp_path / "out")
    plan = check_spec(spec)
    assert {m: list(k) for m, k in plan.knobs.items()} == expected
    assert not (tmp_path / "out").exists()


def test_asking_to_tune_an_inert_knob_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    pytest.importorskip("optuna")
    base, out = write_base(tmp_path, "global"), tmp_path / "out"
    argv = ["tune", str(base), "--methods", "ditto,fedavg_ft", "--trials", "2", "--seeds", "100"]
    code, _, err = cli([*argv, "--out", str(out), "--knobs", "algorithm.lam"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--knobs 'algorithm.lam': it acts only under eval.protocol personalized" in err
    assert "this study evaluates global" in err and not out.exists()
    code, _, err = cli(
        [*argv, "--out", str(out), "--knobs", "client.lr,algorithm.finetune_epochs"], monkeypatch, capsys
    )
    assert code == 2 and "--knobs 'algorithm.finetune_epochs': it acts only under" in err, err
