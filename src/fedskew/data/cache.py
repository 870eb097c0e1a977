"""Derived files kept between runs: decoded image sets, deterministic splits. Written atomically (a
concurrent reader never sees half a file); an unwritable folder only disables the cache."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

#: where derived files go when the dataset has no folder of its own (``$FEDSKEW_CACHE`` overrides)
DEFAULT_CACHE = Path("~/.cache/fedskew/derived")


def cache_root() -> Path:
    """``$FEDSKEW_CACHE``, else ``~/.cache/fedskew/derived``."""
    return Path(os.environ.get("FEDSKEW_CACHE") or DEFAULT_CACHE).expanduser()


def save_atomic(path: Path, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` by write-then-rename; silently skipped where ``path`` is read-only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def load_saved(path: Path) -> Any | None:
    """What :func:`save_atomic` wrote (tensors and plain containers only), or ``None`` when ``path`` is
    missing, truncated or foreign (the caller rebuilds it)."""
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception:  # any unpickling error: rebuild
        return None
