"""``random_cnn``: a seeded, randomly initialised frozen CNN (images only) for tests and smoke runs.

Three strided convolutions with ReLU, a global average pool and a linear map to ``embed_dim``: no weights
file, nothing learned, but a fixed function that keeps nearby images nearby, enough to exercise the whole
images -> features -> cache -> federated pipeline offline. Not a stand-in for a pre-trained encoder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from fedskew.models.backbones import BACKBONES, Backbone, to_backbone_input
from fedskew.models.base import embed_in_chunks


class RandomCNNBackbone(Backbone):
    def __init__(self, embed_dim: int, image_size: int, seed: int) -> None:
        self.embed_dim, self.image_size, self.seed = embed_dim, image_size, seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = nn.Sequential(
                nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                nn.Linear(64, embed_dim),
            )  # fmt: skip
        self.net.requires_grad_(False).eval()

    def encode_images(self, images: Tensor, split: str, rows: Tensor | None = None) -> Tensor:
        return embed_in_chunks(
            lambda b: self.net(to_backbone_input(b, self.image_size, (0.5,) * 3, (0.25,) * 3)), images, 256
        )

    def fingerprint(self) -> dict:
        return {"name": "random_cnn", "dim": self.embed_dim, "size": self.image_size, "seed": self.seed}


@BACKBONES.register("random_cnn")
def random_cnn(root: Path, *, embed_dim: int = 32, image_size: int = 16, seed: int = 0) -> RandomCNNBackbone:
    """Seeded random frozen CNN, images only (tests and smoke runs; no weights)."""
    return RandomCNNBackbone(embed_dim, image_size, seed)
