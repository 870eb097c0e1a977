"""``hf``: tiny Hugging Face datasets built on the fly (save_to_disk and parquet; PIL images and arrays),
the export of client index lists that ``Dataset.select`` consumes, and a federated round."""

from __future__ import annotations

import builtins

import numpy as np
import pytest
import torch
from PIL import Image

from fedskew.data import build_federated, load_dataset
from fedskew.data.export import read_partition_indices, write_partition_indices
from fedskew.errors import ConfigError, DataError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment

datasets = pytest.importorskip("datasets")  # the optional extra: pip install 'fedskew[hf]'

NAMES = ["ant", "bee", "cow"]


def picture(label: int, i: int, grey: bool = False) -> np.ndarray:
    rng = np.random.default_rng(7 * label + 1000 * i)
    return (rng.integers(0, 80, (9, 9) if grey else (9, 9, 3)) + 80 * label).astype(np.uint8)


def split(n: int, offset: int, *, grey: bool = False, arrays: bool = False):
    labels = [i % 3 for i in range(n)]
    pics = [picture(y, i + offset, grey) for i, y in enumerate(labels)]
    image = (
        datasets.Array3D((9, 9, 3), "uint8") if arrays else datasets.Image()
    )  # stored arrays or an Image feature
    features = datasets.Features({"img": image, "y": datasets.ClassLabel(names=NAMES)})
    column = pics if arrays else [Image.fromarray(p) for p in pics]
    return datasets.Dataset.from_dict({"img": column, "y": labels}, features=features), pics


@pytest.fixture
def saved(tmp_path):
    train, pics = split(24, 0)
    test, _ = split(9, 500)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "tiny_hf"))
    return tmp_path, pics


def load(root, **kw):
    return load_dataset("hf", root, image_column="img", label_column="y", **kw)


def test_save_to_disk_folder_reads_images_labels_and_class_names(saved):
    root, pics = saved
    ds = load(root, path="tiny_hf")
    assert ds.class_names == NAMES and ds.num_classes == 3
    assert ds.x_train.shape == (24, 3, 9, 9) and ds.x_test.shape == (9, 3, 9, 9)
    assert ds.y_train.tolist() == [i % 3 for i in range(24)]
    assert np.array_equal(ds.x_train[5].permute(1, 2, 0).numpy(), pics[5])
    assert load(root, path="tiny_hf", size=4, mode="L").in_shape == (1, 4, 4)


def test_parquet_files_and_array_columns(tmp_path):
    train, pics = split(12, 0, arrays=True)
    test, _ = split(6, 77, arrays=True)
    (tmp_path / "pq" / "data").mkdir(parents=True)
    train.to_parquet(str(tmp_path / "pq" / "data" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(tmp_path / "pq" / "data" / "test-00000-of-00001.parquet"))
    ds = load(tmp_path, path="pq")
    assert ds.x_train.shape == (12, 3, 9, 9) and ds.y_test.tolist() == [0, 1, 2, 0, 1, 2]
    assert np.array_equal(ds.x_train[3].permute(1, 2, 0).numpy(), pics[3])
    assert load(tmp_path, path="pq", size=5).in_shape == (3, 5, 5)
    by_glob = load(tmp_path, path=str(tmp_path / "pq" / "*" / "*.parquet"))
    assert torch.equal(by_glob.x_test, ds.x_test) and by_glob.class_names == NAMES


def test_grey_pil_images_give_one_channel(tmp_path):
    train, _ = split(6, 0, grey=True)
    test, _ = split(3, 9, grey=True)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "g"))
    assert load(tmp_path, path="g").in_shape == (1, 9, 9)


def test_errors_name_the_option(saved, monkeypatch):
    root, _ = saved
    with pytest.raises(ConfigError, match=r"column 'pixels' not found \(data\.options\.image_column\)"):
        load_dataset("hf", root, path="tiny_hf", image_column="pixels", label_column="y")
    with pytest.raises(ConfigError, match="split 'validation' not in .*available: train, test"):
        load(root, path="tiny_hf", test_split="validation")
    with pytest.raises(DataError, match="not found"):
        load(root, path="nowhere")
    real_import = builtins.__import__

    def no_datasets(name, *a, **k):
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ConfigError, match=r"pip install 'fedskew\[hf\]'"):
        load(root, path="tiny_hf")


def test_exported_indices_select_the_clients_rows(saved, tmp_path):
    root, _ = saved
    ds = load(root, path="tiny_hf")
    fd = build_federated(ds, 4, {"name": "dirichlet", "alpha": 0.5, "min_size": 1}, 3, val_fraction=0.2)
    spec = read_partition_indices(write_partition_indices(fd, tmp_path / "out" / "clients.json"))
    assert spec["num_clients"] == 4 and spec["partition"]["name"] == "dirichlet"
    hf = datasets.load_from_disk(str(root / "tiny_hf"))
    for i, client in enumerate(spec["clients"]):
        rows = hf["train"].select(client["train"])
        assert rows["y"] == ds.y_train[fd.train_idx[i]].tolist()
        got = np.stack([np.asarray(im) for im in rows["img"]]).transpose(0, 3, 1, 2)
        assert np.array_equal(got, ds.x_train[fd.train_idx[i]].numpy())
        assert hf["test"].select(client["test"])["y"] == ds.y_test[fd.test_idx[i]].tolist()
        assert client["val"] == fd.val_idx[i].tolist()


def test_federated_round_on_a_hf_dataset(saved):
    root, _ = saved
    options = {"path": "tiny_hf", "image_column": "img", "label_column": "y"}
    data = {
        "dataset": "hf",
        "root": str(root),
        "options": options,
        "num_clients": 2,
        "partition": {"name": "iid"},
    }
    cfg = build_config(
        {
            "seed": 1,
            "rounds": 1,
            "data": data,
            "model": {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
            "algorithm": {"name": "fedavg"},
            "client": {"epochs": 1, "batch_size": 8, "lr": 0.05},
        }
    )
    assert torch.isfinite(torch.tensor(run_experiment(cfg)["final"]["accuracy"]))
