"""``imagefolder``: both layouts built on the fly (train/test folders, CoOp split file), grey/RGB, resizing,
the decode cache, errors, and a federated round end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from fedskew.cli import app
from fedskew.data import images, load_dataset
from fedskew.data.datasets.imagefolder import image_cache
from fedskew.errors import ConfigError, DataError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment

CLASSES = ("cat", "dog", "fox")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch) -> Path:
    """Decoded images of these throw-away folders go to a throw-away cache, not ~/.cache."""
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("FEDSKEW_CACHE", str(cache))
    return cache


def pixels(label: int, i: int, side: int, grey: bool) -> np.ndarray:
    """A deterministic image whose content depends on (class, index): PNG keeps it exactly."""
    rng = np.random.default_rng(100 * label + i)
    shape = (side, side) if grey else (side, side, 3)
    return (rng.integers(0, 60, shape) + 60 * label).astype(np.uint8)


def make_folder(
    base: Path, *, grey: bool = False, per_class: tuple[int, int] = (4, 2), side: int = 10
) -> dict:
    """``base/{train,test}/<class>/<i>.png`` and return ``{(split, class, i): array}``."""
    made = {}
    for split, n in zip(("train", "test"), per_class, strict=True):
        for label, cls in enumerate(CLASSES):
            (base / split / cls).mkdir(parents=True)
            for i in range(n):
                arr = pixels(label, i + 10 * (split == "test"), side, grey)
                Image.fromarray(arr).save(base / split / cls / f"{i}.png")
                made[(split, cls, i)] = arr
    return made


def test_train_test_layout_reads_pixels_labels_and_class_names(tmp_path):
    made = make_folder(tmp_path / "tiny")
    (tmp_path / "tiny" / "train" / "notes.txt").write_text("not an image")
    ds = load_dataset("imagefolder", tmp_path, path="tiny")
    assert ds.class_names == list(CLASSES) and ds.num_classes == 3
    assert ds.x_train.shape == (12, 3, 10, 10) and ds.x_test.shape == (6, 3, 10, 10)
    assert ds.x_train.dtype == torch.uint8 and ds.y_train.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # sorted listing: train/dog/2.png is the 7th training image
    assert np.array_equal(ds.x_train[6].permute(1, 2, 0).numpy(), made[("train", "dog", 2)])
    assert np.array_equal(ds.x_test[5].permute(1, 2, 0).numpy(), made[("test", "fox", 1)])
    x = ds.to_float(ds.x_train)
    assert x.mean((0, 2, 3)).abs().max() < 1e-3  # exact training statistics normalise to mean 0


def test_absolute_path_and_jpeg_images(tmp_path):
    base = tmp_path / "elsewhere"
    for split in ("train", "test"):
        for label, cls in enumerate(CLASSES):
            (base / split / cls).mkdir(parents=True)
            Image.fromarray(pixels(label, 0, 16, grey=False)).save(base / split / cls / "a.jpeg", quality=95)
    ds = load_dataset("imagefolder", tmp_path / "root", path=str(base))
    assert ds.x_train.shape == (3, 3, 16, 16) and ds.y_test.tolist() == [0, 1, 2]
    err = (ds.x_train[1].permute(1, 2, 0).float() - torch.from_numpy(pixels(1, 0, 16, False)).float()).abs()
    assert err.mean() < 12  # lossy JPEG, but the same picture


def test_grey_images_give_one_channel_unless_mode_forces_rgb(tmp_path):
    make_folder(tmp_path / "g", grey=True)
    assert load_dataset("imagefolder", tmp_path, path="g").in_shape == (1, 10, 10)
    rgb = load_dataset("imagefolder", tmp_path, path="g", mode="RGB")
    assert rgb.in_shape == (3, 10, 10) and torch.equal(rgb.x_train[:, 0], rgb.x_train[:, 2])
    with pytest.raises(ConfigError, match="mode must be one of L, RGB"):
        load_dataset("imagefolder", tmp_path, path="g", mode="CMYK")


def test_different_sizes_need_the_size_option(tmp_path):
    make_folder(tmp_path / "m")
    Image.fromarray(pixels(0, 99, 14, False)).save(tmp_path / "m" / "train" / "cat" / "big.png")
    with pytest.raises(ConfigError, match=r"different sizes .*data\.options\.size"):
        load_dataset("imagefolder", tmp_path, path="m")
    ds = load_dataset("imagefolder", tmp_path, path="m", size=6)
    assert ds.in_shape == (3, 6, 6) and len(ds.y_train) == 13


def coop_folder(tmp_path: Path) -> Path:
    """CoOp layout: ``Caltech/101_ObjectCategories/<class>/*`` plus ``split_zhou_Caltech.json``."""
    img = tmp_path / "Caltech" / "101_ObjectCategories"
    split: dict[str, list] = {"train": [], "val": [], "test": []}
    names = ("zebra", "accordion")  # label order differs from alphabetical order
    for label, cls in enumerate(names):
        (img / cls).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(pixels(label, i, 8, grey=False)).save(img / cls / f"image_{i:04d}.jpg")
            part = "train" if i < 2 else "val" if i == 2 else "test"
            split[part].append([f"{cls}/image_{i:04d}.jpg", label, cls])
    (tmp_path / "Caltech" / "split_zhou_Caltech.json").write_text(json.dumps(split))
    return img


def test_coop_split_file_orders_classes_by_label_and_ignores_val(tmp_path):
    coop_folder(tmp_path)
    opts = {"path": "Caltech/101_ObjectCategories", "split_file": "Caltech/split_zhou_Caltech.json"}
    ds = load_dataset("imagefolder", tmp_path, **opts)
    assert ds.class_names == ["zebra", "accordion"]
    assert ds.y_train.tolist() == [0, 0, 1, 1] and ds.y_test.tolist() == [0, 0, 1, 1]
    with_val = load_dataset("imagefolder", tmp_path, val_to_train=True, **opts)
    assert with_val.y_train.tolist() == [0, 0, 1, 1, 0, 1]
    assert torch.equal(with_val.x_test, ds.x_test)


def test_coop_split_file_errors_name_the_problem(tmp_path):
    img = coop_folder(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train": [["zebra/image_0000.jpg", 0]], "test": []}))
    with pytest.raises(DataError, match="not a CoOp split file"):
        load_dataset("imagefolder", tmp_path, path=str(img), split_file=str(bad))
    bad.write_text(json.dumps({"train": [["zebra/nope.jpg", 0, "zebra"]], "test": []}))
    with pytest.raises(DataError, match="1 images listed .* missing"):
        load_dataset("imagefolder", tmp_path, path=str(img), split_file=str(bad))


def test_layout_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"needs data\.options\.path"):
        load_dataset("imagefolder", tmp_path)
    with pytest.raises(DataError, match="not found"):
        load_dataset("imagefolder", tmp_path, path="absent")
    (tmp_path / "flat" / "cat").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no train/ and test/ sub-folders .*split_file"):
        load_dataset("imagefolder", tmp_path, path="flat")


def test_cache_is_reused_rebuilt_when_corrupted_and_keyed_by_the_files(tmp_path, monkeypatch, private_cache):
    make_folder(tmp_path / "c")
    first = load_dataset("imagefolder", tmp_path, path="c")
    folder = image_cache(tmp_path / "c")
    cached = list(folder.glob("imagefolder-*.pt"))
    assert len(cached) == 1 and folder.is_relative_to(private_cache)

    def no_decode(*a, **k):
        raise AssertionError("decoded again despite the cache")

    with monkeypatch.context() as m:
        m.setattr(images, "decode", no_decode)
        again = load_dataset("imagefolder", tmp_path, path="c")
    assert torch.equal(again.x_train, first.x_train) and torch.equal(again.x_test, first.x_test)
    cached[0].write_bytes(cached[0].read_bytes()[:100])  # truncated
    rebuilt = load_dataset("imagefolder", tmp_path, path="c")
    assert torch.equal(rebuilt.x_train, first.x_train)
    Image.fromarray(np.zeros((10, 10, 3), np.uint8)).save(tmp_path / "c" / "train" / "cat" / "0.png")
    changed = load_dataset("imagefolder", tmp_path, path="c")
    assert int(changed.x_train[0].sum()) == 0 and len(list(folder.glob("*.pt"))) == 2
    before = sorted(private_cache.rglob("*"))
    nocache = load_dataset("imagefolder", tmp_path / "r2", path=str(tmp_path / "c"), cache=False)
    assert torch.equal(nocache.x_train, changed.x_train) and not (tmp_path / "r2").exists()
    assert sorted(private_cache.rglob("*")) == before  # cache: false writes nothing at all


def test_list_shows_the_new_sources():
    res = CliRunner().invoke(app, ["list"])
    assert res.exit_code == 0 and "imagefolder" in res.stdout and "hf" in res.stdout.split()


def test_federated_round_on_an_image_folder(tmp_path):
    make_folder(tmp_path / "tiny", per_class=(8, 4))
    cfg = build_config(
        {
            "seed": 0,
            "rounds": 5,
            "data": {
                "dataset": "imagefolder",
                "root": str(tmp_path),
                "options": {"path": "tiny"},
                "num_clients": 3,
                "partition": {"name": "iid"},
            },
            "model": {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
            "algorithm": {"name": "fedavg"},
            "client": {"epochs": 1, "batch_size": 8, "lr": 0.05},
            "eval": {"protocol": "global", "every": 1},
        }
    )
    summary = run_experiment(cfg)
    assert summary["rounds"] == 5 and summary["final"]["accuracy"] > 0.34  # above chance (1/3): it learns
