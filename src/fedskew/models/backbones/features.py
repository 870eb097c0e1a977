"""``features``: precomputed features from a ``.pt`` or ``.npz`` file (e.g. CLIP features extracted
elsewhere, or by ``fedskew features``).

The file maps split names to float arrays ``[rows, C]``, one row per image the pipeline would encode:
``train`` (every training image, in the dataset's order), ``test``, ``synthetic`` (the generator's images,
class-major) and optionally ``prototypes`` (the images of a generated-prototype text head) and ``text``
(``[num_classes, C]``: the class prompts' text features; without it, the generated-prototype head is used).
Loaded with ``torch.load(weights_only=True)`` / ``numpy.load(allow_pickle=False)``: no code runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedskew.errors import ConfigError
from fedskew.models.backbones import BACKBONES, Backbone, resolve_path

SPLITS = ("train", "test", "synthetic", "prototypes", "text")


def load_feature_file(path: Path) -> dict[str, Tensor]:
    """The arrays of a ``.pt`` (a dict of tensors) or ``.npz`` file, as float32 tensors."""
    if not path.is_file():
        raise ConfigError(f"backbone 'features': file not found: {path}")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            raw = {k: torch.from_numpy(z[k]) for k in z.files}
    elif path.suffix == ".pt":
        raw = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(raw, dict):
            raise ConfigError(f"backbone 'features': {path} must hold a dict of tensors")
    else:
        raise ConfigError(f"backbone 'features': {path}: allowed suffixes: .pt, .npz")
    unknown = sorted(set(raw) - set(SPLITS))
    if unknown:
        raise ConfigError(
            f"backbone 'features': {path}: unknown key '{unknown[0]}'; allowed: {', '.join(SPLITS)}"
        )
    return {k: v.float() for k, v in raw.items()}


class FeatureFileBackbone(Backbone):
    """Looks the requested rows up in the file (the images themselves only give the expected count)."""

    image_size = 32  # images are not encoded; generators draw small images only to count them

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arrays = load_feature_file(path)
        dims = {v.shape[1] for v in self.arrays.values()}
        if len(dims) != 1:
            raise ConfigError(f"backbone 'features': {path}: arrays of different widths {sorted(dims)}")
        self.embed_dim = dims.pop()
        if "text" in self.arrays:
            self.encode_texts = self._texts

    def _texts(self, prompts: Sequence[str]) -> Tensor:
        text = self.arrays["text"]
        if text.shape[0] != len(prompts):
            raise ConfigError(
                f"backbone 'features': 'text' has {text.shape[0]} rows, expected {len(prompts)}"
            )
        return text

    def encode_images(self, images: Tensor, split: str, rows: Tensor | None = None) -> Tensor:
        if split not in self.arrays:
            raise ConfigError(f"backbone 'features': {self.path} has no '{split}' array")
        table = self.arrays[split]
        out = table if rows is None else table[rows]
        if out.shape[0] != images.shape[0]:
            raise ConfigError(
                f"backbone 'features': '{split}' gives {out.shape[0]} rows for {images.shape[0]} images"
            )
        return out


@BACKBONES.register("features")
def features(root: Path, *, path: str) -> FeatureFileBackbone:
    """Precomputed features from a .pt / .npz file (train, test, synthetic, [prototypes], [text])."""
    return FeatureFileBackbone(resolve_path(root, path))
