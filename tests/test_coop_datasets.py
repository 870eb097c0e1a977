"""The 11 CoOp datasets in CoOp's layouts (tiny folders built on the fly), CoOp's ``val`` split as the
validation pool of ``build_federated``, decoding only one few-shot draw, ResNet-50, the CacheFL configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from fedskew.data import load_dataset
from fedskew.data.base import Dataset
from fedskew.data.datasets.coop import SPLIT_LAYOUTS
from fedskew.data.federated import build_federated
from fedskew.errors import ConfigError, DataError
from fedskew.experiment.config import load_config
from fedskew.models import MODELS, count_parameters

CONFIGS = Path(__file__).parents[1] / "configs" / "cachefl"
#: class names in label order: not alphabetical, with spaces (as CoOp's renamed EuroSAT classes)
NAMES = ("Sea or Lake", "Annual Crop Land", "forest")
COUNTS = {"train": 5, "val": 3, "test": 2}  # per class
IID = {"name": "iid_divmod"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Decoded images of these throw-away folders go to a throw-away cache, not ~/.cache."""
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path_factory.mktemp("cache")))


def save(path: Path, label: int, i: int) -> None:
    """An 8x8 PNG (PNG bytes whatever the suffix: exact pixels) whose top-left pixel encodes (label, i)."""
    arr = np.full((8, 8, 3), 30 * label, dtype=np.uint8)
    arr[0, 0] = (label, i, 7)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, format="PNG")


def split_layout(root: Path, name: str) -> None:
    """``<root>/<folder>/<images>/<class>/<part>_<i>.png`` + CoOp's split file for ``name``."""
    layout = SPLIT_LAYOUTS[name]
    images = root / layout.folder / layout.images
    table: dict[str, list] = {part: [] for part in COUNTS}
    for label, cls in enumerate(NAMES):
        for part, n in COUNTS.items():
            for i in range(n):
                rel = f"dir_{label}/{part}_{i}.png"
                save(images / rel, label, 10 * list(COUNTS).index(part) + i)
                table[part].append([rel, label, cls])
    (root / layout.folder / layout.split).write_text(json.dumps(table))


def aircraft_layout(root: Path) -> None:
    """``fgvc_aircraft/images/<id>.jpg``, ``variants.txt`` and ``images_variant_<part>.txt``."""
    base = root / "fgvc_aircraft"
    variants = ("F/A-18", "Boeing 707-320", "A300B4")
    base.mkdir(parents=True)
    (base / "variants.txt").write_text("\n".join(variants) + "\n")
    for part, n in COUNTS.items():
        lines = []
        for label, v in enumerate(variants):
            for i in range(n):
                image_id = f"{label}{list(COUNTS).index(part)}{i:02d}"
                save(base / "images" / f"{image_id}.jpg", label, i)
                lines.append(f"{image_id} {v}")
        (base / f"images_variant_{part}.txt").write_text("\n".join(lines) + "\n")


def imagenet_layout(root: Path) -> None:
    """``imagenet/images/{train,val}/<wnid>/*.JPEG`` + ``classnames.txt`` (lines not in wnid order)."""
    base = root / "imagenet"
    wnids = ("n0300", "n0100", "n0200")
    for label, w in enumerate(sorted(wnids)):
        for part, n in (("train", COUNTS["train"] + COUNTS["val"]), ("val", COUNTS["test"])):
            for i in range(n):
                save(base / "images" / part / w / f"{w}_{i}.JPEG", label, i)
    (base / "classnames.txt").write_text("n0300 great white shark\nn0100 tench\nn0200 goldfish\n")


BUILDERS = {name: (lambda root, n=name: split_layout(root, n)) for name in SPLIT_LAYOUTS}
BUILDERS["fgvc_aircraft"] = aircraft_layout
BUILDERS["imagenet"] = imagenet_layout
CLASS_NAMES = {name: list(NAMES) for name in SPLIT_LAYOUTS}
CLASS_NAMES["fgvc_aircraft"] = ["F/A-18", "Boeing 707-320", "A300B4"]
CLASS_NAMES["imagenet"] = ["tench", "goldfish", "great white shark"]  # by sorted wnid, named by the file


def load(root: Path, name: str, **options) -> Dataset:
    return load_dataset(name, root, size=8, **options)


def test_all_eleven_coop_datasets_are_registered():
    assert sorted(BUILDERS) == sorted(
        ["caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101", "fgvc_aircraft", "sun397",
         "dtd", "eurosat", "ucf101", "imagenet"]
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_each_coop_dataset_reads_its_layout_with_class_names_and_split_counts(tmp_path, name):
    BUILDERS[name](tmp_path)
    ds = load(tmp_path, name)
    assert ds.name == name and ds.class_names == CLASS_NAMES[name] and ds.num_classes == 3
    assert ds.in_shape == (3, 8, 8) and ds.x_train.dtype == torch.uint8
    train_val = COUNTS["train"] + COUNTS["val"]
    assert torch.bincount(ds.y_train).tolist() == [train_val] * 3
    assert torch.bincount(ds.y_test).tolist() == [COUNTS["test"]] * 3
    # the pixel tag says which file a row came from: labels travel with their images
    assert torch.equal(ds.x_train[:, 0, 0, 0].long(), ds.y_train)
    assert torch.equal(ds.x_test[:, 0, 0, 0].long(), ds.y_test)
    if name == "imagenet":  # no val split: the official val set is the test set
        assert ds.val_pool is None
    else:
        assert ds.val_pool is not None and torch.bincount(ds.y_train[ds.val_pool]).tolist() == [3, 3, 3]


def test_val_split_none_drops_coop_val(tmp_path):
    split_layout(tmp_path, "dtd")
    ds = load(tmp_path, "dtd", val_split="none")
    assert ds.val_pool is None and len(ds.y_train) == 3 * COUNTS["train"]
    with pytest.raises(ConfigError, match="val_split"):
        load(tmp_path, "dtd", val_split="test")


def test_coop_val_is_the_validation_pool_never_shots_nor_test(tmp_path):
    split_layout(tmp_path, "caltech101")
    ds = load(tmp_path, "caltech101")
    assert ds.val_pool is not None
    pool = set(torch.nonzero(ds.val_pool).flatten().tolist())
    for seed in range(4):
        fed = build_federated(ds, 3, IID, seed, shots=4, val_shots=2)
        train = torch.cat(fed.train_idx).tolist()
        val = torch.cat(fed.val_idx)
        assert len(train) == 12 and not pool & set(train)  # shots from CoOp's train split only
        assert len(val) > 0 and set(val.tolist()) <= pool  # validation from CoOp's val split only
        assert torch.bincount(ds.y_train[val], minlength=3).max() <= 2  # of a draw of 2 per class, dealt
    everything = build_federated(ds, 3, IID, 0)  # without shots the pool is not partitioned either
    assert sorted(torch.cat(everything.train_idx).tolist()) == sorted(set(range(len(ds.y_train))) - pool)


def test_a_pool_leaves_the_partition_of_the_other_rows_unchanged(tmp_path):
    split_layout(tmp_path, "eurosat")
    with_pool, without = load(tmp_path, "eurosat"), load(tmp_path, "eurosat", val_split="none")
    for part in (IID, {"name": "dirichlet", "alpha": 0.1, "min_size": 1}):
        a = build_federated(with_pool, 3, part, 1, shots=4, val_shots=1)
        b = build_federated(without, 3, part, 1, shots=4, val_shots=1)
        assert all(torch.equal(x, y) for x, y in zip(a.train_idx, b.train_idx, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(a.test_idx, b.test_idx, strict=True))
    # the normalisation comes from the training rows outside the pool
    assert with_pool.mean == pytest.approx(without.mean) and with_pool.std == pytest.approx(without.std)


def client_images(fed) -> list[tuple[Tensor, ...]]:
    x = fed.dataset.x_train
    return [(x[t], x[v]) for t, v in zip(fed.train_idx, fed.val_idx, strict=True)]


@pytest.mark.parametrize("name", ["food101", "imagenet"])
def test_decoding_one_few_shot_draw_gives_the_same_clients(tmp_path, name):
    BUILDERS[name](tmp_path)
    full = load(tmp_path, name)
    sub = load(tmp_path, name, shots_per_class=3, val_per_class=2, subset_seed=5)
    assert len(sub.y_train) == 3 * (3 + 2) and torch.equal(sub.x_test, full.x_test)
    part = {"name": "class_chunks"}
    a = build_federated(full, 3, part, 5, shots=3, val_shots=2)
    b = build_federated(sub, 3, part, 5, shots=3, val_shots=2)
    for (ta, va), (tb, vb) in zip(client_images(a), client_images(b), strict=True):
        assert torch.equal(ta, tb) and torch.equal(va, vb)
    with pytest.raises(ConfigError, match=r"subset_seed\).*seed=6"):
        build_federated(sub, 3, part, 6, shots=3, val_shots=2)
    with pytest.raises(ConfigError, match="val_per_class needs shots_per_class"):
        load(tmp_path, name, val_per_class=2)


def one_line_error(exc: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_missing_files_are_one_line_errors_naming_file_and_layout(tmp_path):
    with pytest.raises(DataError) as exc:
        load(tmp_path, "oxford_pets")
    one_line_error(exc, "split_zhou_OxfordPets.json not found", "oxford_pets/images/", "DATASETS.md")
    split_layout(tmp_path, "ucf101")
    (tmp_path / "ucf101" / "UCF-101-midframes" / "dir_1" / "val_2.png").unlink()
    with pytest.raises(DataError) as exc:
        load(tmp_path, "ucf101")
    one_line_error(exc, "1 images listed", "val_2.png", "UCF-101-midframes/")
    with pytest.raises(DataError) as exc:
        load(tmp_path, "fgvc_aircraft")
    one_line_error(exc, "variants.txt not found", "images_variant_{train,val,test}.txt")
    aircraft_layout(tmp_path)
    (tmp_path / "fgvc_aircraft" / "images_variant_val.txt").write_text("9999 Spitfire\n")
    with pytest.raises(DataError) as exc:
        load(tmp_path, "fgvc_aircraft")
    one_line_error(exc, "images_variant_val.txt", "'Spitfire'", "variants.txt")


def test_imagenet_layout_errors(tmp_path):
    with pytest.raises(DataError) as exc:
        load(tmp_path, "imagenet")
    one_line_error(exc, "classnames.txt not found", "imagenet/images/{train,val}/<wnid>")
    imagenet_layout(tmp_path)
    (tmp_path / "imagenet" / "classnames.txt").write_text("n0100 tench\nn0200 goldfish\n")
    with pytest.raises(DataError) as exc:
        load(tmp_path, "imagenet")
    one_line_error(exc, "does not name class n0300")
    with pytest.raises(ConfigError, match="unknown option 'val_split'"):
        load(tmp_path, "imagenet", val_split="coop")


def test_imagefolder_can_keep_the_split_file_val_as_pool(tmp_path):
    split_layout(tmp_path, "caltech101")
    folder = "caltech-101/101_ObjectCategories"
    opts = {"path": folder, "split_file": "caltech-101/split_zhou_Caltech101.json"}
    ignored = load_dataset("imagefolder", tmp_path, **opts)  # default: val ignored, as before
    pooled = load_dataset("imagefolder", tmp_path, val_split="coop", **opts)
    assert ignored.val_pool is None and len(ignored.y_train) == 15
    assert pooled.val_pool is not None and int(pooled.val_pool.sum()) == 9 and len(pooled.y_train) == 24
    with pytest.raises(ConfigError, match="val_to_train and val_split=coop"):
        load_dataset("imagefolder", tmp_path, val_split="coop", val_to_train=True, **opts)


def test_a_bad_val_pool_is_refused():
    x = torch.zeros(4, 1, 2, 2, dtype=torch.uint8)
    y = torch.tensor([0, 1, 0, 1])
    with pytest.raises(DataError, match="bool mask over the 4 training rows"):
        Dataset("t", x, y, x, y, 2, val_pool=torch.tensor([1, 0, 0, 1]))


def test_resnet50_has_torchvisions_parameter_count_and_runs_on_tiny_inputs():
    assert count_parameters(MODELS.get("resnet50")((3, 224, 224), 1000)) == 25_557_032
    torch.manual_seed(0)
    model = MODELS.get("resnet50")((3, 32, 32), 3, norm="group")
    x = torch.randn(2, 3, 32, 32)
    assert model.features(x).shape == (2, 2048) and model(x).shape == (2, 3)
    assert sum(1 for n, _ in model.named_parameters() if model.is_head(n)) == 2  # classifier weight + bias
    with pytest.raises(ConfigError, match="norm_groups"):
        MODELS.get("resnet50")((3, 32, 32), 3, norm="group", norm_groups=3)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_cachefl_config_validates(path):
    cfg = load_config(path)
    if cfg.data.dataset in BUILDERS:  # the real-CLIP configs share one template
        assert cfg.data.shots == 16 and cfg.data.num_clients == 10
        assert cfg.algorithm.name in ("cachefl", "fedavg", "fedprox")


def test_real_dataset_configs_cover_eleven_datasets_and_three_partitions():
    stems = {p.stem for p in CONFIGS.glob("*.yaml")}
    wanted = {f"{d}-{p}" for d in BUILDERS for p in ("iid", "dir", "pat")}
    assert wanted <= stems and len(wanted) == 33
    alphas = {d: load_config(CONFIGS / f"{d}-iid.yaml").algorithm.hyper()["alpha"] for d in BUILDERS}
    assert (alphas["caltech101"], alphas["dtd"], alphas["imagenet"]) == (3.0, 2.0, 0.6)  # App. B.2
