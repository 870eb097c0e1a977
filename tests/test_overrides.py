"""Overrides that do not fight the schema: setting a named section's ``name`` replaces the section
(config_parsing.apply_overrides), and sweep grid keys scoped to the methods that have them, with grid points
a method cannot take skipped (experiment/sweep_grid.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedskew.cli import app
from fedskew.errors import ConfigError
from fedskew.experiment.config import Config, build_config
from fedskew.experiment.config_parsing import NAMED_SECTIONS
from fedskew.experiment.sweep import plan_runs
from tests.conftest import digits_config
from tests.test_sweep import TINY, write_configs


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fedskew.config"]


# ---------------------------------------------------------------------------- --set NAMED.name=...
def test_switching_the_partition_replaces_the_section_with_a_note(caplog):
    raw = digits_config()  # dirichlet, alpha 0.5
    with caplog.at_level(logging.WARNING, "fedskew.config"):
        cfg = build_config(raw, ["data.partition.name=iid"])
    assert cfg.data.partition == {"name": "iid"}
    assert notes(caplog) == [
        "--set data.partition.name=iid: dropped data.partition.alpha (options of partition 'dirichlet'); "
        "set them in the same --set list to keep them"
    ]
    assert raw["data"]["partition"] == {"name": "dirichlet", "alpha": 0.5}  # the caller's mapping is kept


def test_the_new_variants_fields_set_in_the_same_list_are_kept_in_any_order(caplog):
    with caplog.at_level(logging.WARNING, "fedskew.config"):
        before = build_config(
            digits_config(), ["data.partition.k=2", "data.partition.name=classes_per_client"]
        )
        after = build_config(
            digits_config(), ["data.partition.name=classes_per_client", "data.partition.k=2"]
        )
        same = build_config(digits_config(), ["data.partition.name=dirichlet", "data.partition.alpha=0.1"])
    assert before.data.partition == after.data.partition == {"name": "classes_per_client", "k": 2}
    assert same.data.partition == {"name": "dirichlet", "alpha": 0.1}  # the same name: nothing dropped
    assert len(notes(caplog)) == 2 and all("dropped data.partition.alpha " in n for n in notes(caplog))
    # a dropped key set again in the list is not reported as dropped
    with caplog.at_level(logging.WARNING, "fedskew.config"):
        caplog.clear()
        cfg = build_config(digits_config(), ["data.partition.name=iid", "data.partition.min_size=1"])
    assert cfg.data.partition == {"name": "iid", "min_size": 1} and "min_size" not in notes(caplog)[0]


def test_an_algorithm_switch_keeps_client_settings_and_drops_only_the_old_methods_knobs(caplog):
    raw = digits_config(algorithm={"name": "fedprox", "mu": 0.1})
    raw["client"]["lr"] = 0.2
    with caplog.at_level(logging.WARNING, "fedskew.config"):
        fedavg = build_config(raw, ["algorithm.name=fedavg"])
        moon = build_config(raw, ["algorithm.name=moon"])  # moon has a `mu` too, with another meaning
        moon_mu = build_config(raw, ["algorithm.mu=2", "algorithm.name=moon"])
    assert fedavg.algorithm.hyper() == {} and moon.algorithm.hyper() == {}
    assert moon_mu.algorithm.hyper() == {"mu": 2}
    assert fedavg.client == moon.client == build_config(raw).client and fedavg.client.lr == 0.2
    assert fedavg.model_dump(exclude={"algorithm"}) == build_config(raw).model_dump(exclude={"algorithm"})
    assert notes(caplog)[0].startswith("--set algorithm.name=fedavg: dropped algorithm.mu (options of")
    assert len(notes(caplog)) == 2  # moon_mu sets mu itself: no note


def test_a_model_switch_drops_the_old_models_options(caplog):
    raw = digits_config(model={"name": "mlp_mpfedcl", "hidden": 32})
    with caplog.at_level(logging.WARNING, "fedskew.config"):
        cfg = build_config(raw, ["model.name=cnn_mnist"])
    assert cfg.model.name == "cnn_mnist" and cfg.model.options() == {}
    assert "dropped model.hidden" in notes(caplog)[0]
    implicit = {k: v for k, v in raw.items() if k != "model"} | {"model": {"hidden": 32}}  # default name
    assert build_config(implicit, ["model.name=cnn_mnist"]).model.options() == {}


def test_name_defaults_of_the_table_match_the_schema():
    defaults = Config().to_dict()
    for path, (keep, default) in NAMED_SECTIONS.items():
        if default is not None:
            section = defaults
            for part in path:
                section = section[part]
            assert section["name"] == default, path
        assert "name" in keep


def test_a_name_override_on_a_section_that_is_not_a_mapping_is_one_line():
    with pytest.raises(ConfigError, match="'algorithm' holds 'fedprox', not a section"):
        build_config(digits_config(algorithm="fedprox"), ["algorithm.name=fedavg"])


# ---------------------------------------------------------------------------- sweep grids
def test_a_scoped_grid_key_goes_only_to_its_method(tmp_path):
    configs = write_configs(tmp_path)  # fedavg, fedprox
    plan = plan_runs(configs, tmp_path / "out", [0, 1], ["algorithm.fedprox.mu=0.01,0.1"])
    assert not plan.skipped
    got = sorted((r.config["algorithm"]["name"], r.config["algorithm"].get("mu"), r.seed) for r in plan.runs)
    assert got == [("fedavg", None, s) for s in (0, 1)] + [
        ("fedprox", mu, s) for mu in (0.01, 0.1) for s in (0, 1)
    ]
    fedavg = [r for r in plan.runs if r.config["algorithm"]["name"] == "fedavg"]
    assert [r.folder for r in fedavg] == [tmp_path / "out" / "digits-fedavg" / f"seed{s}" for s in (0, 1)]
    assert {r.overrides for r in plan.runs if r.config["algorithm"]["name"] == "fedprox"} == {
        ("algorithm.mu=0.01",),
        ("algorithm.mu=0.1",),
    }


def test_scoped_keys_follow_a_name_set_by_the_grid(tmp_path):
    config = write_configs(tmp_path)[0]  # dirichlet(0.5) partition, fedavg
    grid = ["data.partition.name=iid,dirichlet", "data.partition.dirichlet.alpha=0.1,1.0"]
    plan = plan_runs([config], tmp_path / "out", None, grid)
    parts = sorted((r.config["data"]["partition"] for r in plan.runs), key=lambda p: sorted(p.items()))
    assert parts == [
        {"name": "dirichlet", "alpha": 0.1},
        {"name": "dirichlet", "alpha": 1.0},
        {"name": "iid"},
    ]


def test_an_unscoped_key_a_method_lacks_skips_that_grid_point(tmp_path):
    config = write_configs(tmp_path)[0]
    grid = ["algorithm.name=fedavg,fedprox", "algorithm.mu=0.01,0.1"]
    plan = plan_runs([config], tmp_path / "out", [0, 1, 2], grid)
    assert sorted((r.config["algorithm"]["mu"], r.seed) for r in plan.runs) == [
        (mu, s) for mu in (0.01, 0.1) for s in (0, 1, 2)
    ]
    assert [p.line() for p in plan.skipped] == [  # once per grid point, not per seed
        f"skipped: {config} --set algorithm.name=fedavg --set algorithm.mu={mu}: config key 'algorithm.mu': "
        "unknown hyper-parameter of 'fedavg'; allowed: (none); to give it only to runs that have it: "
        "--grid algorithm.<name>.mu=..."
        for mu in ("0.01", "0.1")
    ]
    res = CliRunner().invoke(
        app,
        ["sweep", str(config), "--out", str(tmp_path / "out"), "--dry-run"]
        + [x for g in grid for x in ("--grid", g)],
    )
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == "2 runs: 2 new; 2 grid points skipped"
    assert [line.split(":")[0] for line in lines[2:4]] == ["skipped", "skipped"]
    assert not (tmp_path / "out").exists()


def test_grid_keys_no_run_can_take_are_refused_as_typos(tmp_path):
    configs = write_configs(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as info:  # a scope no run of the sweep has
        plan_runs(configs, out, None, ["algorithm.scaffold.server_lr=0.5,1"])
    assert str(info.value) == (
        "--grid 'algorithm.scaffold.server_lr': no run of the sweep has algorithm.name=scaffold; a typo?"
    )
    with pytest.raises(ConfigError, match=r"'fedprx' is not a registered algorithm \(did you mean 'fedprox'"):
        plan_runs(configs, out, None, ["algorithm.fedprx.mu=0.1"])
    with pytest.raises(ConfigError) as info:  # every run skipped: a misspelt knob, not a method's gap
        plan_runs(configs, out, None, ["algorithm.muu=0.1"])
    assert str(info.value).startswith(
        "--grid 'algorithm.muu': no run of the sweep can take it: config key 'algorithm.muu': unknown "
        "hyper-parameter of 'fedavg'"
    )
    with pytest.raises(ConfigError) as info:  # a scoped key its own method refuses
        plan_runs(configs, out, None, ["algorithm.fedprox.muu=0.1"])
    assert "unknown hyper-parameter of 'fedprox' (did you mean 'mu'?)" in str(info.value)
    assert not out.exists()


def test_a_bad_value_is_an_error_not_a_skip(tmp_path):
    configs = write_configs(tmp_path)
    with pytest.raises(ConfigError) as info:
        plan_runs(configs, tmp_path / "out", None, ["algorithm.fedprox.mu=lots"])
    assert str(info.value).startswith(
        f"sweep: {tmp_path / 'out' / 'digits-fedprox' / 'algorithm.mu=lots' / 'seed0'}: "
        "--set algorithm.mu=lots: config key 'algorithm.mu': Input should be a valid number"
    )
    with pytest.raises(ConfigError, match="config key 'client.lrr': unknown key"):  # not a named section
        plan_runs(configs, tmp_path / "out", None, ["client.lrr=0.1"])


def test_sweep_notes_are_not_repeated_per_seed(tmp_path, caplog):
    config = tmp_path / "prox.yaml"
    config.write_text(yaml.safe_dump(digits_config(**TINY, algorithm={"name": "fedprox", "mu": 0.1})))
    with caplog.at_level(logging.WARNING, "fedskew.config"):
        plan = plan_runs([config], tmp_path / "out", [0, 1, 2], ["algorithm.name=fedavg,fedprox"])
    assert len(plan.runs) == 6 and len(notes(caplog)) == 1
    assert {r.config["algorithm"].get("mu") for r in plan.runs} == {None, 0.1}


def test_folders_of_unscoped_runs_are_unchanged(tmp_path):
    configs = write_configs(tmp_path)
    plan = plan_runs(configs, tmp_path / "out", [0], ["client.lr=0.05,0.1"])
    assert [r.folder.relative_to(tmp_path / "out").as_posix() for r in plan.runs] == [
        f"digits-{alg}/client.lr={lr}/seed0" for alg in ("fedavg", "fedprox") for lr in ("0.05", "0.1")
    ]


def test_the_same_config_twice_plans_its_runs_once(tmp_path):
    config = write_configs(tmp_path)[0]
    assert len(plan_runs([config, Path(config)], tmp_path / "out", [0]).runs) == 1
