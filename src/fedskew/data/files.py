"""The data root: which files each dataset expects, their official checksums, verification and download.

Layout under the root (``data.root`` / ``$FEDSKEW_DATA`` / ``~/.cache/fedskew``) is the datasets' own
distribution format, e.g. ``mnist/train-images-idx3-ubyte.gz`` or ``cifar-10-batches-py/data_batch_1``.

Checksums are the MD5s the official sources publish (torchvision uses the same values). For the gzipped
IDX files we also accept the MD5 of the *decompressed* payload: mirrors often re-compress the files (the
gzip header then differs) while the data is byte-identical. Verification results are cached in a
``.verified.json`` stamp next to the files (keyed by size + mtime), or in memory when the folder is
read-only, so repeated loads never rehash.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
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

from fedskew.errors import DataError

#: Opens a URL; tests replace it (``monkeypatch.setattr(files, "URLOPEN", fake)``): no network in tests.
URLOPEN: Callable = urllib.request.urlopen
#: Seconds before a connection or read gives up (offline machines fail fast).
DOWNLOAD_TIMEOUT: float = 10.0
#: Verify checksums of known official files (``FEDSKEW_VERIFY=0`` turns it off for hand-made files).
VERIFY: bool = os.environ.get("FEDSKEW_VERIFY", "1") != "0"
#: Never try to download (``FEDSKEW_OFFLINE=1``).
OFFLINE: bool = os.environ.get("FEDSKEW_OFFLINE", "0") == "1"

STAMP = ".verified.json"
_CHUNK = 1 << 20
_MEMO: set[tuple[str, int, int, str]] = set()  # (abs path, size, mtime_ns, digest) verified in-process
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


def _idx_files(
    folder: str, bases: Sequence[str], digests: dict[str, tuple[str, str]]
) -> tuple[FileSpec, ...]:
    return tuple(
        FileSpec(f"{folder}/{name}", f"md5:{gz}", f"md5:{raw}", tuple(b + name for b in bases))
        for name, (gz, raw) in digests.items()
    )


_MNIST_MIRRORS = ("http://yann.lecun.com/exdb/mnist/", "https://ossci-datasets.s3.amazonaws.com/mnist/")
_FASHION_URL = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
_EMNIST = Archive(
    "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
    "md5:58c8d27c78d21e728a6bc7b3cc06412e",
    strip="gzip/",
    into="emnist",
)


def _emnist(split: str) -> DatasetFiles:
    names = [
        f"emnist-{split}-{p}-{k}"
        for p in ("train", "test")
        for k in ("images-idx3-ubyte.gz", "labels-idx1-ubyte.gz")
    ]
    # NIST publishes a checksum only for the whole archive; extracted members are checked by parsing.
    return DatasetFiles(
        "emnist",
        tuple(FileSpec(f"emnist/{n}") for n in names),
        "https://www.nist.gov/itl/products-and-services/emnist-dataset",
        _EMNIST,
    )


#: dataset registry name -> expected files (image-folder and LEAF datasets have no fixed file list).
FILES: dict[str, DatasetFiles] = {
    # (official .gz md5, decompressed payload md5); confirmed against ../shared/data, whose .gz files are
    # re-compressed (different gzip bytes) but whose payloads match the published raw-file md5s.
    "mnist": DatasetFiles(
        "mnist",
        _idx_files(
            "mnist",
            _MNIST_MIRRORS,
            {
                "train-images-idx3-ubyte.gz": (
                    "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                    "6bbc9ace898e44ae57da46a324031adb",
                ),
                "train-labels-idx1-ubyte.gz": (
                    "d53e105ee54ea40749a09fcbcd1e9432",
                    "a25bea736e30d166cdddb491f175f624",
                ),
                "t10k-images-idx3-ubyte.gz": (
                    "9fb629c4189551a2d022fa330f9573f3",
                    "2646ac647ad5339dbf082846283269ea",
                ),
                "t10k-labels-idx1-ubyte.gz": (
                    "ec29112dd5afa0611ce80d1b7f02629c",
                    "27ae3e4e09519cfbb04c329615203637",
                ),
            },
        ),
        "http://yann.lecun.com/exdb/mnist/",
    ),
    "fashion_mnist": DatasetFiles(
        "fashion-mnist",
        _idx_files(
            "fashion-mnist",
            _FASHION_URL,
            {
                "train-images-idx3-ubyte.gz": (
                    "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                    "f4a8712d7a061bf5bd6d2ca38dc4d50a",
                ),
                "train-labels-idx1-ubyte.gz": (
                    "25c81989df183df01b3e8a0aad5dffbe",
                    "9018921c3c673c538a1fc5bad174d6f9",
                ),
                "t10k-images-idx3-ubyte.gz": (
                    "bef4ecab320f06d8554ea6380940ec79",
                    "8181f5470baa50b63fa0f6fddb340f0a",
                ),
                "t10k-labels-idx1-ubyte.gz": (
                    "bb300cfdad3c16e7a12a480ee83cd310",
                    "15d484375f8d13e6eb1aabb0c3f46965",
                ),
            },
        ),
        "https://github.com/zalandoresearch/fashion-mnist",
    ),
    "emnist_balanced": _emnist("balanced"),
    "emnist_letters": _emnist("letters"),
    "cifar10": DatasetFiles(
        "cifar-10-batches-py",
        tuple(
            FileSpec(f"cifar-10-batches-py/{n}", f"md5:{d}")
            for n, d in (
                ("data_batch_1", "c99cafc152244af753f735de768cd75f"),
                ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
                ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"),
                ("data_batch_4", "634d18415352ddfa80567beed471001a"),
                ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb"),
                ("test_batch", "40351d587109b95175f43aff81a1287e"),
            )
        ),
        "https://www.cs.toronto.edu/~kriz/cifar.html",
        Archive(
            "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "md5:c58f30108f718f92721af3b95e74349a"
        ),
    ),
    "cifar100": DatasetFiles(
        "cifar-100-python",
        (
            FileSpec("cifar-100-python/train", "md5:16019d7e3df5f24257cddd939b257f8d"),
            FileSpec("cifar-100-python/test", "md5:f0ef6b0ae62326f3e7ffdfab6717acfc"),
        ),
        "https://www.cs.toronto.edu/~kriz/cifar.html",
        Archive(
            "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "md5:eb9058c3a382ffc7106e4002c42a8d85"
        ),
    ),
    "svhn": DatasetFiles(
        "svhn",
        (
            FileSpec(
                "svhn/train_32x32.mat",
                "md5:e26dedcc434d2e4c54c9b2d4a06d8373",
                urls=("http://ufldl.stanford.edu/housenumbers/train_32x32.mat",),
            ),
            FileSpec(
                "svhn/test_32x32.mat",
                "md5:eb5a983be6a315427106f1b164d9cef3",
                urls=("http://ufldl.stanford.edu/housenumbers/test_32x32.mat",),
            ),
        ),
        "http://ufldl.stanford.edu/housenumbers/",
    ),
}


# --------------------------------------------------------------------------------------------- checksums
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


def _stamp_lookup(path: Path, digests: Sequence[str]) -> bool:
    key = _stamp_key(path)
    if any((*key, d) in _MEMO for d in digests):
        return True
    try:
        entry = json.loads((path.parent / STAMP).read_text()).get(path.name)
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(entry, dict)
        and entry.get("size") == key[1]
        and entry.get("mtime_ns") == key[2]
        and entry.get("digest") in digests
    )


def _stamp_record(path: Path, digest: str) -> None:
    key = _stamp_key(path)
    _MEMO.add((*key, digest))
    stamp = path.parent / STAMP
    try:
        try:
            table = json.loads(stamp.read_text())
            table = table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            table = {}
        table[path.name] = {"size": key[1], "mtime_ns": key[2], "digest": digest}
        # write-then-rename so concurrent loaders never read half a stamp
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verified-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, stamp)
    except OSError:
        pass  # read-only folder: the in-memory memo still spares rehashing in this process


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
                        src = tf.extractfile(m)
                        assert src is not None  # a regular file member always has a stream
                        with src, open(dest, "wb") as out:
                            shutil.copyfileobj(src, out, _CHUNK)
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

    Returns the dataset folder. Files without a published checksum are left to the parsers' checks.
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
