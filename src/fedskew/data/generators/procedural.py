"""``procedural``: a class-conditional pattern generator for tests and smoke runs (no model, no files).

Class ``c`` gets a fixed colour and stripe frequency derived from ``c`` alone; each image adds a random
phase, a random brightness and pixel noise, so images of one class are alike and classes differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedskew import numerics
from fedskew.data.generators import GENERATORS, GeneratedImages


@GENERATORS.register("procedural")
def procedural(
    class_names: Sequence[str], per_class: int, seed: int, size: int, noise: float = 0.1
) -> GeneratedImages:
    """Class-coloured stripe patterns with random phase and noise (tests; no generative model)."""
    g = torch.Generator().manual_seed(seed)
    n_cls = len(class_names)
    labels = torch.arange(n_cls).repeat_interleave(per_class)
    hue = labels.float() / max(n_cls, 1) * 2 * math.pi
    phases = hue[:, None] + torch.tensor([0.0, 2.1, 4.2])
    colour = numerics.cos(phases) * 0.4 + 0.5  # [N, 3]
    freq = (1 + labels % 5).float()
    phase = torch.rand(labels.numel(), generator=g) * 2 * math.pi
    axis = torch.linspace(0, 2 * math.pi, size)
    stripes = numerics.sin(freq[:, None, None] * axis[None, :, None] + phase[:, None, None])  # [N, H, 1]
    pattern = 0.5 + 0.5 * stripes.expand(-1, size, size)
    brightness = 0.8 + 0.4 * torch.rand(labels.numel(), 1, 1, 1, generator=g)
    img = colour[:, :, None, None] * pattern[:, None] * brightness
    img = img + noise * torch.randn(img.shape, generator=g)
    return GeneratedImages((img.clamp(0, 1) * 255).round().to(torch.uint8), labels)
