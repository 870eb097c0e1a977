"""Where a node keeps its clients' state versions: Flower's ``Context.state`` or a folder on its disk.

The state client ``c`` produced in round ``r`` is version ``r`` (version 0 is ``init_client(c)``, never
stored). Flower keeps a node's ``Context.state`` in the SuperNode's memory, per Flower run: it is lost when
the SuperNode restarts, and a resumed experiment (a new ``flwr run`` after the ServerApp died) starts with an
empty one. A node given a ``state-dir`` in its node config keeps the versions there instead, under a key of
the experiment (its resolved config and output folder), so they survive both.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Protocol

from flwr.app import ConfigRecord, Context

from fedskew.errors import FedskewError
from fedskew.flower.records import config

#: node-config key: a folder where the node keeps client states across Flower runs and restarts
STATE_DIR_KEY = "state-dir"
STATE_PREFIX = "fedskew.state."  # Context.state key prefix of a client's versions
FLOOR_PREFIX = "fedskew.floor."
#: what a node accepts as the experiment's folder name (the server sends a 20-digit hex key)
EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class Versions(Protocol):
    """A node's store of client state versions (serialized states)."""

    def get(self, cid: int, version: int) -> bytes | None: ...
    def put(self, cid: int, version: int, blob: bytes) -> None: ...
    def floor(self, cid: int) -> int: ...
    def set_floor(self, cid: int, floor: int) -> None: ...
    def drop_below(self, cid: int, floor: int) -> None: ...


class ContextVersions:
    """Versions in Flower's ``Context.state`` (a ``ConfigRecord`` of bytes per client)."""

    def __init__(self, context: Context) -> None:
        self.context = context

    def get(self, cid: int, version: int) -> bytes | None:
        key = STATE_PREFIX + str(cid)
        if key not in self.context.state.config_records:
            return None
        versions = config(self.context.state, key)
        return bytes(versions[str(version)]) if str(version) in versions else None

    def put(self, cid: int, version: int, blob: bytes) -> None:
        key = STATE_PREFIX + str(cid)
        versions = self.context.state.config_records.get(key) or ConfigRecord()
        versions[str(version)] = blob
        self.context.state[key] = versions

    def floor(self, cid: int) -> int:
        key = FLOOR_PREFIX + str(cid)
        return int(config(self.context.state, key)["v"]) if key in self.context.state else 0

    def set_floor(self, cid: int, floor: int) -> None:
        self.context.state[FLOOR_PREFIX + str(cid)] = ConfigRecord({"v": floor})

    def drop_below(self, cid: int, floor: int) -> None:
        versions = self.context.state.get(STATE_PREFIX + str(cid))
        if versions is not None:
            for v in [v for v in versions if int(v) < floor]:
                del versions[v]


class DiskVersions:
    """Versions as files ``<folder>/<cid>/<version>.pt``, written atomically (temporary file, rename)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, cid: int, name: str) -> Path:
        return self.folder / str(cid) / name

    def get(self, cid: int, version: int) -> bytes | None:
        path = self._path(cid, f"{version}.pt")
        return path.read_bytes() if path.is_file() else None

    def _write(self, path: Path, blob: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)

    def put(self, cid: int, version: int, blob: bytes) -> None:
        self._write(self._path(cid, f"{version}.pt"), blob)

    def floor(self, cid: int) -> int:
        path = self._path(cid, "floor")
        return int(path.read_text()) if path.is_file() else 0

    def set_floor(self, cid: int, floor: int) -> None:
        self._write(self._path(cid, "floor"), str(floor).encode())

    def drop_below(self, cid: int, floor: int) -> None:
        for path in (self.folder / str(cid)).glob("*.pt"):
            if int(path.stem) < floor:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


def experiment_folder(root: Path, experiment: str) -> Path:
    """The folder of ``experiment`` under a node's ``state-dir`` ``root``. The name comes from the server
    (a hex key: :func:`fedskew.flower.server.experiment_key`): one that is not a single plain folder name
    (``..``, a separator, an absolute path, a NUL) is refused with one line, never joined to ``root``, so a
    hostile server cannot make the node write or delete files elsewhere."""
    name = experiment or "default"
    if EXPERIMENT_NAME.fullmatch(name) is None:
        raise FedskewError(
            f"the server names this node's state folder {name[:80]!r}, not a single folder name "
            f"({EXPERIMENT_NAME.pattern}); refusing it"
        )
    return root / name


def versions_of(context: Context, experiment: str) -> Versions:
    """The node's store for ``experiment`` (a key naming it): on disk when the node has a ``state-dir``."""
    root = str(context.node_config.get(STATE_DIR_KEY, ""))
    if not root:
        return ContextVersions(context)
    return DiskVersions(experiment_folder(Path(root), experiment))
