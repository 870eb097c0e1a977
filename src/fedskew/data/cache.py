"""Derived files kept between runs: decoded image sets, encoded features, checksum stamps, deterministic
splits. They all live under :func:`cache_root`, never under a data root: a data root is only read (it is
often a read-only or shared mount). Written atomically (a concurrent reader never sees half a file); an
unwritable folder only disables the cache."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

#: where derived files go (``$FEDSKEW_CACHE`` overrides); beside, not inside, the default data root
#: ``~/.cache/fedskew``, which is only read like every other data root
DEFAULT_CACHE = Path("~/.cache/fedskew-derived")
#: the sub-folder of the cache root that holds one folder per source folder (see :func:`derived_dir`)
SOURCES = "sources"


def cache_root() -> Path:
    """``$FEDSKEW_CACHE``, else ``~/.cache/fedskew-derived``."""
    return Path(os.environ.get("FEDSKEW_CACHE") or DEFAULT_CACHE).expanduser()


def derived_dir(source: str | os.PathLike, *parts: str) -> Path:
    """The cache folder for files derived from the folder ``source`` (a data root or a dataset's folder).

    ``<cache_root>/sources/<name>-<hash>/<parts...>``: ``<name>`` is the folder's own name (for people),
    ``<hash>`` 16 hex digits of the SHA-256 of its resolved path, so two folders never share a cache folder
    even when their names are equal. Nothing is created here; writers go through :func:`save_atomic`.
    """
    resolved = Path(source).expanduser().resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", resolved.name).strip("._") or "root"
    return cache_root().joinpath(SOURCES, f"{name}-{digest}", *parts)


def _write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> bool:
    """``write`` into a temporary file renamed onto ``path``; ``False`` (nothing left) where unwritable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


def save_atomic(path: Path, obj: Any) -> bool:
    """``torch.save(obj)`` to ``path`` by write-then-rename; ``False`` (skipped) where it is read-only."""
    return _write_atomic(path, lambda f: torch.save(obj, f))


def save_bytes_atomic(path: Path, data: bytes) -> bool:
    """``data`` to ``path`` by write-then-rename; ``False`` (skipped) where ``path`` is read-only."""
    return _write_atomic(path, lambda f: f.write(data))


def save_json_atomic(path: Path, obj: Any) -> bool:
    """``obj`` as JSON to ``path`` by write-then-rename; ``False`` (skipped) where ``path`` is read-only."""
    return _write_atomic(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def load_saved(path: Path) -> Any | None:
    """What :func:`save_atomic` wrote (tensors and plain containers only), or ``None`` when ``path`` is
    missing, truncated or foreign (the caller rebuilds it)."""
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception:  # any unpickling error: rebuild
        return None
