"""One warning, with the count and the setting that causes it, when partitioning leaves clients empty or
with fewer samples than one batch: once per run, not per round."""

from __future__ import annotations

import logging

import pytest

from fedskew.experiment.config import build_config
from fedskew.experiment.data_warnings import small_clients_message
from fedskew.experiment.runner import build_data, run_experiment
from tests.conftest import digits_config

SKEWED = {
    "dataset": "digits",
    "num_clients": 100,
    "partition": {"name": "dirichlet", "alpha": 0.05, "min_size": 0},
}


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "fedskew.data" and r.levelno == logging.WARNING
    ]


def test_message_names_counts_and_the_setting():
    cfg = build_config(digits_config())
    assert small_clients_message(cfg, [0, 0, 31, 32, 100]) == (
        "2 of 5 clients have no training data after partitioning (data.partition: dirichlet alpha=0.5); "
        "1 more have fewer than client.batch_size=32 samples"
    )
    assert small_clients_message(cfg, [5, 40]) == (
        "1 of 2 clients have fewer than client.batch_size=32 samples after partitioning "
        "(data.partition: dirichlet alpha=0.5)"
    )
    assert small_clients_message(cfg, [32, 32, 1000]) is None  # exactly one batch is enough


def test_a_skewed_partition_warns_once_per_run_with_its_counts(tmp_path, caplog):
    cfg = build_config(digits_config(rounds=2, data=SKEWED, client={"batch_size": 32, "fraction": 0.1}))
    sizes = build_data(cfg).class_counts().sum(1).tolist()
    empty, small = sum(s == 0 for s in sizes), sum(0 < s < 32 for s in sizes)
    assert empty > 0 and small > 0  # the setting really empties clients
    with caplog.at_level(logging.WARNING):
        run_experiment(cfg, tmp_path / "run")
    assert warnings_of(caplog) == [
        f"{empty} of 100 clients have no training data after partitioning "
        f"(data.partition: dirichlet alpha=0.05 min_size=0); {small} more have fewer than "
        "client.batch_size=32 samples"
    ]


def test_a_balanced_partition_is_silent(caplog):
    cfg = build_config(digits_config(rounds=1, data={"dataset": "digits", "num_clients": 5}))
    with caplog.at_level(logging.WARNING):
        run_experiment(cfg)
    assert warnings_of(caplog) == []
