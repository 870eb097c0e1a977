"""End-to-end: every baseline learns on real data (scikit-learn digits always; MNIST when available)."""

from __future__ import annotations

import pytest
import torch

from fedskew.data.base import resolve_root
from fedskew.data.federated import build_federated
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from tests.conftest import digits_config, requires_data

# (algorithm, hyper-parameters, protocol, minimum final accuracy after 8 rounds on digits)
BASELINES = [
    ("fedavg", {}, "global", 0.85),
    ("fedprox", {"mu": 0.01}, "global", 0.85),
    ("fedavgm", {}, "global", 0.80),
    ("fedadam", {}, "global", 0.80),
    ("fedyogi", {}, "global", 0.80),
    ("fedadagrad", {"server_lr": 0.1}, "global", 0.80),  # Adagrad needs a larger server lr (Reddi et al.)
    ("feddyn", {}, "global", 0.80),
    ("scaffold", {}, "global", 0.85),
    ("moon", {}, "global", 0.75),
    ("local", {}, "personalized", 0.80),
]

pytestmark = pytest.mark.slow  # end-to-end learning


@pytest.mark.parametrize(("name", "hyper", "protocol", "floor"), BASELINES, ids=[b[0] for b in BASELINES])
def test_baseline_learns_on_digits(name, hyper, protocol, floor):
    cfg = build_config(
        digits_config(
            rounds=8,
            algorithm={"name": name, **hyper},
            eval={"protocol": protocol, "every": 4},
            checkpoint={"every": 0},
        )
    )
    summary = run_experiment(cfg)
    assert summary["final"]["accuracy"] >= floor, summary["final"]  # chance is 0.1


@requires_data
def test_fedavg_learns_mnist_subset():
    """Real MNIST from FEDSKEW_DATA: FedAvg, 10 clients x 600 samples, >= 90% global accuracy in 10 rounds."""
    from fedskew.data.base import DATASETS

    ds = DATASETS.get("mnist")(resolve_root(None))
    g = torch.Generator().manual_seed(0)
    keep = torch.randperm(ds.y_train.shape[0], generator=g)[:6000]
    ds.x_train, ds.y_train = ds.x_train[keep], ds.y_train[keep]
    cfg = build_config(
        {
            "rounds": 10,
            "data": {"dataset": "mnist", "num_clients": 10, "partition": {"name": "dirichlet", "alpha": 0.5}},
            "model": {"name": "mlp_mpfedcl"},
            "client": {"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
            "checkpoint": {"every": 0},
        }
    )
    fd = build_federated(ds, 10, cfg.data.partition, cfg.seed)
    summary = run_experiment(cfg, data=fd)
    assert summary["final"]["accuracy"] >= 0.90, summary["final"]
