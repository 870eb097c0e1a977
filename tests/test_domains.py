"""digit_domains, what tests/test_digit_domains.py leaves open: real-data recipes checked on stand-in data.

MNIST and SVHN are replaced by tiny hand-made sources (constant images whose value encodes the label), so the
``mnist`` / ``mnist_m`` / ``svhn`` recipes, the default-domain rules and the missing-file errors run offline;
the real-data statistics test needs ``$FEDSKEW_DATA``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.data import DATASETS, Dataset, files, load_dataset
from fedskew.errors import DataError
from tests.conftest import requires_data

SMALL = {"train_per_domain": 100, "test_per_domain": 50}
OFFLINE = ["usps_like", "synth_digits"]


def _fake_mnist(root: Path, **_: object) -> Dataset:
    """Imbalanced labels (class c has 12 + 3c train images); odd digits are all-255 images, even all-0."""
    y_tr = torch.as_tensor(np.repeat(np.arange(10), 12 + 3 * np.arange(10)))
    y_te = torch.as_tensor(np.repeat(np.arange(10), 7))
    img = lambda y: (y % 2 * 255).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 1, 28, 28).contiguous()  # noqa: E731
    return Dataset("mnist", img(y_tr), y_tr, img(y_te), y_te, 10)


@pytest.fixture
def fake_mnist():
    with DATASETS.replaced("mnist", _fake_mnist):
        yield


@pytest.fixture
def offline(monkeypatch):
    """No download attempts: missing files fail at once instead of after a network timeout."""
    monkeypatch.setattr(files, "OFFLINE", True)


def _write_fake_svhn(root: Path, monkeypatch) -> None:
    """SVHN-format .mat files (X [32, 32, 3, N], y with 10 for digit 0) whose red channel is 20 * digit."""
    from scipy.io import savemat

    monkeypatch.setattr(files, "VERIFY", False)  # the official MD5s cannot match hand-made files
    (root / "svhn").mkdir(parents=True)
    for name, per_class in (("train_32x32.mat", 15), ("test_32x32.mat", 6)):
        digit = np.repeat(np.arange(10), per_class)
        x = np.zeros((32, 32, 3, digit.size), dtype=np.uint8)
        x[:, :, 0] = (20 * digit).astype(np.uint8)
        x[:, :, 1] = 7
        savemat(root / "svhn" / name, {"X": x, "y": np.where(digit == 0, 10, digit)[:, None]})


def test_adding_a_domain_leaves_the_others_unchanged():
    one = load_dataset("digit_domains", domains=["synth_digits"], **SMALL, seed=5)
    two = load_dataset("digit_domains", domains=OFFLINE, **SMALL, seed=5)
    assert torch.equal(one.x_train, two.x_train[two.domain_train == 1])
    assert torch.equal(one.x_test, two.x_test[two.domain_test == 1])
    assert one.domain_train.unique().tolist() == [0] and two.domain_test.unique().tolist() == [0, 1]


def test_test_split_balanced_seeded_and_rounded_down_to_whole_classes():
    a = load_dataset("digit_domains", domains=OFFLINE, train_per_domain=40, test_per_domain=57, seed=1)
    b = load_dataset("digit_domains", domains=OFFLINE, train_per_domain=40, test_per_domain=57, seed=2)
    assert a.y_test.dtype == torch.int64 and a.domain_test.dtype == torch.int64
    for d in range(2):  # 57 -> 50: a balanced split needs whole classes
        assert torch.bincount(a.y_test[a.domain_test == d], minlength=10).tolist() == [5] * 10
    assert not torch.equal(a.x_test, b.x_test)


@pytest.mark.parametrize("size", [16, 64])
def test_size_option_and_normalisation(size):
    ds = load_dataset("digit_domains", domains=OFFLINE, train_per_domain=20, test_per_domain=10, size=size)
    assert ds.x_train.shape == (40, 3, size, size) and ds.in_shape == (3, size, size)
    x = ds.to_float(ds.x_train)
    assert x.min() >= -1 and x.max() <= 1 and x.min() < -0.9 and x.max() > 0.9  # mean 0.5, std 0.5


def test_usps_like_train_and_test_share_no_image_and_never_repeat_one():
    # 1,000 / 300 requested, more than the ~1,437 / ~360 real images give per class: extras are jittered
    ds = load_dataset("digit_domains", domains=["usps_like"], train_per_domain=1000, test_per_domain=300)
    rows = torch.cat([ds.x_train, ds.x_test])[:, 0].flatten(1).numpy()
    assert np.unique(rows, axis=0).shape[0] == len(rows)


def test_offline_domains_need_no_data_root(tmp_path, offline):
    ds = load_dataset("digit_domains", root=tmp_path, domains=["synth_digits", "usps_like"], **SMALL)
    assert ds.domain_names == ["synth_digits", "usps_like"] == ds.meta["domains_used"]


def test_missing_files_raise_data_error(tmp_path, offline):
    with pytest.raises(DataError, match="mnist"):  # default domains include mnist and mnist_m
        load_dataset("digit_domains", root=tmp_path, **SMALL)
    with pytest.raises(DataError, match="mnist"):
        load_dataset("digit_domains", root=tmp_path, domains=["mnist_m"], **SMALL)
    with pytest.raises(DataError, match="svhn"):  # asked for explicitly: an error, not a silent drop
        load_dataset("digit_domains", root=tmp_path, domains=["svhn"], **SMALL)


def test_mnist_domain_is_stratified_grey_rgb_and_keeps_labels_aligned(tmp_path, fake_mnist):
    ds = load_dataset("digit_domains", root=tmp_path, domains=["mnist"], **SMALL)
    assert torch.bincount(ds.y_train, minlength=10).tolist() == [10] * 10  # source was imbalanced
    assert torch.bincount(ds.y_test, minlength=10).tolist() == [5] * 10
    assert (ds.x_train == ds.x_train[:, :1]).all()  # grey replicated to 3 channels
    assert torch.equal(ds.x_train.flatten(1).float().mean(1), (ds.y_train % 2 * 255).float())


def test_mnist_m_is_abs_of_photo_patch_minus_digit(tmp_path, fake_mnist):
    """Ganin & Lempitsky's blend ``|patch - digit|``: digit 0 leaves the photo, digit 255 inverts it."""
    from sklearn.datasets import load_sample_images

    ds = load_dataset("digit_domains", root=tmp_path, domains=["mnist_m"], **SMALL)
    photos = np.concatenate([im.reshape(-1, 3) for im in load_sample_images().images]).astype(np.int64)
    code = lambda rgb: (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]  # noqa: E731
    palette = np.unique(code(photos))
    px = ds.x_train.permute(0, 2, 3, 1).numpy().astype(np.int64)  # [n, s, s, 3]
    odd = (ds.y_train % 2 == 1).numpy()
    recovered = np.where(odd[:, None, None, None], 255 - px, px)  # undo the blend with the known digit
    assert np.isin(code(recovered), palette).all()  # every pixel is a pixel of one of the photos
    # and the check has teeth: the inverted photo colours are mostly not photo colours themselves
    assert not np.isin(code(px[odd]), palette).all()
    assert (ds.x_train.float().std((1, 2, 3)) > 5).float().mean() > 0.9  # textured patches, not flat fills


def test_default_domains_include_svhn_only_when_present(tmp_path, fake_mnist, offline, monkeypatch):
    without = load_dataset("digit_domains", root=tmp_path, train_per_domain=20, test_per_domain=10)
    assert without.meta["domains_used"] == ["mnist", "usps_like", "synth_digits", "mnist_m"]
    _write_fake_svhn(tmp_path, monkeypatch)
    ds = load_dataset("digit_domains", root=tmp_path, train_per_domain=20, test_per_domain=10)
    assert ds.domain_names == ["mnist", "svhn", "usps_like", "synth_digits", "mnist_m"]
    assert ds.meta["domains_used"] == ds.domain_names
    assert torch.bincount(ds.domain_train).tolist() == [20] * 5


def test_svhn_domain_maps_label_10_to_0_and_keeps_pairs(tmp_path, offline, monkeypatch):
    _write_fake_svhn(tmp_path, monkeypatch)
    ds = load_dataset("digit_domains", root=tmp_path, domains=["svhn"], **SMALL)
    assert ds.x_train.shape == (100, 3, 28, 28)  # resized from 32x32
    assert torch.bincount(ds.y_train, minlength=10).tolist() == [10] * 10
    red = ds.x_train[:, 0].flatten(1)
    assert torch.equal(red.amin(1), red.amax(1)) and torch.equal(red[:, 0].long(), 20 * ds.y_train)
    assert (ds.x_train[:, 1] == 7).all()


@requires_data
def test_real_domains_differ_in_low_level_statistics():
    """The point of feature skew: per-domain colour mean / contrast / colourfulness differ pairwise."""
    ds = load_dataset("digit_domains", domains=["mnist", "usps_like", "synth_digits", "mnist_m"], **SMALL)
    stats = []
    for d in range(4):
        x = ds.x_train[ds.domain_train == d].float() / 255
        stats.append(torch.cat([x.mean((0, 2, 3)), x.std((2, 3)).mean(0), x.std(1).mean().view(1)]))
    stats = torch.stack(stats)  # [domain, mean RGB + per-image contrast RGB + colourfulness]
    gaps = torch.cdist(stats, stats) + torch.eye(4)
    assert gaps.min() > 0.1, stats
