"""The server state's per-client tables: in memory up to a budget, the rest on disk, checkpointed exactly.

Why: a :class:`~fedskew.algorithms.server_table.ServerTable` grows with the federation (FedFomo keeps each
client's latest model: 3.1 MB a client for the default MNIST MLP), like clients' states do
(:mod:`fedskew.engine.states`), and is handled the same way. :meth:`TableStore.commit` sees each committed
server state: the rows of its tables (top-level values) that exceed the budget, least recently written
first, are written one ``torch.save`` file each and replaced by :class:`SpilledRow` references, which the
table reads back on access (bit-identical, ``weights_only``). Files live beside the clients' spilled states
(``<out>/client-states/``, or a temporary folder under ``$FEDSKEW_CACHE``), named
``t<table>-r<round>-c<client>.pt``: ``<table>`` a hash of the table's key, ``<round>`` the round the row was
committed in, so a name is never reused for other content. Rows are immutable, so a file is written once.

Checkpoints: :meth:`TableStore.state_dict` turns every table into plain data (the rows in memory, the file
names of the others, the rounds of the rows in memory) that ``torch.load(..., weights_only=True)`` reads;
:meth:`TableStore.load_state_dict` rebuilds the tables, refusing a file name that is not one this store
writes (a name with a path separator or ``..`` is never used as a path). A file is deleted once neither
the committed state nor the last two snapshots name it (``checkpoint.pt`` and ``checkpoint.prev.pt``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedskew.algorithms.base import State
from fedskew.algorithms.server_table import Row, ServerTable, SpilledRow
from fedskew.algorithms.steps import ContractError
from fedskew.engine.states import SpillFolder, fsync, spill_name, state_nbytes, write_file
from fedskew.errors import FedskewError

log = logging.getLogger("fedskew.engine")

#: marks a table in a checkpoint's plain server state (a dict no method would hold)
TABLE_TAG = "__server_table__"
_FORMAT = 1
#: the only file names a checkpoint may give for a spilled row
ROW_FILE = re.compile(r"t[0-9a-f]{8}-r[0-9]+-c[0-9]+\.pt")


def table_tag(key: str) -> str:
    """The file-name part of a table's key (safe characters, whatever the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


class TableStore:
    """Spills, checkpoints and restores the per-client tables of a simulation's server state.

    ``budget_bytes``: memory for the tables' rows together (``None``: no limit, nothing spilled);
    ``folder``: where rows go (``None``: a temporary folder under ``$FEDSKEW_CACHE``, deleted with the
    store); ``device``: where a spilled row is read back to (the server state's device).
    """

    def __init__(
        self, budget_bytes: int | None = None, folder: Path | None = None, device: torch.device | str = "cpu"
    ) -> None:
        self.budget, self._folder, self.device = budget_bytes, folder, str(device)
        self._spill = SpillFolder(folder, "tables-")
        # (key, cid) -> (the row in memory, the round it was committed in, its bytes): new rows measured once
        self._born: dict[tuple[str, int], tuple[Row, int, int]] = {}
        self._files: set[str] = set()  # files this store knows of (written or named by a snapshot)
        self._held: deque[set[str]] = deque(maxlen=2)  # files named by the last two snapshots
        self._written: list[Path] = []  # written since the last snapshot (fsynced by the next)

    def folder(self) -> Path:
        """The spill folder (created on first use)."""
        return self._spill.path()

    # ------------------------------------------------------------------ commit
    def commit(self, round_idx: int, server: State) -> State:
        """``server`` as committed in round ``round_idx``, its tables' oldest rows beyond the budget on disk.
        A row that cannot be written (disk full) stays in memory, with a warning: over budget, never lost."""
        tables = {k: v for k, v in server.items() if isinstance(v, ServerTable)}
        memory: list[tuple[int, str, int, Row, int]] = []  # (round, key, cid, row, bytes)
        born: dict[tuple[str, int], tuple[Row, int, int]] = {}
        for key, table in tables.items():
            for cid, cell in table.cells().items():
                if isinstance(cell, Row):
                    seen = self._born.get((key, cid))
                    if seen is None or seen[0] is not cell:
                        seen = (cell, round_idx, state_nbytes(dict(cell)))
                    born[(key, cid)] = seen
                    memory.append((seen[1], key, cid, cell, seen[2]))
        self._born = born
        total = sum(m[4] for m in memory)
        spilled: dict[str, dict[int, SpilledRow]] = {}
        for r, key, cid, row, nbytes in sorted(memory, key=lambda m: m[:3]):
            if self.budget is None or total <= self.budget:
                break
            name = f"t{table_tag(key)}-r{r}-c{cid}.pt"
            path = self.folder() / name
            try:
                size = write_file(path, dict(row))
            except Exception as err:  # any write failure keeps the row in memory: the round still commits
                log.warning("cannot spill server-table rows to '%s' (%s); keeping them in memory", path, err)
                break
            self._files.add(name)
            if self._folder is not None:
                self._written.append(path)
            spilled.setdefault(key, {})[cid] = SpilledRow(str(path), size, self.device)
            del self._born[(key, cid)]
            total -= nbytes
        if spilled:
            server = {**server, **{k: tables[k].with_cells(v) for k, v in spilled.items()}}
        self._collect(server)
        return server

    def _named(self, server: State) -> set[str]:
        return {
            Path(c.path).name
            for v in server.values()
            if isinstance(v, ServerTable)
            for c in v.cells().values()
            if isinstance(c, SpilledRow)
        }

    def _collect(self, server: State) -> None:
        """Delete the files that neither ``server`` nor the last two snapshots name."""
        keep = self._named(server).union(*self._held)
        for name in self._files - keep:
            with contextlib.suppress(OSError):
                (self.folder() / name).unlink(missing_ok=True)
        self._files &= keep

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, server: State) -> State:
        """``server`` with each table as plain data (``weights_only``-loadable); the files written since the
        last snapshot are flushed to disk first."""
        for path in self._written:
            fsync(path)
        if self._written:
            fsync(self._written[0].parent)
        self._written = []
        self._held.append(self._named(server))
        self._collect(server)
        out: State = {}
        for key, value in server.items():
            if isinstance(value, ServerTable):
                out[key] = self._plain(key, value)
            else:
                _no_nested_table(value, key)
                out[key] = value
        return out

    def _plain(self, key: str, table: ServerTable) -> dict[str, Any]:
        rows, spilled, rounds = {}, {}, {}
        for cid, cell in table.cells().items():
            if isinstance(cell, SpilledRow):
                spilled[cid] = [Path(cell.path).name, cell.size]
            else:
                rows[cid] = dict(cell)
                seen = self._born.get((key, cid))
                rounds[cid] = seen[1] if seen is not None and seen[0] is cell else 0
        return {TABLE_TAG: _FORMAT, "rows": rows, "spilled": spilled, "rounds": rounds}

    def load_state_dict(self, plain: Mapping[str, Any]) -> State:
        """The server state of a :meth:`state_dict` snapshot (its rows already on the server's device)."""
        server: State = {}
        self._born = {}
        named: set[str] = set()
        for key, value in plain.items():
            if not (isinstance(value, dict) and TABLE_TAG in value):
                server[key] = value
                continue
            if value[TABLE_TAG] != _FORMAT:
                raise FedskewError(
                    f"the checkpoint's server table '{key}' has an unknown format; rerun with --force"
                )
            cells: dict[int, Row | SpilledRow] = {}
            for cid, row in value["rows"].items():
                row = Row(row)
                cells[_cid(cid)] = row
                self._born[(key, _cid(cid))] = (
                    row,
                    int(value["rounds"].get(cid, 0)),
                    state_nbytes(dict(row)),
                )
            for cid, (name, size) in value["spilled"].items():
                name = spill_name(name, ROW_FILE, f"server table '{key}' row")
                named.add(name)
                cells[_cid(cid)] = SpilledRow(str(self.folder() / name), int(size), self.device)
            server[key] = ServerTable.of_cells(cells)
        # the snapshot names these; the one before it may name any row file already in the folder
        folder = self._folder
        on_disk = (
            {p.name for p in folder.iterdir() if ROW_FILE.fullmatch(p.name)}
            if folder is not None and folder.is_dir()
            else set()
        )
        self._files = on_disk | named
        self._held.clear()
        self._held.append(set(self._files))
        return server


def _cid(cid: object) -> int:
    if isinstance(cid, bool) or not isinstance(cid, int) or cid < 0:
        raise FedskewError(f"the checkpoint's server table has a row for {str(cid)[:40]!r}, not a client id")
    return cid


def _no_nested_table(value: Any, where: str) -> None:
    """A table is a top-level value of the server state: one deeper would not be spilled nor checkpointed."""
    if isinstance(value, ServerTable):
        raise ContractError(
            f"server state '{where}' holds a ServerTable; tables are top-level server-state values"
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _no_nested_table(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _no_nested_table(v, f"{where}[{i}]")
