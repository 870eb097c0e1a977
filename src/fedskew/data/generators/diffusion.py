"""``diffusers``: a local text-to-image checkpoint (e.g. Stable Diffusion) in place of CacheFL's DALL·E.

CacheFL draws its K images per class from DALL·E with the prompt "a photo of a [CLASS]" (Eq. 2). Any
text-to-image model is a documented substitute; this source runs a `diffusers
<https://github.com/huggingface/diffusers>`_ pipeline loaded only from a local folder
(``local_files_only=True``: nothing is downloaded). Needs the optional extra: ``pip install
'fedskew[generators]'``. The package is imported only when this generator runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.data.generators import GENERATORS, GeneratedImages
from fedskew.errors import ConfigError
from fedskew.seeding import derive_seed

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _pipeline(checkpoint: str, device: str, dtype: str) -> Any:
    try:
        diffusers = importlib.import_module("diffusers")
    except ImportError:
        raise ConfigError(
            "generator 'diffusers' needs the diffusers package: pip install 'fedskew[generators]'"
        ) from None
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise ConfigError(
            f"generator 'diffusers': checkpoint {path} does not exist (a local pipeline folder)"
        )
    if dtype not in _DTYPES:
        raise ConfigError(f"generator 'diffusers': dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    try:
        pipe = diffusers.AutoPipelineForText2Image.from_pretrained(
            str(path), local_files_only=True, torch_dtype=_DTYPES[dtype]
        )
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"generator 'diffusers': cannot load {path}: {first}") from None
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_for(template: str, name: str) -> str:
    """The prompt of one class: ``template`` with the class name (underscores as spaces) in its ``{}``."""
    return template.format(name.replace("_", " "))


@GENERATORS.register("diffusers")
def diffusers_generator(
    class_names: Sequence[str],
    per_class: int,
    seed: int,
    size: int,
    *,
    checkpoint: str,
    template: str = "a photo of a {}.",
    steps: int = 30,
    guidance: float = 7.5,
    resolution: int | None = None,
    batch_size: int = 4,
    device: str = "cpu",
    dtype: str = "float32",
) -> GeneratedImages:
    """``per_class`` images of each prompt ``template.format(class)`` from a local diffusers pipeline.

    ``checkpoint`` is a pipeline folder (``model_index.json`` and its components); ``steps`` denoising
    steps at classifier-free guidance ``guidance``, drawn at ``resolution`` (the model's default when
    ``None``) in batches of ``batch_size``, then resized (antialiased bilinear) to ``size``. Batch ``b`` of
    class ``c`` uses the seed ``derive_seed(seed, c, b)``, so a class's images do not depend on the others.
    """
    if template.count("{}") != 1:
        raise ConfigError(
            f"generator 'diffusers': template must hold one '{{}}' for the class, got {template!r}"
        )
    if batch_size < 1 or steps < 1:
        raise ConfigError(
            f"generator 'diffusers': batch_size and steps must be >= 1, got {batch_size}, {steps}"
        )
    pipe = _pipeline(checkpoint, device, dtype)
    chunks = []
    for c, name in enumerate(class_names):  # one pipeline call per prompt batch, not per pixel
        for b, start in enumerate(range(0, per_class, batch_size)):
            k = min(batch_size, per_class - start)
            gen = torch.Generator(device).manual_seed(derive_seed(seed, c, b))
            out = pipe(
                prompt_for(template, name),
                num_images_per_prompt=k,
                num_inference_steps=steps,
                guidance_scale=guidance,
                height=resolution,
                width=resolution,
                generator=gen,
                output_type="np",
            )
            x = torch.from_numpy(np.asarray(out.images, dtype=np.float32)).permute(0, 3, 1, 2)[:k]
            x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            chunks.append((x.clamp(0, 1) * 255).round().to(torch.uint8))
    labels = torch.arange(len(class_names)).repeat_interleave(per_class)
    return GeneratedImages(torch.cat(chunks), labels)
