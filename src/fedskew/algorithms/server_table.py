"""Per-client server state: a read-only table ``cid -> row`` (a small dict of tensors), copy-on-write.

Why: methods whose server keeps something per client (FedFomo: each client's latest model and its row of
the affinity matrix; FedPAC: each client's next head) held it as ``[N, ...]`` tensors and cloned all of
them every round, because a hook may not change the state it was handed. At N = 1,000 clients that is N
models copied per round to change the 20 that uploaded. A :class:`ServerTable` is the same state as rows:
:meth:`ServerTable.with_rows` returns a new table that shares every untouched row with the old one (their
tensors are the same objects), so updating k rows copies k rows' tensors and N references, never N rows.
Rows exist only for the clients that have one (a never-sampled client costs nothing); a method reads a
default for the others (``table.get(cid, default)``).

Purity: a table and its rows have no way to be changed in place. ``table[cid] = ...``, ``del table[cid]``
and ``row[name] = ...`` raise :class:`ContractError`; a row's tensors are shared, like the server's
weights in a broadcast payload, and never written in place (the contract tests fingerprint every server
state, tables included). A hook that changes rows returns ``table.with_rows(...)``.

Large tables: the engine keeps the rows of the committed server state's tables within a memory budget and
writes the others to disk (:mod:`fedskew.engine.table_store`); such a row is a :class:`SpilledRow`, read
back (``torch.load(..., weights_only=True)``, its size checked) each time it is indexed, so a hook never
sees the difference. A table is a top-level value of the server state (``{"clients": ServerTable()}``):
that is where the engine looks for tables to spill and to checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from fedskew.algorithms.steps import ContractError
from fedskew.errors import FedskewError

__all__ = ["Row", "ServerTable", "SpilledRow"]

_READ_ONLY = "is read-only: a hook returns table.with_rows({cid: new_row}) instead of changing it"


class Row(Mapping[str, Any]):
    """One client's row: a read-only mapping of names to tensors (or small plain values)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        for name in data:
            if not isinstance(name, str):
                raise ContractError(f"a server-table row's names are strings, not {type(name).__name__}")
        self._data = dict(data)

    def __getitem__(self, name: str) -> Any:
        return self._data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setitem__(self, name: str, value: Any) -> NoReturn:
        raise ContractError(f"a server-table row {_READ_ONLY}")

    def __delitem__(self, name: str) -> NoReturn:
        raise ContractError(f"a server-table row {_READ_ONLY}")

    def __repr__(self) -> str:
        return f"Row({sorted(self._data)})"


@dataclass(frozen=True)
class SpilledRow:
    """A row the engine wrote to disk: its file, the file's size (checked when read) and the device it is
    read onto."""

    path: str
    size: int
    device: str = "cpu"

    def load(self) -> Row:
        try:  # O_NOFOLLOW: a link planted in a crafted output folder is not followed out of it
            with os.fdopen(os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
                ok = f.seek(0, 2) == self.size
                f.seek(0)
                data = torch.load(f, map_location=self.device, weights_only=True) if ok else None
        except (OSError, RuntimeError, EOFError):
            data = None
        if not isinstance(data, dict):
            raise FedskewError(
                f"server-table row file '{self.path}' is missing or damaged; rerun with --force to start over"
            )
        return Row(data)


Cell = Row | SpilledRow


class ServerTable(Mapping[int, Row]):
    """Read-only ``cid -> Row``, iterated in ascending client order; new tables share unchanged rows."""

    __slots__ = ("_cells",)

    def __init__(self, rows: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        self._cells: dict[int, Cell] = {}
        if rows:
            self._cells = ServerTable._merged({}, rows)

    @staticmethod
    def _merged(
        cells: Mapping[int, Cell], updates: Mapping[int, Mapping[str, Any] | Cell]
    ) -> dict[int, Cell]:
        out = dict(cells)  # N references: the rows themselves are shared
        for cid, row in updates.items():
            if isinstance(cid, bool) or not isinstance(cid, int) or cid < 0:
                raise ContractError(f"a server table is keyed by client ids (int >= 0), not {cid!r}")
            out[cid] = row if isinstance(row, (Row, SpilledRow)) else Row(row)
        return out

    @classmethod
    def of_cells(cls, cells: Mapping[int, Cell]) -> ServerTable:
        """A table of rows and spilled rows as they are (the engine: spilling, checkpoints)."""
        table = cls()
        table._cells = ServerTable._merged({}, cells)
        return table

    # ------------------------------------------------------------------ reading
    def __getitem__(self, cid: int) -> Row:
        cell = self._cells[cid]
        return cell.load() if isinstance(cell, SpilledRow) else cell

    def __contains__(self, cid: object) -> bool:
        return cid in self._cells

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._cells))

    def __len__(self) -> int:
        return len(self._cells)

    def ids(self) -> Tensor:
        """The clients that have a row, ascending (int64)."""
        return torch.tensor(sorted(self._cells), dtype=torch.long)

    def cells(self) -> Mapping[int, Cell]:
        """Every row as held, a :class:`SpilledRow` not read back (the engine's view, read-only)."""
        return dict(self._cells)

    # ------------------------------------------------------------------ deriving
    def with_rows(self, updates: Mapping[int, Mapping[str, Any]]) -> ServerTable:
        """A new table with ``updates``' rows (added or replaced); this table is unchanged and the new one
        shares every other row with it."""
        table = ServerTable()
        table._cells = ServerTable._merged(self._cells, updates)
        return table

    def with_cells(self, updates: Mapping[int, Cell]) -> ServerTable:
        """:meth:`with_rows` for rows as held (the engine replaces rows by :class:`SpilledRow` references)."""
        table = ServerTable()
        table._cells = ServerTable._merged(self._cells, updates)
        return table

    def __setitem__(self, cid: int, row: Any) -> NoReturn:
        raise ContractError(f"a server table {_READ_ONLY}")

    def __delitem__(self, cid: int) -> NoReturn:
        raise ContractError(f"a server table {_READ_ONLY}")

    def __repr__(self) -> str:
        spilled = sum(isinstance(c, SpilledRow) for c in self._cells.values())
        return f"ServerTable({len(self._cells)} rows, {spilled} on disk)"
