"""Text-to-image generators: ``fonts`` and ``folder`` (shapes, determinism, class dependence, errors)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import types
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from fedskew.data.base import load_dataset
from fedskew.data.generators import generate
from fedskew.data.generators.fonts import font_files
from fedskew.errors import ConfigError
from tests.conftest import requires_data

DIGITS = [str(d) for d in range(10)]


def _pixels(x: torch.Tensor) -> torch.Tensor:
    """Grey, ink-bright (dark border), centred, unit-norm pixel vectors for a nearest-neighbour probe."""
    x = x.float() / 255
    x = x.mean(1, keepdim=True) if x.shape[1] == 3 else x
    border = torch.cat([x[:, :, 0], x[:, :, -1], x[:, :, :, 0], x[:, :, :, -1]], -1).mean(-1)
    x = torch.where(border[..., None, None] > x.mean((2, 3), keepdim=True), 1 - x, x).flatten(1)
    return torch.nn.functional.normalize(x - x.mean(1, keepdim=True), dim=1)


def _one_nn(train: torch.Tensor, y_train: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    return y_train[(_pixels(test) @ _pixels(train).T).argmax(1)]


# ------------------------------------------------------------------------------------------------ fonts
def test_fonts_shapes_labels_and_determinism():
    a = generate("fonts", DIGITS, 3, 7, 28)
    assert a.images.shape == (30, 3, 28, 28) and a.images.dtype == torch.uint8
    assert torch.equal(a.labels, torch.arange(10).repeat_interleave(3))
    assert torch.equal(a.images, generate("fonts", DIGITS, 3, 7, 28).images)
    assert not torch.equal(a.images, generate("fonts", DIGITS, 3, 8, 28).images)
    assert a.images.float().std() > 20  # ink and background differ, not a blank canvas


def test_fonts_are_class_dependent():
    """A 1-nearest-neighbour probe fitted on one seed's images names the class of another seed's images."""
    train, test = generate("fonts", DIGITS, 60, 0, 28), generate("fonts", DIGITS, 30, 1, 28)
    acc = (_one_nn(train.images, train.labels, test.images) == test.labels).float().mean()
    assert acc > 0.4  # chance is 0.1; measured 0.68 with 100 per class


@requires_data
def test_fonts_digits_transfer_to_mnist_above_chance():
    """Printed digits are a real (if style-shifted) source for handwritten ones: 1-NN beats chance."""
    mnist = load_dataset("mnist")
    gen = generate("fonts", mnist.class_names, 60, 0, 28)
    acc = (_one_nn(gen.images, gen.labels, mnist.x_test[:1000]) == mnist.y_test[:1000]).float().mean()
    assert acc > 0.3  # chance 0.1; measured ~0.5 with 100 per class


def test_fonts_grey_and_letters():
    out = generate("fonts", ["A", "b", "10"], 2, 0, 32, colour=False, noise=0.0)
    assert torch.equal(out.images[:, 0], out.images[:, 1]) and torch.equal(out.images[:, 1], out.images[:, 2])


def test_fonts_uses_only_the_named_font_files(tmp_path):
    src = next(p for p in font_files(DIGITS) if p.endswith("DejaVuSans.ttf"))
    shutil.copy(src, tmp_path / "DejaVuSans.ttf")
    assert font_files(DIGITS, font_dirs=[str(tmp_path)]) == [str(tmp_path / "DejaVuSans.ttf")]
    out = generate("fonts", DIGITS, 2, 0, 28, font_dirs=[str(tmp_path)])
    assert out.images.shape == (20, 3, 28, 28)


def test_fonts_skip_symbol_and_empty_fonts():
    names = [p.rsplit("/", 1)[-1] for p in font_files(DIGITS, fonts=["*"])]
    assert "DejaVuSans.ttf" in names
    assert not {"LastResortHE-Regular.ttf", "DejaVuSansDisplay.ttf", "STIXSizOneSymReg.ttf"} & set(names)


@pytest.mark.parametrize(
    ("names", "options", "match"),
    [
        (["T-shirt/top", "1"], {}, "class name 'T-shirt/top' is not renderable"),
        (["", "1"], {}, "class name '' is not renderable"),
        (DIGITS, {"fonts": ["NoSuchFont*"]}, "none of the 0 font files"),
        (DIGITS, {"scale": [0.9, 0.5]}, "scale must be"),
        (DIGITS, {"colour_mode": "rgb"}, "unknown option 'colour_mode'"),
    ],
)
def test_fonts_errors(names, options, match):
    with pytest.raises(ConfigError, match=match):
        generate("fonts", names, 2, 0, 28, **options)


# ----------------------------------------------------------------------------------------------- folder
def _tree(root, classes: dict[str, int], size: int = 12) -> None:
    for c, (name, n) in enumerate(classes.items()):
        (root / name).mkdir(parents=True)
        for i in range(n):  # pixel value encodes (class, index) so the test can read back what was taken
            px = np.full((size, size, 3), (c * 40, i * 10, 0), dtype=np.uint8)
            Image.fromarray(px).save(root / name / f"{i}.png")


def test_folder_reads_class_major_in_file_order(tmp_path):
    _tree(tmp_path, {"cat": 4, "dog": 3})
    out = generate("folder", ["cat", "dog"], 3, 0, 12, root=str(tmp_path))
    assert out.images.shape == (6, 3, 12, 12) and torch.equal(out.labels, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert out.images[:, 0, 0, 0].tolist() == [0, 0, 0, 40, 40, 40]
    assert out.images[:, 1, 0, 0].tolist() == [0, 10, 20, 0, 10, 20]


def test_folder_resizes_and_shuffles_deterministically(tmp_path):
    _tree(tmp_path, {"a b": 6, "c": 6}, size=20)  # "a b" is found as a folder named "a b"
    one = generate("folder", ["a b", "c"], 3, 5, 8, root=str(tmp_path), shuffle=True)
    assert one.images.shape == (6, 3, 8, 8)
    assert torch.equal(
        one.images, generate("folder", ["a b", "c"], 3, 5, 8, root=str(tmp_path), shuffle=True).images
    )
    picks = {
        tuple(
            generate("folder", ["a b", "c"], 3, s, 8, root=str(tmp_path), shuffle=True)
            .images[:3, 1, 0, 0]
            .tolist()
        )
        for s in range(6)
    }
    assert len(picks) > 1  # the seed chooses which images


def test_folder_underscore_names(tmp_path):
    _tree(tmp_path, {"T-shirt_top": 2, "Ankle_boot": 2})
    out = generate("folder", ["T-shirt/top", "Ankle boot"], 2, 0, 12, root=str(tmp_path))
    assert out.images.shape == (4, 3, 12, 12)


def test_folder_errors_name_the_class_folder(tmp_path):
    _tree(tmp_path, {"cat": 4, "dog": 1})
    with pytest.raises(ConfigError, match=r"dog holds 1 images, fewer than per_class=2"):
        generate("folder", ["cat", "dog"], 2, 0, 12, root=str(tmp_path))
    with pytest.raises(ConfigError, match=r"no folder for class 'bird'"):
        generate("folder", ["cat", "bird"], 1, 0, 12, root=str(tmp_path))
    with pytest.raises(ConfigError, match="is not a folder"):
        generate("folder", ["cat"], 1, 0, 12, root=str(tmp_path / "missing"))


# -------------------------------------------------------------------------------------------- diffusers
class _FakePipeline:
    """Stands in for a diffusers pipeline: records its loading and calls, draws seeded noise images."""

    loads: ClassVar[list] = []
    calls: ClassVar[list] = []

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        cls.loads.append((path, kwargs))
        return cls()

    def to(self, device):
        return self

    def set_progress_bar_config(self, **kwargs):
        pass

    def __call__(self, prompt, *, num_images_per_prompt, generator, **kwargs):
        self.calls.append((prompt, num_images_per_prompt, kwargs))
        images = torch.rand(num_images_per_prompt, 32, 32, 3, generator=generator).numpy()
        return types.SimpleNamespace(images=images)


@pytest.fixture
def fake_diffusers(monkeypatch):
    _FakePipeline.loads, _FakePipeline.calls = [], []
    monkeypatch.setitem(
        sys.modules, "diffusers", types.SimpleNamespace(AutoPipelineForText2Image=_FakePipeline)
    )
    return _FakePipeline


def test_diffusers_prompts_seeds_and_local_only_loading(fake_diffusers, tmp_path):
    out = generate(
        "diffusers", ["ankle_boot", "cat"], 5, 3, 16, checkpoint=str(tmp_path), batch_size=2, steps=4
    )
    assert out.images.shape == (10, 3, 16, 16) and out.images.dtype == torch.uint8
    assert (
        fake_diffusers.loads[0][0] == str(tmp_path) and fake_diffusers.loads[0][1]["local_files_only"] is True
    )
    prompts = [(p, k) for p, k, _ in fake_diffusers.calls]
    assert prompts == [("a photo of a ankle boot.", 2)] * 2 + [("a photo of a ankle boot.", 1)] + [
        ("a photo of a cat.", 2)
    ] * 2 + [("a photo of a cat.", 1)]
    assert fake_diffusers.calls[0][2]["num_inference_steps"] == 4
    again = generate(
        "diffusers", ["ankle_boot", "cat"], 5, 3, 16, checkpoint=str(tmp_path), batch_size=2, steps=4
    )
    assert torch.equal(out.images, again.images)
    alone = generate("diffusers", ["cat"], 5, 3, 16, checkpoint=str(tmp_path), batch_size=2, steps=4)
    assert not torch.equal(
        alone.images, out.images[5:]
    )  # class index enters the seed: "cat" is class 1 above


def test_diffusers_errors(fake_diffusers, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="checkpoint .*missing does not exist"):
        generate("diffusers", ["cat"], 1, 0, 16, checkpoint=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="template must hold one"):
        generate("diffusers", ["cat"], 1, 0, 16, checkpoint=str(tmp_path), template="a photo")
    monkeypatch.setitem(sys.modules, "diffusers", None)  # as if not installed
    with pytest.raises(
        ConfigError, match=r"needs the diffusers package: pip install 'fedskew\[generators\]'"
    ):
        generate("diffusers", ["cat"], 1, 0, 16, checkpoint=str(tmp_path))


_CHECKPOINT = os.environ.get("FEDSKEW_DIFFUSERS_CHECKPOINT")


@pytest.mark.slow
@pytest.mark.skipif(
    _CHECKPOINT is None or importlib.util.find_spec("diffusers") is None,
    reason="needs diffusers (pip install 'fedskew[generators]') and a local pipeline folder in "
    "FEDSKEW_DIFFUSERS_CHECKPOINT",
)
def test_diffusers_real_checkpoint():
    out = generate("diffusers", ["cat", "dog"], 1, 0, 32, checkpoint=str(_CHECKPOINT), steps=2, resolution=64)
    assert out.images.shape == (2, 3, 32, 32) and out.images.float().std() > 1
