"""``folder``: pre-generated images (e.g. DALL·E outputs made elsewhere) read from ``<root>/<class>/<i>.png``.

CacheFL's synthetic set (Eq. 2) comes from a generator the paper runs online; users with images generated
elsewhere put them in one folder per class name, and this source reads them back class-balanced.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedskew.data.generators import GENERATORS, GeneratedImages
from fedskew.data.images import cached_images, list_images
from fedskew.errors import ConfigError


def class_folder(root: Path, name: str) -> Path:
    """The folder of class ``name``: ``<root>/<name>``, else with ``/`` and spaces as ``_``."""
    plain = root / name
    if plain.is_dir():
        return plain
    safe = root / name.replace("/", "_").replace(" ", "_")
    if safe.is_dir():
        return safe
    raise ConfigError(f"generator 'folder': no folder for class {name!r} (looked for {plain} and {safe})")


@GENERATORS.register("folder")
def folder(
    class_names: Sequence[str], per_class: int, seed: int, size: int, *, root: str, shuffle: bool = False
) -> GeneratedImages:
    """The first ``per_class`` images of each class folder by file name (a seeded choice with ``shuffle``).

    ``root`` is used as given (``~`` expanded). Images are decoded as RGB and resized to ``size`` x ``size``.
    A class folder with fewer than ``per_class`` images is a ``ConfigError`` naming it.
    """
    base = Path(root).expanduser()
    if not base.is_dir():
        raise ConfigError(f"generator 'folder': root {base} is not a folder")
    rng = np.random.default_rng(int(seed))
    paths: list[Path] = []
    for name in class_names:  # per class folder (a directory listing), not per image
        folder = class_folder(base, name)
        files = list_images(folder)
        if len(files) < per_class:
            raise ConfigError(
                f"generator 'folder': {folder} holds {len(files)} images, fewer than per_class={per_class}"
            )
        pick = np.sort(rng.choice(len(files), per_class, replace=False)) if shuffle else range(per_class)
        paths += [files[i] for i in pick]
    images, _ = cached_images(paths, size, "RGB", None, "generator 'folder'")
    labels = torch.arange(len(class_names)).repeat_interleave(per_class)
    return GeneratedImages(images, labels)
