"""Declared search spaces on every method's tuned knobs (issue 52 item 2) and ``fedskew list --params NAME``.

``KNOBS`` pins which hyper-parameters of which built-in method declare a search space, so a method that
silently loses a declaration (or gains one nobody reviewed) fails here; docs/decisions.md, "Issue 52 item 2:
declared search spaces on the methods' knobs", says which knobs and where each space comes from."""

from __future__ import annotations

import contextlib
import json
import re
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from fedskew.algorithms import ALGORITHMS
from fedskew.search_space import SearchSpace, search_spaces, tunable
from fedskew.settings import ClientSection
from tests.conftest import cli

#: built-in method -> its knobs with a declared search space (empty: only client.lr is tuned)
KNOBS: dict[str, set[str]] = {
    "adapterfl": {"ratio"},
    "apfl": {"alpha"},
    "cachefl": {"alpha", "beta"},
    "cachefl_notrain": {"alpha", "beta"},
    "ccvr": set(),
    "ditto": {"lam"},
    "dpfedcl": set(),  # K is only the pool's least pad width under DBSCAN
    "fedadagrad": {"server_lr"},
    "fedadam": {"server_lr"},
    "fedala": {"rand_percent", "eta"},
    "fedavg": set(),
    "perfedavg": {"beta"},
    "fedfomo": {"M"},
    "lgfedavg": {"global_layers"},
    "scaffold": set(),
    "feddecorr": {"beta"},
    "fedavg_ft": {"finetune_epochs", "finetune_lr"},
    "fedavgm": {"momentum"},
    "fedbabu": {"finetune_epochs", "finetune_lr"},
    "fedbn": set(),
    "fedcos": set(),
    "feddyn": {"alpha"},
    "fedent": {"beta", "gamma"},
    "fedgen": {"alpha"},
    "fedlc": {"tau"},
    "fednh": {"rho"},
    "fednorm": {"beta", "gamma"},
    "fednova": set(),
    "fedntd": {"beta", "tau"},
    "fedpac": {"lam"},
    "fedper": set(),
    "fedproto": {"lam"},
    "fedprox": {"mu"},
    "fedrcl": {"beta"},
    "fedrep": {"head_epochs"},
    "fedrod": set(),
    "fedskc": {"m", "tau"},
    "fedyogi": {"server_lr"},
    "fesem": {"clusters"},
    "local": set(),
    "moon": {"mu"},
    "mpfedcl": {"k"},
    "pfedme": {"lam", "K", "personal_lr"},
    "promptfl": set(),
    "qfedavg": {"q"},
    "spfedcl": set(),
    "zeroshot": set(),
}
#: declared by the helpers who fix these methods' defaults (issue 52 item 1); their rows join KNOBS then


def builtins() -> list[str]:
    return [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("fedskew.")]


def space_points(space: SearchSpace) -> list[object]:
    """The values a tuner can reach at the space's ends (and every choice)."""
    if space.choices is not None:
        return list(space.choices)
    assert space.low is not None and space.high is not None
    ends = [space.low, space.high]
    return [int(v) for v in ends] if space.integer else ends


def test_every_builtin_method_states_its_tuned_knobs():
    """A new built-in method must say here which knobs it declares (possibly none)."""
    assert set(builtins()) == set(KNOBS)


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_declared_knobs_are_pinned(name):
    assert set(search_spaces(ALGORITHMS.get(name).Params)) == KNOBS[name]


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_every_space_holds_its_default_and_its_ends_are_valid_values(name):
    """The default lies in its space, and both ends pass the field's own constraints (ge/lt/...): a tuner
    sampling anywhere in the space never builds a config that validation refuses."""
    params = ALGORITHMS.get(name).Params
    for field, space in search_spaces(params).items():
        default = params.model_fields[field].default
        assert default is None or space.contains(default), (name, field, default, space.text())
        for value in space_points(space):
            assert getattr(params(**{field: value}), field) == value


def test_client_lr_declares_the_searched_lr():
    space = search_spaces(ClientSection)["lr"]
    assert space.log and space.contains(0.01) and not space.contains(1.0)


# ---------------------------------------------------------------------------- fedskew list --params
def test_list_params_fedprox_shows_the_lr_then_mu_with_its_space(monkeypatch, capsys):
    rc, out, _ = cli(["list", "--params", "fedprox", "--plain"], monkeypatch, capsys)
    rows = [line.split("\t") for line in out.splitlines()]
    assert rc == 0 and [r[0] for r in rows] == ["client.lr", "algorithm.mu"]
    assert rows[0][1:4] == ["float", "0.01", "[0.001, 0.5] log"]
    assert rows[1][1:4] == ["float", "0.01", "[0.001, 1] log"] and "search:" in rows[1][4]
    rc, table, _ = cli(["list", "--params", "fedprox"], monkeypatch, capsys)
    assert rc == 0 and "[0.001, 1] log" in table  # the space column is never wrapped


def test_list_params_marks_undeclared_knobs_with_a_dash(monkeypatch, capsys):
    rc, out, _ = cli(["list", "--params", "apfl", "--plain"], monkeypatch, capsys)
    rows = {r.split("\t")[0]: r.split("\t") for r in out.splitlines()}
    assert (
        rc == 0
        and rows["algorithm.alpha"][3] == "[0.25, 0.75] (personalized only)"
        and rows["algorithm.mixing"][3] == "—"
    )
    assert rows["algorithm.mixing"][1] == "Literal['params', 'logits']"


def test_list_params_json_matches_the_declarations_of_every_method(monkeypatch, capsys):
    for name in builtins():
        rc, out, _ = cli(["list", "--params", name, "--json"], monkeypatch, capsys)
        doc = json.loads(out)
        declared = {
            f"algorithm.{k}": v.as_dict() for k, v in search_spaces(ALGORITHMS.get(name).Params).items()
        }
        listed = {r["name"]: r["search"] for r in doc["params"][1:] if r["search"] is not None}
        assert rc == 0 and doc["algorithm"] == name and listed == declared, name
        assert doc["params"][0]["name"] == "client.lr" and doc["params"][0]["search"]["log"] is True


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--params", "fedprx"], "unknown algorithm (did you mean 'fedprox'?); allowed: "),
        (["--params", "fedprox; rm -rf /"], "unknown algorithm; allowed: "),
        (["--params", ""], "unknown algorithm; allowed: "),
        (["models", "--params", "fedprox"], "takes an algorithm name, not a 'models' kind"),
    ],
)
def test_list_params_refuses_a_bad_name_in_one_line_exit_2(argv, match, monkeypatch, capsys):
    rc, out, err = cli(["list", *argv], monkeypatch, capsys)
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and match in err
    if "allowed" in match:  # the registered names, sorted
        assert "adapterfl, apfl, cachefl" in err and "fedprox, fedrcl" in err


# ---------------------------------------------------------------------------- plugins
@pytest.fixture
def restored():
    with contextlib.ExitStack() as stack:
        stack.enter_context(ALGORITHMS.restored())
        yield


def write_plugin(folder: Path, name: str, field: str) -> Path:
    path = folder / name
    path.write_text(
        textwrap.dedent(f"""
        from fedskew.algorithms.base import ALGORITHMS, Algorithm, HyperParams
        from fedskew.search_space import tunable

        @ALGORITHMS.register("{path.stem}_alg")
        class Tuned(Algorithm):
            class Params(HyperParams):
                {field}
    """)
    )
    return path


def test_a_plugin_methods_declared_space_is_listed(tmp_path, restored, monkeypatch, capsys):
    knob = 'gain: float = tunable(0.5, low=0.1, high=2.0, log=True, gt=0, description="a plugin knob")'
    path = write_plugin(tmp_path, "tuned_plugin.py", knob)
    argv = ["list", "--params", "tuned_plugin_alg", "--plugin", str(path), "--json"]
    rc, out, _ = cli(argv, monkeypatch, capsys)
    rows = json.loads(out)["params"]
    assert rc == 0 and rows[1]["name"] == "algorithm.gain" and rows[1]["default"] == 0.5
    assert rows[1]["search"] == {"log": True, "integer": False, "low": 0.1, "high": 2.0}


def test_a_plugin_whose_default_lies_outside_its_space_is_one_line_exit_2(
    tmp_path, restored, monkeypatch, capsys
):
    path = write_plugin(tmp_path, "bad_space.py", "gain: float = tunable(5.0, low=0.1, high=2.0)")
    rc, out, err = cli(["list", "--params", "bad_space_alg", "--plugin", str(path)], monkeypatch, capsys)
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1
    assert "bad_space.py" in err and "default 5.0 is outside its search space [0.1, 2]" in err
    assert "bad_space_alg" not in ALGORITHMS


# ---------------------------------------------------------------------------- tunable refuses bad spaces
@pytest.mark.parametrize(
    ("default", "space", "match"),
    [
        (5.0, {"low": 0.1, "high": 2.0}, "default 5.0 is outside"),
        (0.0, {"low": 0.0, "high": 1.0, "log": True}, "log-scale search range needs low > 0"),
        (-1.0, {"low": -1.0, "high": 1.0, "log": True}, "log-scale search range needs low > 0"),
        (1, {"low": 0, "high": 3, "choices": [1, 2]}, "either non-empty choices or a range"),
        (1, {"choices": []}, "either non-empty choices or a range"),
        (1.0, {"low": 2.0, "high": 1.0}, "needs low < high"),
        (1.0, {"low": 1.0}, "needs low < high"),
        (2.5, {"low": 1, "high": 4, "integer": True}, "default 2.5 is outside"),
        (float("nan"), {"low": 0.0, "high": 1.0}, "is outside"),
        ("sgd", {"choices": ["adam"]}, "default 'sgd' is outside"),
        (1.0, {"low": 0.0, "high": 1.0, "step": 0.3}, "must divide the range [0, 1]"),
        (0.5, {"low": 0.1, "high": 1.0, "log": True, "step": 0.1}, "positive, linear and whole"),
        (2, {"low": 1, "high": 5, "integer": True, "step": 1.5}, "positive, linear and whole"),
        (1.0, {"low": 0.0, "high": 1.0, "step": 0.0}, "positive, linear and whole"),
        (0.3, {"low": 0.0, "high": 1.0, "step": 0.25}, "default 0.3 is outside"),  # off the step grid
    ],
)
def test_a_bad_space_raises_at_class_definition(default, space, match):
    with pytest.raises(ValueError, match=re.escape(match)):

        class Bad(BaseModel):  # the class statement itself must fail
            knob: float = tunable(default, **space)


def test_a_step_grid_holds_its_points_and_only_them():
    grid = SearchSpace(0.0, 1.0, step=0.25)
    assert [grid.contains(v) for v in (0.0, 0.25, 0.75, 1.0)] == [True] * 4
    assert not grid.contains(0.3) and not grid.contains(1.25)
    odd = SearchSpace(1, 9, integer=True, step=2)
    assert odd.contains(5) and not odd.contains(4)
