"""digit_domains: deterministic, balanced, real digits, and domains that differ in low-level statistics."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from fedskew.data import load_dataset
from fedskew.errors import ConfigError
from tests.conftest import requires_data

OFFLINE = {"domains": ["usps_like", "synth_digits"], "train_per_domain": 300, "test_per_domain": 100}


def test_offline_domains_shapes_balance_and_ids():
    ds = load_dataset("digit_domains", **OFFLINE)
    assert ds.x_train.shape == (600, 3, 28, 28) and ds.x_train.dtype == torch.uint8
    assert ds.domain_names == ["usps_like", "synth_digits"]
    assert torch.bincount(ds.domain_train).tolist() == [300, 300]
    for d in range(2):
        assert torch.bincount(ds.y_train[ds.domain_train == d], minlength=10).tolist() == [30] * 10
    assert torch.bincount(ds.domain_test).tolist() == [100, 100]


def test_deterministic_per_seed():
    a = load_dataset("digit_domains", **OFFLINE, seed=3)
    b = load_dataset("digit_domains", **OFFLINE, seed=3)
    c = load_dataset("digit_domains", **OFFLINE, seed=4)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
    assert not torch.equal(a.x_train, c.x_train)


def test_domains_differ_in_low_level_statistics():
    ds = load_dataset("digit_domains", **OFFLINE)
    means = [ds.x_train[ds.domain_train == d].float().mean().item() for d in range(2)]
    colour_spread = [ds.x_train[ds.domain_train == d].float().std((1,)).mean().item() for d in range(2)]
    assert abs(means[0] - means[1]) > 20  # grey strokes on black vs coloured renders
    assert colour_spread[0] < 1e-6 < colour_spread[1]  # usps_like is grey, synth_digits is coloured


def test_synth_digits_are_real_digits():
    ds = load_dataset("digit_domains", domains=["synth_digits"], train_per_domain=600, test_per_domain=200)

    def feats(x):
        g = x.float().mean(1, keepdim=True) / 255
        g = g - g.mean((2, 3), keepdim=True)
        # polarity varies (light on dark and dark on light): flip so the strokes (the minority, skewed tail)
        # are positive
        g = g * torch.sign(g.flatten(1).pow(3).mean(1)).view(-1, 1, 1, 1)
        return torch.nn.functional.avg_pool2d(g, 2).flatten(1).numpy()  # 14x14

    clf = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=30))
    with warnings.catch_warnings():  # 30 iterations is plenty here; convergence is not the point
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(feats(ds.x_train), ds.y_train.numpy())
    acc = clf.score(feats(ds.x_test), ds.y_test.numpy())
    assert acc > 0.5, acc  # chance is 0.1


def test_bad_options():
    with pytest.raises(ConfigError, match="unknown domain"):
        load_dataset("digit_domains", domains=["usps"])
    with pytest.raises(ConfigError, match=">= 10"):
        load_dataset("digit_domains", domains=["usps_like"], train_per_domain=5)


@requires_data
def test_mnist_and_mnist_m_from_real_mnist():
    ds = load_dataset("digit_domains", domains=["mnist", "mnist_m"], train_per_domain=200, test_per_domain=50)
    m, mm = (ds.x_train[ds.domain_train == d].float() for d in range(2))
    assert m.std(1).max() == 0  # grey
    assert mm.std(1).mean() > 5  # coloured photo patches
    # MNIST-M keeps the MNIST stroke: |patch - digit| differs most from the patch where the digit is bright
    assert mm.mean() > m.mean()


def test_stratified_uses_a_small_class_whole_before_repeating():
    from fedskew.data.datasets.digit_domains import _stratified

    labels = torch.as_tensor(np.repeat(np.arange(10), 7))
    idx = _stratified(labels, 20, np.random.default_rng(0))
    assert torch.bincount(labels[idx], minlength=10).tolist() == [20] * 10
    counts = np.bincount(idx, minlength=70)
    assert counts.min() == 2 and counts.max() == 3  # 20 = 2 * 7 + 6: every image twice, six three times


def test_missing_mnist_names_the_domains_that_need_it(tmp_path, monkeypatch):
    from fedskew.data import files
    from fedskew.errors import DataError

    monkeypatch.setattr(files, "OFFLINE", True)
    with pytest.raises(DataError, match=r"'mnist' and 'mnist_m' need MNIST .*usps_like"):
        load_dataset("digit_domains", root=tmp_path, train_per_domain=20, test_per_domain=10)
