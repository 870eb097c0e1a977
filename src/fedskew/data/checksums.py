"""Checksum verification of the files under the data root, cached so repeated loads never rehash.

Checksums are ``"md5:<hex>"`` or ``"sha256:<hex>"``. A pass is recorded in a stamp in the cache, never next
to the file (the data root is only read): ``verified.json`` in the :func:`~fedskew.data.cache.derived_dir` of
the file's resolved folder, one entry per file name with its size + mtime. Where the cache is unwritable the
pass is kept only in memory.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from fedskew.data.cache import derived_dir, save_json_atomic
from fedskew.errors import DataError

#: the stamp file's name inside the cache folder of the verified files' folder
STAMP = "verified.json"
_CHUNK = 1 << 20
_MEMO: set[tuple[str, int, int, str]] = set()  # (abs path, size, mtime_ns, digest) verified in-process
_COLD = False  # while set, passes are not looked up (see cold_verification)


def forget() -> None:
    """Forget this process's verified files (the stamps on disk still count)."""
    _MEMO.clear()


@contextlib.contextmanager
def cold_verification() -> Iterator[None]:
    """Hash every file again inside the ``with`` block, as a first load would (benchmarks)."""
    global _COLD
    _MEMO.clear()
    _COLD = True
    try:
        yield
    finally:
        _COLD = False


def _split_digest(digest: str) -> tuple[str, str]:
    algo, _, hexd = digest.partition(":")
    if algo not in ("md5", "sha256") or not hexd:
        raise ValueError(f"digest must look like 'md5:<hex>' or 'sha256:<hex>', got {digest!r}")
    return algo, hexd.lower()


def file_digest(path: Path, algo: str = "sha256", *, gunzip: bool = False) -> str:
    """Hex digest of a file (of its decompressed content when ``gunzip``); ``DataError`` if unreadable."""
    h = hashlib.new(algo)
    try:
        with gzip.open(path, "rb") if gunzip else open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"cannot read {path}: {err}; the file is truncated or corrupted") from None
    return h.hexdigest()


def _stamp_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def stamp_path(path: str | os.PathLike) -> Path:
    """The stamp file that records passes of ``path`` (in the cache, keyed by the file's resolved folder)."""
    return derived_dir(Path(path).resolve().parent, STAMP)


def _stamp_table(stamp: Path) -> dict:
    try:
        table = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _stamp_lookup(path: Path, digests: Sequence[str]) -> bool:
    if _COLD:
        return False
    key = _stamp_key(path)
    if any((*key, d) in _MEMO for d in digests):
        return True
    entry = _stamp_table(stamp_path(path)).get(Path(key[0]).name)
    return (
        isinstance(entry, dict)
        and entry.get("size") == key[1]
        and entry.get("mtime_ns") == key[2]
        and entry.get("digest") in digests
    )


def _stamp_record(path: Path, digest: str) -> None:
    key = _stamp_key(path)
    _MEMO.add((*key, digest))
    stamp = stamp_path(path)
    table = _stamp_table(stamp)
    table[Path(key[0]).name] = {"size": key[1], "mtime_ns": key[2], "digest": digest}
    # write-then-rename so concurrent loaders never read half a stamp; an unwritable cache leaves only the
    # in-memory memo, which still spares rehashing in this process
    save_json_atomic(stamp, table)


def verify(path: str | os.PathLike, digest: str, *, payload_digest: str | None = None) -> None:
    """Check ``path`` against ``digest`` (``"md5:<hex>"``/``"sha256:<hex>"``); raise ``DataError`` naming it.

    With ``payload_digest`` a gzip file also passes when its decompressed content matches (re-compressed
    copies of the official data). A pass is cached by size + mtime, so the next call does not rehash.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing file {path}")
    accepted = [d for d in (digest, payload_digest) if d]
    if _stamp_lookup(path, accepted):
        return
    algo, want = _split_digest(digest)
    got = file_digest(path, algo)
    if got == want:
        _stamp_record(path, digest)
        return
    if payload_digest:
        p_algo, p_want = _split_digest(payload_digest)
        with contextlib.suppress(DataError):  # not gzip at all: report the plain mismatch below
            if file_digest(path, p_algo, gunzip=True) == p_want:
                _stamp_record(path, payload_digest)
                return
    raise DataError(
        f"checksum mismatch for {path}: {algo} {got} != expected {want}; the file is corrupted or not the "
        "official release (delete it to re-download, or set FEDSKEW_VERIFY=0 / data.options.verify=false "
        "for files you made yourself)"
    )
