"""NIID-Bench's noise-based feature skew: client i's training inputs get N(0, (σ·i/(N−1))²) on the pixel
scale before normalisation; labels, partition and test set are unchanged."""

from __future__ import annotations

import pytest
import torch

from fedskew.data.base import Dataset
from fedskew.data.federated import build_federated
from fedskew.data.noise import noise_levels, with_feature_noise
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from tests.conftest import digits_config


def constant_images(n: int = 400, value: int = 128) -> Dataset:
    x = torch.full((n, 1, 6, 6), value, dtype=torch.uint8)
    y = torch.arange(n) % 4
    return Dataset("flat", x, y, x[:40].clone(), y[:40].clone(), 4, mean=(0.5,), std=(0.25,))


def test_levels_grow_linearly_from_a_clean_first_client():
    assert noise_levels(0.1, 5) == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])
    assert noise_levels(0.3, 1) == [0.0]


def test_each_clients_noise_has_its_level_and_the_test_set_stays_clean():
    fed = build_federated(constant_images(), 5, {"name": "iid"}, seed=3)
    noisy = with_feature_noise(fed, 0.4)
    x = noisy.dataset.x_train
    clean = (128 / 255 - 0.5) / 0.25  # a constant pixel, normalised
    for cid, level in enumerate(noise_levels(0.4, 5)):
        rows = x[fed.train_idx[cid]]
        # noise of std `level` on the [0, 1] scale is `level / 0.25` after normalisation
        assert rows.mean().item() == pytest.approx(clean, abs=0.05 + level)
        assert rows.std().item() == pytest.approx(level / 0.25, rel=0.1, abs=1e-6)
    assert torch.allclose(noisy.dataset.x_test, torch.full_like(noisy.dataset.x_test, clean), atol=1e-5)
    assert torch.equal(noisy.dataset.y_train, fed.dataset.y_train)
    assert [t.tolist() for t in noisy.train_idx] == [t.tolist() for t in fed.train_idx]
    assert noisy.dataset.normaliser()(x[:3]).equal(x[:3])  # stored normalised: reading changes nothing


def test_the_noise_is_a_function_of_the_seed():
    fed = build_federated(constant_images(), 4, {"name": "iid"}, seed=1)
    a, b = with_feature_noise(fed, 0.2), with_feature_noise(fed, 0.2)
    assert torch.equal(a.dataset.x_train, b.dataset.x_train)
    assert with_feature_noise(fed, 0.0) is fed


def test_features_that_are_not_pixels_are_refused():
    ds = constant_images()
    fed = build_federated(
        Dataset("f", ds.x_train.float(), ds.y_train, ds.x_test.float(), ds.y_test, 4), 2, {"name": "iid"}, 0
    )
    with pytest.raises(ConfigError, match="needs image data stored as uint8"):
        with_feature_noise(fed, 0.1)


def test_a_run_with_feature_noise_trains(tmp_path):
    cfg = digits_config(rounds=2, data={"dataset": "digits", "num_clients": 4, "feature_noise": 0.1})
    run_experiment(build_config(cfg), tmp_path)
    assert (tmp_path / "summary.json").is_file()
