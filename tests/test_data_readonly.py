"""The data root is only read: checksum stamps, decoded images and encoded features go to the cache root
(``$FEDSKEW_CACHE``), keyed by the source folder, and a read-only data root loads as well as a writable one.

Tests run as root, where ``chmod a-w`` stops no write: each test both makes its root read-only (a real guard
for other users) and compares a snapshot of the tree (every path, size, mtime, mode) before and after.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedskew.data import checksums, files, images, load_dataset
from fedskew.data.cache import derived_dir
from fedskew.data.datasets.imagefolder import image_cache
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data
from fedskew.models.backbones.open_clip_backbone import OpenCLIPBackbone
from fedskew.models.vision_language import feature_cache
from tests.conftest import VL_WORLD, data_root, digits_config, requires_data, tree_changes, tree_snapshot

MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")  # fmt: skip

Freeze = Callable[[Path], dict]


@pytest.fixture
def cache(tmp_path_factory, monkeypatch) -> Path:
    """A private, empty ``$FEDSKEW_CACHE`` for the test."""
    folder = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("FEDSKEW_CACHE", str(folder))
    checksums.forget()  # no pass remembered from another test: stamps are looked up on disk
    return folder


@pytest.fixture
def freeze(tmp_path_factory) -> Iterator[Freeze]:
    """``freeze(root)``: make a temporary tree read-only (``a-w``) and return its snapshot; write permission
    comes back at teardown so pytest can delete it."""
    base = tmp_path_factory.getbasetemp().resolve()
    frozen: list[Path] = []

    def chmod_tree(root: Path, change: Callable[[int], int]) -> None:
        for folder, dirs, names in os.walk(root):
            for p in (Path(folder), *(Path(folder) / n for n in dirs + names)):
                p.chmod(change(stat.S_IMODE(p.lstat().st_mode)))

    def apply(root: Path) -> dict:
        assert root.resolve().is_relative_to(base), "only temporary trees are frozen"
        frozen.append(root)
        chmod_tree(root, lambda mode: mode & ~0o222)
        return tree_snapshot(root)

    yield apply
    for root in frozen:
        chmod_tree(root, lambda mode: mode | stat.S_IWUSR)


def write_idx(path: Path, arr: np.ndarray) -> None:
    """A gzipped IDX file (``0 0 0x08 ndim``, big-endian uint32 dims, uint8 data)."""
    header = bytes([0, 0, 0x08, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(header + arr.astype(np.uint8).tobytes(), mtime=0))


def tiny_mnist(root: Path, seed: int = 0, n_train: int = 40, n_test: int = 20) -> None:
    """``root/mnist/`` with the four IDX files of a tiny, valid MNIST-format set."""
    rng = np.random.default_rng(seed)
    for part, n in (("train", n_train), ("t10k", n_test)):
        write_idx(root / "mnist" / f"{part}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(root / "mnist" / f"{part}-labels-idx1-ubyte.gz", np.arange(n) % 10)


def trust_these_mnist_files(root: Path, monkeypatch) -> None:
    """Make the files under ``root/mnist`` the "official" ones, so verification (and its stamps) runs."""
    spec = files.FILES["mnist"]
    own = tuple(
        dataclasses.replace(
            f, digest="md5:" + hashlib.md5((root / f.path).read_bytes()).hexdigest(), payload_digest=None
        )
        for f in spec.files
    )
    monkeypatch.setitem(files.FILES, "mnist", dataclasses.replace(spec, files=own))
    monkeypatch.setattr(files, "VERIFY", True)


def no_rehash(*args, **kwargs):
    raise AssertionError("rehashed a file whose pass is stamped in the cache")


def assert_stamped_in_cache(root: Path, cache: Path) -> None:
    """Every MNIST file has a stamp entry, in the cache, and no stamp lies in the root."""
    stamp = files.stamp_path(root / "mnist" / MNIST_FILES[0])
    assert stamp.is_relative_to(cache) and stamp.parent == derived_dir(root / "mnist")
    table = checksums._stamp_table(stamp)
    assert sorted(table) == sorted(MNIST_FILES)
    assert not list(root.rglob("*verified*"))


# ----------------------------------------------------------------------------------------------- MNIST
def test_a_read_only_mnist_root_loads_and_its_checksum_stamps_go_to_the_cache(
    tmp_path, cache, freeze, monkeypatch
):
    root = tmp_path / "data"
    tiny_mnist(root)
    trust_these_mnist_files(root, monkeypatch)
    before = freeze(root)
    d = load_dataset("mnist", root, download=False)
    assert d.x_train.shape == (40, 1, 28, 28) and d.x_test.shape == (20, 1, 28, 28)
    assert tree_changes(before, tree_snapshot(root)) == []
    assert_stamped_in_cache(root, cache)
    checksums.forget()  # a new process: only the stamps on disk remember the passes
    monkeypatch.setattr(checksums, "file_digest", no_rehash)
    again = load_dataset("mnist", root, download=False)
    assert torch.equal(again.x_train, d.x_train)
    assert tree_changes(before, tree_snapshot(root)) == []


@requires_data
def test_a_read_only_copy_of_the_real_mnist_verifies_without_writing(tmp_path, cache, freeze, monkeypatch):
    root = tmp_path / "data"
    (root / "mnist").mkdir(parents=True)
    for name in MNIST_FILES:  # a copy: the shared root itself is never chmod-ed
        shutil.copyfile(data_root() / "mnist" / name, root / "mnist" / name)
    monkeypatch.setattr(files, "VERIFY", True)
    before = freeze(root)
    d = load_dataset("mnist", root, verify=True, download=False)  # the official checksums
    assert d.x_train.shape == (60000, 1, 28, 28)
    assert tree_changes(before, tree_snapshot(root)) == []
    assert_stamped_in_cache(root, cache)
    checksums.forget()
    monkeypatch.setattr(checksums, "file_digest", no_rehash)
    load_dataset("mnist", root, verify=True, download=False)
    assert tree_changes(before, tree_snapshot(root)) == []


# ---------------------------------------------------------------------------------------- image folder
def make_pictures(base: Path, shade: int = 0) -> None:
    """``base/{train,test}/{a,b}/<i>.png``: tiny 6x6 RGB images (``shade`` tells two folders apart)."""
    rng = np.random.default_rng(shade)
    for split, n in (("train", 3), ("test", 2)):
        for c in ("a", "b"):
            (base / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = (rng.integers(0, 100, (6, 6, 3)) + shade).astype(np.uint8)
                Image.fromarray(pixels).save(base / split / c / f"{i}.png")


def test_a_read_only_image_folder_loads_and_its_decode_cache_is_under_the_cache_root(
    tmp_path, cache, freeze, monkeypatch
):
    root = tmp_path / "data"
    make_pictures(root / "pics")
    before = freeze(root)
    first = load_dataset("imagefolder", root, path="pics")
    assert first.x_train.shape == (6, 3, 6, 6)
    assert tree_changes(before, tree_snapshot(root)) == []
    (saved,) = image_cache(root / "pics").glob("imagefolder-*.pt")
    assert saved.is_relative_to(cache)
    stamp = saved.stat().st_mtime_ns
    monkeypatch.setattr(images, "decode", lambda *a, **k: pytest.fail("decoded again despite the cache"))
    again = load_dataset("imagefolder", root, path="pics")
    assert torch.equal(again.x_train, first.x_train) and torch.equal(again.x_test, first.x_test)
    assert saved.stat().st_mtime_ns == stamp
    assert tree_changes(before, tree_snapshot(root)) == []


# -------------------------------------------------------------------------------------- CacheFL features
def vl_config(root: Path, cache: bool = True) -> dict:
    """Tiny MNIST (``verify: false``) through the random CLIP and the procedural generator."""
    data = {
        "dataset": "mnist",
        "root": str(root),
        "options": {"verify": False, "download": False},
        "num_clients": 2,
        "partition": {"name": "iid"},
        "vision_language": {**VL_WORLD, "cache": cache},
    }
    return digits_config(data=data, model={"name": "identity"}, algorithm={"name": "cachefl"})


@pytest.fixture
def encodings(monkeypatch) -> list[str]:
    """The splits the backbone encoded images of, in call order."""
    calls: list[str] = []
    encode = OpenCLIPBackbone.encode_images

    def counting(self, images, split, rows=None):
        calls.append(split)
        return encode(self, images, split, rows)

    monkeypatch.setattr(OpenCLIPBackbone, "encode_images", counting)
    return calls


def test_cachefl_features_of_a_read_only_root_are_cached_under_the_cache_root_and_reused(
    tmp_path, cache, freeze, encodings
):
    root = tmp_path / "data"
    tiny_mnist(root)
    before = freeze(root)
    cfg = build_config(vl_config(root))
    first = build_data(cfg)
    assert sorted(encodings) == ["synthetic", "test", "train"]
    assert tree_changes(before, tree_snapshot(root)) == []
    saved = sorted(feature_cache(root).glob("open_clip-*.pt"))
    assert len(saved) == 3 and all(p.is_relative_to(cache) for p in saved)
    times = [p.stat().st_mtime_ns for p in saved]
    encodings.clear()
    again = build_data(cfg)
    assert encodings == []  # nothing encoded again: every split came from the cache
    assert [p.stat().st_mtime_ns for p in saved] == times
    assert torch.equal(again.dataset.x_test, first.dataset.x_test)
    assert torch.equal(again.dataset.meta["assets"]["cache_x"], first.dataset.meta["assets"]["cache_x"])
    assert tree_changes(before, tree_snapshot(root)) == []


def test_cache_false_and_an_unwritable_cache_write_nothing_and_still_load(
    tmp_path, cache, monkeypatch, encodings
):
    root = tmp_path / "data"
    tiny_mnist(root)
    make_pictures(root / "pics")
    before = tree_snapshot(root)
    build_data(build_config(vl_config(root, cache=False)))
    assert not any(cache.iterdir())  # vision_language.cache: false keeps nothing on disk
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("FEDSKEW_CACHE", str(blocker / "cache"))  # mkdir fails, even for root
    encodings.clear()
    out = build_data(build_config(vl_config(root)))
    assert sorted(encodings) == ["synthetic", "test", "train"] and out.dataset.x_test.shape[0] == 20
    assert load_dataset("imagefolder", root, path="pics").x_train.shape == (6, 3, 6, 6)
    assert tree_changes(before, tree_snapshot(root)) == [] and blocker.read_text() == ""


# ------------------------------------------------------------------------------------------ no collisions
def test_two_data_roots_with_the_same_name_never_share_a_cache_folder(tmp_path, cache, freeze, monkeypatch):
    roots = [tmp_path / "a" / "data", tmp_path / "b" / "data"]
    for shade, root in enumerate(roots):
        make_pictures(root / "pics", shade=100 * shade)
        (root / "mnist").mkdir()
        (root / "mnist" / "blob.bin").write_bytes(bytes([shade]) * 8)  # same name and size, other bytes
    snaps = [freeze(root) for root in roots]
    folders = [derived_dir(root) for root in roots]
    assert folders[0] != folders[1] and all(f.name.startswith("data-") for f in folders)
    assert feature_cache(roots[0]) != feature_cache(roots[1])
    loaded = [load_dataset("imagefolder", root, path="pics") for root in roots]
    assert not torch.equal(loaded[0].x_train, loaded[1].x_train)
    assert all(len(list(image_cache(root / "pics").glob("*.pt"))) == 1 for root in roots)
    monkeypatch.setattr(images, "decode", lambda *a, **k: pytest.fail("decoded again despite the cache"))
    for root, want in zip(roots, loaded, strict=True):  # each root reads back its own images
        assert torch.equal(load_dataset("imagefolder", root, path="pics").x_train, want.x_train)
    blobs = [root / "mnist" / "blob.bin" for root in roots]
    digests = ["sha256:" + hashlib.sha256(b.read_bytes()).hexdigest() for b in blobs]
    for blob, digest in zip(blobs, digests, strict=True):
        files.verify(blob, digest)
    assert files.stamp_path(blobs[0]) != files.stamp_path(blobs[1])
    assert [checksums._stamp_table(files.stamp_path(b))["blob.bin"]["digest"] for b in blobs] == digests
    assert all(tree_changes(s, tree_snapshot(r)) == [] for s, r in zip(snaps, roots, strict=True))
