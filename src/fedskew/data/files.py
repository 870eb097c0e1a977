"""The data root: the expected-files registry and download (generic helpers; checksums in checksums.py).

Each dataset module declares its files in :data:`FILES` (paths under the root in the datasets' own
distribution format, e.g. ``mnist/train-images-idx3-ubyte.gz``, official checksums, sources); this module
only knows how to check and fetch them. Checksums are the MD5s the official sources publish (torchvision
uses the same values). For gzipped files we also accept the MD5 of the *decompressed* payload: mirrors
often re-compress the files (the gzip header then differs) while the data is byte-identical. Verification
results are cached in a stamp under the cache root (keyed by the file's resolved path, size and mtime; see
:mod:`fedskew.data.checksums`), or in memory when the cache is unwritable, so repeated loads never rehash.

The data root is only read, with one exception: downloading missing files (:func:`fetch`, when allowed)
writes them into the root, their documented home. Everything derived from the files goes to the cache.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedskew.data.checksums import STAMP, file_digest, stamp_path, verify
from fedskew.errors import DataError

__all__ = [
    "FILES",
    "STAMP",
    "DatasetFiles",
    "FileSpec",
    "ensure",
    "fetch",
    "file_digest",
    "stamp_path",
    "verify",
]

#: Opens a URL; tests replace it (``monkeypatch.setattr(files, "URLOPEN", fake)``): no network in tests.
URLOPEN: Callable = urllib.request.urlopen
#: Seconds before a connection or read gives up (offline machines fail fast).
DOWNLOAD_TIMEOUT: float = 10.0
#: Verify checksums of known official files (``FEDSKEW_VERIFY=0`` turns it off for hand-made files).
VERIFY: bool = os.environ.get("FEDSKEW_VERIFY", "1") != "0"
#: Never try to download (``FEDSKEW_OFFLINE=1``).
OFFLINE: bool = os.environ.get("FEDSKEW_OFFLINE", "0") == "1"

_CHUNK = 1 << 20  # download copy chunk
_SET_HINT = "set FEDSKEW_DATA or data.root to the folder that holds them"


@dataclass(frozen=True)
class FileSpec:
    """One expected file, relative to the data root.

    ``digest`` is the checksum of the official file (``"md5:<hex>"`` or ``"sha256:<hex>"``);
    ``payload_digest`` (gzip files only) the checksum of its decompressed content; ``urls`` direct sources.
    """

    path: str
    digest: str | None = None
    payload_digest: str | None = None
    urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class Archive:
    """An official archive holding the files: downloaded, checked, and only the expected members extracted.

    ``strip`` is a member-name prefix dropped on extraction (EMNIST's ``gzip/``); ``into`` the folder under
    the root that the stripped names are relative to.
    """

    url: str
    digest: str
    strip: str = ""
    into: str = ""


@dataclass(frozen=True)
class DatasetFiles:
    """What a dataset needs under the root and where it officially comes from."""

    folder: str
    files: tuple[FileSpec, ...]
    source: str
    archive: Archive | None = None

    @property
    def downloadable(self) -> bool:
        return self.archive is not None or (bool(self.files) and all(f.urls for f in self.files))


#: dataset registry name -> expected files; each dataset module adds its own entry (``FILES[name] = ...``).
#: Image-folder, LEAF and Hugging Face datasets have no fixed file list.
FILES: dict[str, DatasetFiles] = {}


# --------------------------------------------------------------------------------------------- checksums
# --------------------------------------------------------------------------------------------- download
def _download(url: str, dest: Path, timeout: float) -> None:
    """Stream ``url`` into ``dest`` through a ``.part`` file (no half-written files on failure)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with URLOPEN(url, timeout=timeout) as resp, open(part, "wb") as out:
            shutil.copyfileobj(resp, out, _CHUNK)
        os.replace(part, dest)
    finally:
        with contextlib.suppress(OSError):
            part.unlink()


def _extract(archive: Path, spec: DatasetFiles, root: Path) -> None:
    """Extract only the expected members (never arbitrary archive paths) into the root."""
    prefix = f"{spec.archive.into}/" if spec.archive and spec.archive.into else ""
    strip = spec.archive.strip if spec.archive else ""
    wanted = {f.path[len(prefix) :]: root / f.path for f in spec.files}

    def target(member: str) -> Path | None:
        return wanted.get(member[len(strip) :]) if member.startswith(strip) else None

    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    if (dest := target(name)) is not None:
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        with zf.open(name) as src, open(dest, "wb") as out:
                            shutil.copyfileobj(src, out, _CHUNK)
        else:
            with tarfile.open(archive) as tf:
                for m in tf:
                    if m.isfile() and (dest := target(m.name)) is not None:
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        stream = tf.extractfile(m)
                        assert stream is not None  # a regular file member always has a stream
                        with stream, open(dest, "wb") as out:
                            shutil.copyfileobj(stream, out, _CHUNK)
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, zlib.error) as err:
        raise DataError(f"cannot extract {archive}: {err}") from None


def missing_files(spec: DatasetFiles, root: Path) -> list[str]:
    """Expected files (relative to the root) that are not there."""
    return [f.path for f in spec.files if not (root / f.path).is_file()]


def _missing_message(name: str, spec: DatasetFiles, root: Path, missing: Sequence[str], why: str) -> str:
    names = ", ".join(Path(m).name for m in missing)
    return (
        f"dataset '{name}': missing {names} in {root / spec.folder} ({why}); download them from "
        f"{spec.source} into that folder, or {_SET_HINT}"
    )


def fetch(name: str, root: str | os.PathLike, *, timeout: float | None = None) -> Path:
    """Download dataset ``name``'s official files into ``root`` and verify them; returns its folder.

    The one write that targets the data root (missing files only; the archive is a temporary in the root).
    Offline (or with ``FEDSKEW_OFFLINE=1``) this raises ``DataError`` naming the expected files and the
    folder. The opener is :data:`URLOPEN`, which tests replace.
    """
    root = Path(root).expanduser()
    spec = FILES.get(name)
    if spec is None:
        raise DataError(
            f"dataset '{name}' cannot be downloaded automatically; downloadable: {', '.join(FILES)}"
        )
    missing = missing_files(spec, root)
    if not missing:
        return root / spec.folder
    if OFFLINE:
        raise DataError(_missing_message(name, spec, root, missing, "FEDSKEW_OFFLINE=1"))
    timeout = DOWNLOAD_TIMEOUT if timeout is None else timeout
    try:
        root.mkdir(parents=True, exist_ok=True)
        if spec.archive is not None:
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                arc = Path(tmp) / Path(spec.archive.url).name
                _download(spec.archive.url, arc, timeout)
                verify(arc, spec.archive.digest)
                _extract(arc, spec, root)
        else:
            for f in spec.files:
                if f.path in missing:
                    _try_urls(f, root / f.path, timeout)
    except OSError as err:  # URLError, timeouts, refused connections, read-only roots
        raise DataError(_missing_message(name, spec, root, missing, f"download failed: {err}")) from None
    still = missing_files(spec, root)
    if still:
        raise DataError(_missing_message(name, spec, root, still, "not in the downloaded archive"))
    return root / spec.folder


def _try_urls(f: FileSpec, dest: Path, timeout: float) -> None:
    err: OSError | None = None
    for url in f.urls:
        try:
            _download(url, dest, timeout)
        except OSError as e:
            err = e
            continue
        if f.digest:
            try:
                verify(dest, f.digest, payload_digest=f.payload_digest)
            except DataError:
                dest.unlink()
                raise
        return
    raise err if err is not None else OSError(f"no source URL for {f.path}")


def ensure(name: str, root: str | os.PathLike, *, verify_files: bool = True, download: bool = True) -> Path:
    """Make sure dataset ``name``'s files are under ``root`` (downloading when allowed), verified.

    Returns the dataset folder. Files without a published checksum are left to the parsers' checks. Only a
    download (missing files, ``download=True``) writes into ``root``; verification stamps go to the cache.
    """
    root = Path(root).expanduser()
    spec = FILES[name]
    missing = missing_files(spec, root)
    if missing:
        if download and spec.downloadable:
            fetch(name, root)
        else:
            raise DataError(_missing_message(name, spec, root, missing, "downloads disabled"))
    if verify_files and VERIFY:
        for f in spec.files:
            if f.digest:
                verify(root / f.path, f.digest, payload_digest=f.payload_digest)
    return root / spec.folder


def require_folder(name: str, folder: Path, layout: str, source: str) -> None:
    """``DataError`` naming the layout and folder when a hand-assembled dataset folder is absent."""
    if not folder.is_dir():
        raise DataError(
            f"dataset '{name}': folder {folder} not found (expected {layout}); get it from {source}, "
            f"or {_SET_HINT}"
        )
