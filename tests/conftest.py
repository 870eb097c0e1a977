"""Shared fixtures: small offline federations on scikit-learn digits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # tests run in parallel (pytest -n 2) on 2 cores


def data_root() -> Path | None:
    root = os.environ.get("FEDSKEW_DATA")
    return Path(root) if root else None


requires_data = pytest.mark.skipif(
    data_root() is None, reason="needs real datasets: set FEDSKEW_DATA (e.g. ../shared/data); CI sets it"
)


def digits_config(**over) -> dict:
    """A fast digits federation; keyword arguments replace top-level sections / keys."""
    cfg = {
        "seed": 0,
        "rounds": 3,
        "data": {"dataset": "digits", "num_clients": 5, "partition": {"name": "dirichlet", "alpha": 0.5}},
        "model": {"name": "mlp_mpfedcl"},
        "algorithm": {"name": "fedavg"},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.5},
        "eval": {"protocol": "global", "every": 1},
        "checkpoint": {"every": 1},
    }
    cfg.update(over)
    return cfg
