"""Real MNIST / Fashion-MNIST from ``$FEDSKEW_DATA`` (skipped when unset) and the bundled digits (always)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fedskew.data import files
from fedskew.data.datasets import FASHION_NORM, MNIST_NORM, channel_stats, load_dataset

ROOT = os.environ.get("FEDSKEW_DATA")
needs_data = pytest.mark.skipif(
    not ROOT, reason="needs real MNIST / Fashion-MNIST: set FEDSKEW_DATA (e.g. ../shared/data)"
)

# Published per-class counts (yann.lecun.com/exdb/mnist; Fashion-MNIST is balanced by construction).
MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _check_common(d, name: str) -> None:
    assert d.name == name
    assert d.x_train.shape == (60000, 1, 28, 28) and d.x_test.shape == (10000, 1, 28, 28)
    assert d.x_train.dtype == torch.uint8 and d.y_train.dtype == torch.int64
    assert d.num_classes == 10 and len(d.classes) == 10


@needs_data
def test_real_mnist():
    d = load_dataset("mnist", ROOT, verify=True)  # official checksums (or the payload's) must pass
    _check_common(d, "mnist")
    assert torch.bincount(d.y_train).tolist() == MNIST_TRAIN
    assert torch.bincount(d.y_test).tolist() == MNIST_TEST
    mean, std = channel_stats(d.x_train)
    assert mean[0] == pytest.approx(MNIST_NORM[0][0], abs=1e-3) and std[0] == pytest.approx(
        MNIST_NORM[1][0], abs=1e-3
    )
    # upright digits: ink sits in the centre, the 4-pixel border is almost empty
    avg = d.x_train[:2000, 0].float().mean(0)
    assert avg[10:18, 10:18].mean() > 20 * avg[:4].mean()


@needs_data
def test_real_fashion_mnist():
    d = load_dataset("fashion_mnist", ROOT)
    _check_common(d, "fashion_mnist")
    assert torch.bincount(d.y_train).tolist() == [6000] * 10
    assert torch.bincount(d.y_test).tolist() == [1000] * 10
    mean, std = channel_stats(d.x_train)
    assert mean[0] == pytest.approx(FASHION_NORM[0][0], abs=1e-3)
    assert std[0] == pytest.approx(FASHION_NORM[1][0], abs=1e-3)


@needs_data
def test_real_files_match_the_official_payload_checksums():
    root = Path(ROOT)
    for name in ("mnist", "fashion_mnist"):
        for f in files.FILES[name].files:
            files.verify(root / f.path, f.digest, payload_digest=f.payload_digest)


def test_digits_offline():
    d = load_dataset("digits")
    assert d.x_train.shape == (1437, 1, 8, 8) and d.x_test.shape == (360, 1, 8, 8)
    assert d.x_train.dtype == torch.uint8 and d.y_train.dtype == torch.int64
    assert int(d.x_train.max()) == 255 and int(d.x_train.min()) == 0  # 0..16 scaled to 0..255
    assert torch.bincount(d.y_test, minlength=10).min() >= 35  # stratified: ~36 per class
    x = d.to_float(d.x_train)
    assert abs(x.mean().item()) < 1e-3 and x.std().item() == pytest.approx(1.0, abs=1e-3)
    again = load_dataset("digits")
    assert torch.equal(again.y_test, d.y_test)  # fixed seeded split
