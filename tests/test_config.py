"""Config validation: one clear line naming the key and the allowed values; --set overrides."""

from __future__ import annotations

import pytest

from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config, load_config, set_dotted
from tests.conftest import digits_config


def test_defaults_and_overrides():
    cfg = build_config(digits_config(), ["client.lr=0.2", "data.partition.alpha=0.1", "rounds=7"])
    assert cfg.client.lr == 0.2 and cfg.rounds == 7
    assert cfg.data.partition == {"name": "dirichlet", "alpha": 0.1}


def test_set_dotted_parses_yaml_values_and_creates_sections():
    d: dict = {}
    set_dotted(d, "a.b.c=[1, 2]")
    set_dotted(d, "a.flag=true")
    assert d == {"a": {"b": {"c": [1, 2]}, "flag": True}}
    with pytest.raises(ConfigError, match="expected key=value"):
        set_dotted(d, "novalue")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("client.lrr=0.1", "config key 'client.lrr': unknown key (did you mean 'lr'?); allowed: epochs"),
        ("eval.protocol=personal", "config key 'eval.protocol'"),
        ("client.fraction=1.5", "config key 'client.fraction'"),
        ("algorithm.name=fedavgg", "unknown algorithm 'fedavgg' (did you mean 'fedavg'?); valid:"),
        ("model.name=cnn", "unknown model 'cnn'"),
        ("data.dataset=mnits", "unknown dataset 'mnits' (did you mean 'mnist'?)"),
        ("data.partition.name=dirichelt", "unknown partition scheme 'dirichelt' (did you mean 'dirichlet'?)"),
        (
            "data.partition.alpah=0.1",
            "config key 'data.partition.alpah': unknown option (did you mean 'alpha'?)",
        ),
        ("algorithm.muu=0.1", "unknown hyper-parameter of 'fedavg'"),
        ("engine.mode=fast", "config key 'engine.mode'"),
        ("engine.device=tpu", "config key 'engine.device'"),
    ],
)
def test_bad_config_is_one_clear_line(override, needle):
    with pytest.raises(ConfigError) as info:
        build_config(digits_config(), [override])
    msg = str(info.value)
    assert needle in msg
    assert "\n" not in msg


def test_algorithm_hyper_parameters_are_validated():
    with pytest.raises(ConfigError, match="config key 'algorithm.mu'"):
        build_config(digits_config(algorithm={"name": "fedprox", "mu": "lots"}))
    cfg = build_config(digits_config(algorithm={"name": "fedprox", "mu": 0.5}))
    assert cfg.algorithm.hyper() == {"mu": 0.5}


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_shipped_configs_validate():
    from pathlib import Path

    configs = sorted(Path(__file__).parents[1].joinpath("configs").rglob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)  # raises on any invalid key or value
