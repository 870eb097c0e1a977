"""Every dataset loader against small fixture files written in the exact standard format, plus the data-root
helpers: checksums and their cache, downloads (through a fake opener: no network), and error messages."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import fedskew.data.datasets as ds
from fedskew.data import checksums, files
from fedskew.data.base import DATASETS
from fedskew.errors import ConfigError, DataError

REGISTERED = {
    "digits", "mnist", "fashion_mnist", "emnist_balanced", "emnist_letters", "femnist",
    "cifar10", "cifar100", "svhn", "office10", "domainnet",
}  # fmt: skip


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any download attempt fails like an offline machine would."""

    def offline(url, timeout=None):
        raise OSError(f"network disabled in tests ({url})")

    monkeypatch.setattr(files, "URLOPEN", offline)
    monkeypatch.setattr(files, "OFFLINE", False)
    monkeypatch.setattr(files, "VERIFY", True)
    checksums.forget()


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch) -> Path:
    """Stamps and decoded images of these throw-away roots go to a throw-away cache, not ~/.cache."""
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("FEDSKEW_CACHE", str(cache))
    return cache


# ------------------------------------------------------------------------------------------ fixture writers
def write_idx(path: Path, arr: np.ndarray) -> None:
    """IDX (``0 0 0x08 ndim``, big-endian uint32 dims, uint8 data), gzipped."""
    header = bytes([0, 0, 0x08, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(header + arr.astype(np.uint8).tobytes()))


def make_idx_set(folder: Path, prefix: str, n_train: int, n_test: int, labels) -> dict[str, np.ndarray]:
    """Images whose pixel (h, w) = (10 * i + h + w) mod 256 for sample i, so layout errors show."""
    out = {}
    for part, n in (("train", n_train), ("test" if prefix else "t10k", n_test)):
        i, h, w = np.meshgrid(np.arange(n), np.arange(28), np.arange(28), indexing="ij")
        x = ((10 * i + h + w) % 256).astype(np.uint8)
        y = np.asarray(labels(n), dtype=np.uint8)
        write_idx(folder / f"{prefix}{part}-images-idx3-ubyte.gz", x)
        write_idx(folder / f"{prefix}{part}-labels-idx1-ubyte.gz", y)
        out[part] = (x, y)
    return out


# ----------------------------------------------------------------------------------------------- registry
def test_all_loaders_registered_and_documented():
    assert set(DATASETS.names()) >= REGISTERED
    for name in REGISTERED:
        assert DATASETS.summary(name), name


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        ds.load_dataset("mnsit")
    msg = str(err.value)
    assert "did you mean 'mnist'" in msg
    for name in ("cifar10", "digits", "femnist", "svhn"):
        assert name in msg


def test_unknown_option_lists_allowed(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown option 'verfy'.*allowed: verify, download"):
        ds.load_dataset("mnist", tmp_path, verfy=False)


# ------------------------------------------------------------------------------------------------ MNIST-like
@pytest.mark.parametrize(
    ("name", "folder", "norm"),
    [("mnist", "mnist", ds.MNIST_NORM), ("fashion_mnist", "fashion-mnist", ds.FASHION_NORM)],
)
def test_mnist_family_from_idx_gz(tmp_path, name, folder, norm):
    raw = make_idx_set(tmp_path / folder, "", 12, 5, lambda n: np.arange(n) % 10)
    d = ds.load_dataset(name, tmp_path, verify=False)
    assert d.x_train.shape == (12, 1, 28, 28) and d.x_test.shape == (5, 1, 28, 28)
    assert d.x_train.dtype == torch.uint8 and d.y_train.dtype == torch.int64
    assert torch.equal(d.x_train[:, 0], torch.from_numpy(raw["train"][0]))
    assert d.x_train[3, 0, 2, 5].item() == 37  # 10*3 + 2 + 5: rows stay rows
    assert d.y_train.tolist() == [i % 10 for i in range(12)]
    assert d.num_classes == 10 and (d.mean, d.std) == norm
    assert d.x_train.is_contiguous()
    d.x_train[0, 0, 0, 0] = 1  # owned, writable memory (not a view of read-only bytes)


def test_emnist_orientation_and_label_maps(tmp_path):
    upright = np.zeros((28, 28), dtype=np.uint8)
    upright[0, :] = 255  # a bar along the top row
    stored = upright.T  # EMNIST files hold the transpose: the bar sits in the left column
    folder = tmp_path / "emnist"
    for split, labels in (("balanced", np.arange(47)), ("letters", np.arange(1, 27))):
        for part in ("train", "test"):
            n = labels.size
            write_idx(folder / f"emnist-{split}-{part}-images-idx3-ubyte.gz", np.repeat(stored[None], n, 0))
            write_idx(folder / f"emnist-{split}-{part}-labels-idx1-ubyte.gz", labels)
    bal = ds.load_dataset("emnist_balanced", tmp_path, verify=False)
    assert bal.num_classes == 47 and len(bal.classes) == 47 and bal.classes[10] == "A"
    assert bal.x_train[0, 0, 0].tolist() == [255] * 28  # top row bright: orientation fixed
    assert bal.x_train[0, 0, 1:].sum().item() == 0
    assert bal.y_train.tolist() == list(range(47))
    let = ds.load_dataset("emnist_letters", tmp_path, verify=False)
    assert let.num_classes == 26 and let.y_train.tolist() == list(range(26))  # 1..26 -> 0..25
    assert let.x_test[5, 0, 0].tolist() == [255] * 28
    # exact training-set stats: one bright row of 28 -> mean 1/28
    assert let.mean[0] == pytest.approx(1 / 28, abs=1e-4)
    assert let.std[0] == pytest.approx((1 / 28 * 27 / 28) ** 0.5, abs=1e-4)
    sub = ds.load_dataset("emnist_balanced", tmp_path, verify=False, letters_only=True)
    assert sub.num_classes == 37 and sub.y_train.tolist() == list(range(37)) and sub.classes[0] == "A"


def test_emnist_letters_label_out_of_range_is_an_error(tmp_path):
    folder = tmp_path / "emnist"
    for part in ("train", "test"):
        write_idx(folder / f"emnist-letters-{part}-images-idx3-ubyte.gz", np.zeros((2, 28, 28)))
        write_idx(folder / f"emnist-letters-{part}-labels-idx1-ubyte.gz", np.array([0, 3]))  # 0 invalid
    with pytest.raises(DataError, match="emnist-letters-train-labels-idx1-ubyte.gz"):
        ds.load_dataset("emnist_letters", tmp_path, verify=False)


# -------------------------------------------------------------------------------------------------- CIFAR
def write_cifar(path: Path, data: np.ndarray, labels, key: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"x", b"data": data, key: list(labels)}, f, protocol=2)


def test_cifar10_pickle_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (4, 3072), dtype=np.uint8) for _ in range(6)]
    for i in range(5):
        write_cifar(folder / f"data_batch_{i + 1}", batches[i], [(i + k) % 10 for k in range(4)], b"labels")
    write_cifar(folder / "test_batch", batches[5], [9, 8, 7, 6], b"labels")
    d = ds.load_dataset("cifar10", tmp_path, verify=False)
    assert d.x_train.shape == (20, 3, 32, 32) and d.x_test.shape == (4, 3, 32, 32)
    assert d.y_train[:8].tolist() == [0, 1, 2, 3, 1, 2, 3, 4] and d.y_test.tolist() == [9, 8, 7, 6]
    # row layout: 1024 red, then green, then blue, each row-major 32x32
    first = batches[0][1]
    assert d.x_train[1, 1, 2, 3].item() == first[1024 + 2 * 32 + 3]
    assert d.x_train[1, 2, 31, 0].item() == first[2048 + 31 * 32]
    assert d.classes == ds.CIFAR10_NAMES and (d.mean, d.std) == ds.CIFAR10_NORM


def test_cifar100_fine_labels_and_meta_names(tmp_path):
    folder = tmp_path / "cifar-100-python"
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    write_cifar(folder / "train", data, [99, 0], b"fine_labels")
    write_cifar(folder / "test", data[:1], [42], b"fine_labels")
    with open(folder / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}, f)
    d = ds.load_dataset("cifar100", tmp_path, verify=False)
    assert d.num_classes == 100 and d.y_train.tolist() == [99, 0] and d.y_test.tolist() == [42]
    assert d.classes[99] == "c99" and d.x_train.shape == (2, 3, 32, 32)


def test_corrupted_cifar_pickle_names_the_file(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(b"\x80\x02garbage")
    (folder / "test").write_bytes(b"")
    with pytest.raises(DataError, match=r"cifar-100-python/train"):
        ds.load_dataset("cifar100", tmp_path, verify=False)


# --------------------------------------------------------------------------------------------------- SVHN
def test_svhn_mat_layout_and_label_10_is_zero(tmp_path):
    from scipy.io import savemat

    rng = np.random.default_rng(1)
    folder = tmp_path / "svhn"
    folder.mkdir()
    X = rng.integers(0, 256, (32, 32, 3, 5), dtype=np.uint8)
    savemat(folder / "train_32x32.mat", {"X": X, "y": np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)})
    savemat(folder / "test_32x32.mat", {"X": X[..., :2], "y": np.array([[3], [10]], dtype=np.uint8)})
    d = ds.load_dataset("svhn", tmp_path, verify=False)
    assert d.x_train.shape == (5, 3, 32, 32) and d.x_train.dtype == torch.uint8
    assert d.y_train.tolist() == [0, 1, 2, 0, 9] and d.y_test.tolist() == [3, 0]
    assert torch.equal(
        d.x_train[4], torch.from_numpy(X[..., 4].transpose(2, 0, 1).copy())
    )  # [h,w,c]->[c,h,w]


# ------------------------------------------------------------------------------------------------- FEMNIST
def write_leaf(path: Path, users: dict[str, tuple[np.ndarray, list[int]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x.tolist(), "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(blob))


def test_femnist_leaf_json_keeps_writers(tmp_path):
    def imgs(n, v):
        return np.full((n, 784), v, dtype=np.float64)

    base = tmp_path / "femnist"
    write_leaf(
        base / "train" / "a.json",
        {"f0001_00": (imgs(3, 1.0), [0, 61, 10]), "f0002_11": (imgs(2, 0.0), [5, 5])},
    )
    write_leaf(base / "train" / "b.json", {"f0003_22": (imgs(1, 0.5), [36])})
    write_leaf(
        base / "test" / "a.json", {"f0002_11": (imgs(1, 0.0), [7]), "f0001_00": (imgs(2, 1.0), [1, 2])}
    )
    d = ds.load_dataset("femnist", tmp_path)
    assert d.num_classes == 62 and d.classes[10] == "A" and d.classes[36] == "a"
    assert d.x_train.shape == (6, 1, 28, 28) and d.x_train.dtype == torch.uint8
    assert d.x_train[:, 0, 0, 0].tolist() == [255, 255, 255, 0, 0, 128]  # 0.5 -> 127.5 rounds to even 128
    assert d.y_train.tolist() == [0, 61, 10, 5, 5, 36]
    names = d.meta["writer_names"]
    assert names == ["f0001_00", "f0002_11", "f0003_22"]
    wtr, wte = d.meta["writer_train"], d.meta["writer_test"]
    assert wtr.dtype == torch.int64 and [names[i] for i in wtr] == ["f0001_00"] * 3 + ["f0002_11"] * 2 + [
        "f0003_22"
    ]
    assert [names[i] for i in wte] == ["f0002_11", "f0001_00", "f0001_00"]  # same id space across splits


def test_femnist_missing_names_layout(tmp_path):
    with pytest.raises(DataError, match=r"train/\*\.json.*femnist.*FEDSKEW_DATA"):
        ds.load_dataset("femnist", tmp_path)


# -------------------------------------------------------------------------------------------- image folders
def colour(ci: int, di: int) -> tuple[int, int, int]:
    return (20 * ci, 100 + 50 * di, 7)


def write_images(folder: Path, n: int, rgb: tuple[int, int, int], size: int = 12) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        Image.new("RGB", (size + k, size), rgb).save(
            folder / f"img{k}.jpg" if k % 2 else folder / f"img{k}.png"
        )


def test_office10_folders_split_resize_and_domains(tmp_path):
    base = tmp_path / "office_caltech_10"
    for di, dom in enumerate(("amazon", "webcam")):
        for ci, cls in enumerate(ds.OFFICE10_CLASSES):
            write_images(base / dom / cls, 5, colour(ci, di))
    d = ds.load_dataset("office10", tmp_path, domains=["amazon", "webcam"], size=8, train_fraction=0.8)
    assert d.x_train.shape == (80, 3, 8, 8) and d.x_test.shape == (20, 3, 8, 8)  # 4 + 1 per (domain, class)
    assert d.domain_names == ["amazon", "webcam"] and d.classes == list(ds.OFFICE10_CLASSES)
    assert (d.mean, d.std) == ds.IMAGENET_NORM
    for x, y, dom in ((d.x_train, d.y_train, d.domain_train), (d.x_test, d.y_test, d.domain_test)):
        expect = torch.tensor(
            [colour(int(c), int(k)) for c, k in zip(y, dom, strict=True)], dtype=torch.float32
        )
        got = x.float().mean(dim=(2, 3))  # each image is one solid colour, which encodes (class, domain)
        assert torch.allclose(got, expect, atol=3)  # JPEG rounding
    counts = torch.bincount(d.domain_test * 10 + d.y_test, minlength=20)
    assert counts.tolist() == [1] * 20
    again = ds.load_dataset("office10", tmp_path, domains=["amazon", "webcam"], size=8)
    assert torch.equal(again.x_test, d.x_test) and torch.equal(again.y_test, d.y_test)
    other = ds.load_dataset("office10", tmp_path, domains=["webcam"], size=8, split_seed=3)
    assert other.domain_names == ["webcam"] and other.domain_train.unique().tolist() == [0]


def test_office10_explicit_split_folders(tmp_path):
    base = tmp_path / "office_caltech_10" / "dslr"
    for ci, cls in enumerate(ds.OFFICE10_CLASSES):
        write_images(base / "train" / cls, 3, colour(ci, 0))
        write_images(base / "test" / cls, 1, colour(ci, 0))
    d = ds.load_dataset("office10", tmp_path, domains=["dslr"], size=4)
    assert d.y_train.shape == (30,) and d.y_test.tolist() == list(range(10))


def test_domainnet_official_split_lists(tmp_path):
    base = tmp_path / "domainnet"
    lines = {"train": [], "test": []}
    for ci, cls in enumerate((*ds.DOMAINNET_CLASSES, "aircraft_carrier")):
        write_images(base / "clipart" / cls, 3, colour(ci % 10, 0))
        lines["train"] += [f"clipart/{cls}/img0.png {ci}", f"clipart/{cls}/img1.jpg {ci}"]
        lines["test"] += [f"clipart/{cls}/img2.png {ci}"]
    for part, ls in lines.items():
        (base / f"clipart_{part}.txt").write_text("\n".join(ls) + "\n")
    d = ds.load_dataset("domainnet", tmp_path, domains=["clipart"], size=6)
    assert d.x_train.shape == (20, 3, 6, 6) and d.y_test.tolist() == list(range(10))  # extra class ignored
    assert d.domain_names == ["clipart"]


def test_unknown_domain_lists_valid(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown domain 'dlsr' \(did you mean 'dslr'\?\); valid: amazon"):
        ds.load_dataset("office10", tmp_path, domains=["dlsr"])


def test_image_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(DataError, match=r"office_caltech_10.*not found.*<domain>/<class>"):
        ds.load_dataset("office10", tmp_path)
    write_images(tmp_path / "office_caltech_10" / "amazon" / "bike", 2, (1, 2, 3))
    with pytest.raises(DataError, match=r"class folders back_pack, calculator.*amazon"):
        ds.load_dataset("office10", tmp_path, domains=["amazon"])
    for cls in ds.OFFICE10_CLASSES:
        write_images(tmp_path / "office_caltech_10" / "amazon" / cls, 2, (1, 2, 3))
    (tmp_path / "office_caltech_10" / "amazon" / "mug" / "img0.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"cannot decode image .*mug/img0.png"):
        ds.load_dataset("office10", tmp_path, domains=["amazon"])


def test_stratified_split_is_per_group_and_seeded():
    groups = np.repeat(np.arange(5), [10, 5, 1, 4, 2])
    mask = ds.stratified_split(groups, 0.6, seed=0)
    assert [int(mask[groups == g].sum()) for g in range(5)] == [6, 3, 1, 2, 1]
    high = ds.stratified_split(groups, 0.95, seed=0)  # groups of >= 2 always keep one test sample
    assert [int(high[groups == g].sum()) for g in range(5)] == [9, 4, 1, 3, 1]
    assert np.array_equal(mask, ds.stratified_split(groups, 0.6, seed=0))
    assert not np.array_equal(mask, ds.stratified_split(groups, 0.6, seed=1))


def test_channel_stats_hand_checked():
    x = torch.zeros(2, 2, 2, 2, dtype=torch.uint8)
    x[:, 0, 0] = 255  # channel 0: half the pixels 255 -> mean 0.5, std 0.5; channel 1 all zero
    assert ds.channel_stats(x) == ((0.5, 0.0), (0.5, 0.0))


# ------------------------------------------------------------------------------------------- broken files
def test_truncated_gzip_names_the_file(tmp_path):
    make_idx_set(tmp_path / "mnist", "", 4, 2, lambda n: np.zeros(n))
    p = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz.*truncated"):
        ds.load_dataset("mnist", tmp_path, verify=False)


def test_idx_payload_shorter_than_header_declares(tmp_path):
    make_idx_set(tmp_path / "mnist", "", 4, 2, lambda n: np.zeros(n))
    p = tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(gzip.decompress(p.read_bytes())[:-100]))  # valid gzip, short payload
    with pytest.raises(
        DataError, match=r"t10k-images-idx3-ubyte\.gz is truncated or corrupted.*\(2, 28, 28\)"
    ):
        ds.load_dataset("mnist", tmp_path, verify=False)


def test_checksum_mismatch_names_the_file(tmp_path):
    make_idx_set(tmp_path / "mnist", "", 4, 2, lambda n: np.zeros(n))
    with pytest.raises(DataError, match=r"checksum mismatch for .*mnist/train-images-idx3-ubyte\.gz: md5"):
        ds.load_dataset("mnist", tmp_path)  # verify defaults to on: hand-made files are not the official ones


def test_missing_files_name_files_folder_and_settings(tmp_path):
    with pytest.raises(DataError) as err:
        ds.load_dataset("mnist", tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", str(tmp_path / "mnist"),
                 "download failed", "FEDSKEW_DATA", "data.root"):  # fmt: skip
        assert part in msg
    with pytest.raises(DataError, match=r"missing test_32x32\.mat .*svhn \(downloads disabled\)"):
        (tmp_path / "svhn").mkdir()
        (tmp_path / "svhn" / "train_32x32.mat").write_bytes(b"")
        ds.load_dataset("svhn", tmp_path, download=False)


# ------------------------------------------------------------------------------------ checksums and cache
def test_verify_accepts_caches_and_rejects(tmp_path, monkeypatch, private_cache):
    p = tmp_path / "blob.bin"
    p.write_bytes(b"hello fedskew")
    good = "sha256:" + hashlib.sha256(b"hello fedskew").hexdigest()
    files.verify(p, good)
    stamp = files.stamp_path(p)
    assert stamp.is_relative_to(private_cache) and not (tmp_path / files.STAMP).exists()  # not next to it
    assert json.loads(stamp.read_text())["blob.bin"]["digest"] == good
    checksums.forget()

    def no_rehash(*a, **k):
        raise AssertionError("rehashed a file whose stamp is valid")

    monkeypatch.setattr(checksums, "file_digest", no_rehash)
    files.verify(p, good)  # answered by the stamp on disk
    monkeypatch.undo()
    p.write_bytes(b"hello fedskeW!")  # size changes: stamp no longer applies
    with pytest.raises(DataError, match=r"checksum mismatch for .*blob\.bin: sha256"):
        files.verify(p, good)
    with pytest.raises(DataError, match="blob.bin: md5"):
        files.verify(p, "md5:" + "0" * 32)


def test_verify_accepts_recompressed_gzip_by_payload(tmp_path):
    payload = bytes(range(256)) * 40
    p = tmp_path / "x.gz"
    p.write_bytes(gzip.compress(payload, compresslevel=1, mtime=123))
    official = "md5:" + hashlib.md5(gzip.compress(payload, mtime=0)).hexdigest()  # other gzip bytes
    files.verify(p, official, payload_digest="md5:" + hashlib.md5(payload).hexdigest())
    with pytest.raises(DataError, match="x.gz"):
        files.verify(p, official, payload_digest="md5:" + "1" * 32)


def test_verify_in_memory_when_the_cache_is_read_only(tmp_path, monkeypatch):
    p = tmp_path / "ro.bin"
    p.write_bytes(b"abc")
    digest = "md5:" + hashlib.md5(b"abc").hexdigest()
    monkeypatch.setattr(files.tempfile, "mkstemp", lambda **k: (_ for _ in ()).throw(PermissionError("ro")))
    files.verify(p, digest)
    assert not files.stamp_path(p).exists() and not (tmp_path / files.STAMP).exists()
    monkeypatch.setattr(files, "file_digest", lambda *a, **k: pytest.fail("rehashed"))
    files.verify(p, digest)  # answered by the in-process memo


# ------------------------------------------------------------------------------------------------ download
class FakeWeb:
    """Stands in for ``urllib.request.urlopen``: serves bytes by URL and records requests."""

    def __init__(self, pages: dict[str, bytes]):
        self.pages, self.seen = pages, []

    def __call__(self, url, timeout=None):
        self.seen.append((url, timeout))
        if url not in self.pages:
            raise OSError(f"404 {url}")
        return io.BytesIO(self.pages[url])


def test_fetch_direct_files_tries_mirrors_and_verifies(tmp_path, monkeypatch):
    body = b"official bytes"
    spec = files.DatasetFiles(
        "toy",
        (
            files.FileSpec(
                "toy/a.bin", "md5:" + hashlib.md5(body).hexdigest(), urls=("http://a/x", "http://b/x")
            ),
        ),
        "http://example.org",
    )
    monkeypatch.setitem(files.FILES, "toy", spec)
    web = FakeWeb({"http://b/x": body})
    monkeypatch.setattr(files, "URLOPEN", web)
    assert files.fetch("toy", tmp_path) == tmp_path / "toy"
    assert (tmp_path / "toy" / "a.bin").read_bytes() == body
    assert [u for u, _ in web.seen] == ["http://a/x", "http://b/x"] and web.seen[0][
        1
    ] == files.DOWNLOAD_TIMEOUT
    (tmp_path / "toy" / "a.bin").unlink()
    monkeypatch.setattr(files, "URLOPEN", FakeWeb({"http://a/x": b"tampered"}))
    with pytest.raises(DataError, match="checksum mismatch"):
        files.fetch("toy", tmp_path)
    assert not (tmp_path / "toy" / "a.bin").exists()  # a bad download is not left behind


def test_fetch_archive_extracts_only_expected_members(tmp_path, monkeypatch):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("pack/good.bin", b"good"), ("../evil.bin", b"evil"), ("pack/extra.bin", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    archive = buf.getvalue()
    spec = files.DatasetFiles(
        "pack",
        (files.FileSpec("pack/good.bin"),),
        "http://example.org",
        files.Archive("http://h/pack.tar.gz", "sha256:" + hashlib.sha256(archive).hexdigest()),
    )
    monkeypatch.setitem(files.FILES, "pack", spec)
    monkeypatch.setattr(files, "URLOPEN", FakeWeb({"http://h/pack.tar.gz": archive}))
    root = tmp_path / "root"
    files.fetch("pack", root)
    assert (root / "pack" / "good.bin").read_bytes() == b"good"
    assert not (root / "pack" / "extra.bin").exists() and not (tmp_path / "evil.bin").exists()
    assert sorted(p.name for p in root.iterdir()) == ["pack"]  # the archive itself was a temporary


def test_fetch_respects_offline_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "OFFLINE", True)
    monkeypatch.setattr(files, "URLOPEN", lambda *a, **k: pytest.fail("went online"))
    with pytest.raises(DataError, match=r"missing .*train_32x32\.mat.*FEDSKEW_OFFLINE=1"):
        files.fetch("svhn", tmp_path)


def test_known_files_table_is_well_formed():
    for name, spec in files.FILES.items():
        assert name in DATASETS, name
        for f in spec.files:
            assert f.path.startswith(spec.folder + "/")
            for d in (f.digest, f.payload_digest):
                if d:
                    algo, hexd = d.split(":")
                    assert len(hexd) == {"md5": 32, "sha256": 64}[algo]
        assert spec.downloadable


def test_digits_split_is_cached_and_a_corrupt_cache_is_rebuilt(tmp_path, monkeypatch):
    from sklearn.datasets import load_digits

    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path))
    first = ds.digits(test_size=300, split_seed=3)
    (cached,) = list(tmp_path.glob("digits-*-300-3.pt"))
    again = ds.digits(test_size=300, split_seed=3)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert (len(first.y_train), len(first.y_test)) == (1797 - 300, 300)
    # stratified: every class keeps its share of the test set within one sample
    counts = np.bincount(load_digits().target, minlength=10)
    assert np.all(np.abs(np.bincount(first.y_test.numpy(), minlength=10) - counts * 300 / 1797) <= 1)
    cached.write_bytes(b"not a torch file")
    rebuilt = ds.digits(test_size=300, split_seed=3)
    assert torch.equal(rebuilt.x_test, first.x_test)
    assert cached.stat().st_size > 1000
