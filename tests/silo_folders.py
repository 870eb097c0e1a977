"""Image folders of three silos for the node-local data tests: scikit-learn's digits (8x8, grey) written as
PNG files, ``<root>/digits/{train,test}/<class>/<n>.png``, each silo holding its own mix of the ten classes
(some classes missing), the federation's label space being all ten."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

#: classes each silo holds (training and test): one label space, three different mixes
MIXES = ((0, 1, 2, 3, 4, 5), (3, 4, 5, 6, 7, 8, 9), (0, 2, 4, 6, 8, 9))
LABELS = [str(c) for c in range(10)]


def write_silos(base: Path, mixes: tuple[tuple[int, ...], ...] = MIXES, per_class: int = 24) -> list[Path]:
    """One data root per silo, with ``per_class`` training and ``per_class // 3`` test images of each of its
    classes (disjoint across silos); the roots."""
    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    taken = np.zeros(len(images), dtype=bool)
    roots = []
    for i, mix in enumerate(mixes):
        root = base / f"silo{i}"
        for c in mix:
            pool = np.flatnonzero((digits.target == c) & ~taken)
            n_test = per_class // 3
            pick = pool[: per_class + n_test]
            taken[pick] = True
            for split, rows in (("train", pick[:per_class]), ("test", pick[per_class:])):
                folder = root / "digits" / split / str(c)
                folder.mkdir(parents=True, exist_ok=True)
                for r in rows:
                    Image.fromarray(images[r], mode="L").save(folder / f"{r}.png")
        roots.append(root)
    return roots
