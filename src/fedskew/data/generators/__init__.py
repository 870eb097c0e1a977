"""Text-to-image generators: class names -> a class-balanced set of synthetic images.

CacheFL (Eqs. 5–6) builds its cache from images a generator drew for each class name. A generator is a
function registered in :data:`GENERATORS`::

    fn(class_names, per_class, seed, size, **options) -> GeneratedImages

returning ``per_class`` images of every class, class-major (all of class 0, then class 1, ...), as
``uint8 [N, 3, size, size]`` RGB with ``labels[i]`` the class index. The same arguments give the same
images (bit for bit). ``generate`` validates the options and the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedskew.errors import ConfigError
from fedskew.registry import Registry, check_options


class GeneratedImages(NamedTuple):
    images: Tensor  # uint8 [N, 3, size, size]
    labels: Tensor  # int64 [N], class-major


Generator = Callable[..., GeneratedImages]
GENERATORS: Registry[Generator] = Registry("generator")


def generate(
    name: str, class_names: Sequence[str], per_class: int, seed: int, size: int, **options: Any
) -> GeneratedImages:
    """Run generator ``name``; ``ConfigError`` for bad arguments or options, checked output."""
    fn = GENERATORS.get(name)
    check_options(fn, options, f"generator '{name}': unknown option '{{key}}'", skip=4)
    if per_class < 1:
        raise ConfigError(f"generator '{name}': per_class must be >= 1, got {per_class}")
    if size < 8:
        raise ConfigError(f"generator '{name}': size must be >= 8 pixels, got {size}")
    if not class_names:
        raise ConfigError(f"generator '{name}': no class names given")
    out = fn(list(class_names), per_class, seed, size, **options)
    n = len(class_names) * per_class
    if out.images.dtype != torch.uint8 or tuple(out.images.shape) != (n, 3, size, size):
        raise ValueError(f"generator '{name}' returned {tuple(out.images.shape)} {out.images.dtype}")
    if not torch.equal(out.labels, torch.arange(len(class_names)).repeat_interleave(per_class)):
        raise ValueError(f"generator '{name}' returned labels that are not class-major")
    return out


def _register_builtins() -> None:
    from fedskew.data.generators import diffusion, folder, fonts, procedural  # noqa: F401


_register_builtins()
