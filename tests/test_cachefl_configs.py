"""CacheFL's paper-setting configs run end to end on a tiny generated image folder in CoOp's layout, with a
random-weight CLIP checkpoint and the procedural generator in place of DALL·E images."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedskew.experiment.config import load_config
from fedskew.experiment.runner import run_experiment

CONFIGS = Path(__file__).parents[1] / "configs" / "cachefl"
TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Decoded images and features of the throw-away root go to a throw-away cache, not ~/.cache."""
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path_factory.mktemp("cache")))


def tiny_caltech(root: Path, classes: int = 3, per_class: int = 6) -> None:
    """``caltech-101/101_ObjectCategories/<class>/<i>.jpg`` and a CoOp split file (train/val/test)."""
    base = root / "caltech-101" / "101_ObjectCategories"
    rng = np.random.default_rng(0)
    entries: dict[str, list] = {"train": [], "val": [], "test": []}
    for c in range(classes):
        name = f"class_{c}"
        (base / name).mkdir(parents=True)
        for i in range(per_class):
            img = (rng.random((40, 40, 3)) * 80 + c * 60).astype(np.uint8)
            Image.fromarray(img).save(base / name / f"{i}.png")
            split = "train" if i < 3 else ("val" if i == 3 else "test")
            entries[split].append([f"{name}/{i}.png", c, name])
    (root / "caltech-101" / "split_zhou_Caltech101.json").write_text(json.dumps(entries))


@pytest.mark.skipif(importlib.util.find_spec("open_clip") is None, reason="needs the [clip] extra")
def test_the_caltech101_config_runs_on_a_tiny_folder_with_a_random_clip(tmp_path):
    tiny_caltech(tmp_path)
    open_clip = pytest.importorskip("fedskew.models.clip_compat").import_open_clip()
    torch.manual_seed(0)
    (tmp_path / "clip").mkdir()
    torch.save(open_clip.model.CLIP(**TINY).state_dict(), tmp_path / "clip" / "RN50.pt")
    overrides = [
        f"data.root={tmp_path}",
        "data.options.size=32",
        "data.shots=3",
        "data.val_shots=1",  # the tiny split file's val split holds 1 image per class
        "data.num_clients=3",
        "data.vision_language.backbone.options.model=null",
        "data.vision_language.backbone.options.pretrained=null",
        f"data.vision_language.backbone.options.model_config={json.dumps(TINY)}",
        "data.vision_language.generator={name: procedural}",
        "data.vision_language.shots=2",
        "rounds=2",
    ]
    cfg = load_config(CONFIGS / "caltech101-iid.yaml", overrides)
    assert (cfg.algorithm.hyper()["alpha"], cfg.algorithm.hyper()["beta"]) == (3.0, 1.0)  # Appendix B.2
    summary = run_experiment(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and 0.0 <= summary["final"]["accuracy"] <= 1.0
    assert records[-1]["round_params_up"] == 3 * 16 * 3 * 2  # clients · C · N · K
