"""Clients' committed states: kept in memory up to a budget, the rest spilled to disk, exactly.

Why: personal state grows with the federation, not with the round. SCAFFOLD keeps a control variate the
size of the model for every client that has trained (3.1 MB each for the default MNIST MLP), so a
simulation that kept every state in memory held 3.7 GB at 10,000 clients and 5.2 GB at 100,000 after five
rounds (``benchmarks/load.py``). :class:`SpillingStates` keeps the most recently committed states within
``engine.state_memory_mb`` and writes the others, one ``torch.save`` file each, to a folder: under the
run's output folder (``client-states/``), so ``--resume`` finds them, or a temporary folder under
``$FEDSKEW_CACHE`` for a run without one; never in the data root. A state read back is bit-identical
(``torch.load(..., weights_only=True)``: tensors and plain values, no pickled code).

A client that never trained has no committed state: :meth:`SpillingStates.get` returns its initial
state, built on each request and never kept (a pure function of the config), so evaluating every client
of a large federation does not fill the memory with initial states.

Files are immutable: the state client ``c`` committed in round ``r`` is ``r<r>-c<c>.pt``. A checkpoint
(:meth:`SpillingStates.state_dict`) names the files it needs, and a file is deleted only once neither the
current states nor the last two checkpoints (``checkpoint.pt`` and ``checkpoint.prev.pt``) name it, so a
resume from either finds its states. File contents are not digested (a SHA-256 per spill would cost about
as much as the write); their sizes are checked when read, and a symbolic link in their place is not followed.
A checkpoint's file names are refused unless they are names this store writes (:func:`spill_name`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
import torch.utils.serialization

from fedskew.algorithms.base import State
from fedskew.data.cache import cache_root
from fedskew.errors import FedskewError

log = logging.getLogger("fedskew.engine")

#: the folder of an output folder that holds spilled client states
STATES_DIR = "client-states"
_FORMAT = 2  # state_dict layout: {"format", "memory", "spilled"}
#: the names of spilled client-state files (``r<round>-c<client>.pt``): the only names a checkpoint may give
STATE_FILE = re.compile(r"r[0-9]+-c[0-9]+\.pt")


class ClientStates(Protocol):
    """Where the round transaction keeps clients' committed states (CPU)."""

    def get(self, cid: int) -> State:
        """Client ``cid``'s committed state; a client that never trained gets its initial state."""
        ...

    def commit(self, round_idx: int, states: Mapping[int, State]) -> None:
        """Make ``states`` (new states produced in round ``round_idx``) the clients' committed states."""
        ...

    def trained(self) -> list[int]:
        """The clients that have a committed state, ascending."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """A checkpointable snapshot (``torch.save``-able, loadable with ``weights_only=True``)."""
        ...

    def load_state_dict(self, sd: Mapping[Any, Any]) -> None:
        """Restore a snapshot of :meth:`state_dict` (or a checkpoint's older ``{cid: state}`` mapping)."""
        ...


class SpillFolder:
    """Where a store spills: a run's own ``folder``, or (``None``) a temporary folder under
    ``$FEDSKEW_CACHE/<STATES_DIR>`` named ``<prefix>...``, removed with this object; created on first use."""

    def __init__(self, folder: Path | None, prefix: str) -> None:
        self.folder, self.prefix = folder, prefix
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def path(self) -> Path:
        if self.folder is None:
            if self._tmp is None:
                root = cache_root() / STATES_DIR
                root.mkdir(parents=True, exist_ok=True)
                self._tmp = tempfile.TemporaryDirectory(prefix=self.prefix, dir=root)
            return Path(self._tmp.name)
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder


def state_nbytes(obj: Any) -> int:
    """Bytes of the tensor storages in a nested state (each storage once; a view costs its storage)."""
    seen: dict[int, int] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            storage = o.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(o, Mapping):  # dicts and read-only mappings (a ServerTable and its rows)
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return sum(seen.values())


def spill_name(name: object, pattern: re.Pattern[str], what: str) -> str:
    """A spill file's name read from a checkpoint, if it is one this store writes (``pattern``): a name with a
    path separator or ``..`` in it is never joined to a folder (it could read or delete any file)."""
    if not isinstance(name, str) or pattern.fullmatch(name) is None:
        raise FedskewError(
            f"the checkpoint names {what} file {str(name)[:80]!r}, not a name this run writes "
            f"({pattern.pattern}); refusing it (rerun with --force to start over)"
        )
    return name


def open_no_link(path: Path) -> BinaryIO:
    """``path`` opened for reading, refusing (``OSError``) a symbolic link: a link planted in a crafted output
    folder is never followed out of it."""
    return os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def write_file(path: Path, obj: Any) -> int:
    """``torch.save`` ``obj`` to ``path`` through a temporary file renamed into place; the file's size."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        # torch's zip writer checksums every record; the file is written once and read back by this run
        # only, so the checksum (4x the cost of the write, measured) is skipped
        with torch.utils.serialization.config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
            torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class SpillingStates:
    """Committed client states in memory up to ``budget_bytes``, least recently committed spilled to disk.

    ``initial(cid)``: a never-trained client's state. ``folder``: where spilled states go (created when
    the first one is spilled); ``None``: a temporary folder under ``$FEDSKEW_CACHE``, deleted with the
    store.
    """

    def __init__(
        self, initial: Callable[[int], State], budget_bytes: int, folder: Path | None = None
    ) -> None:
        self.initial, self.budget = initial, int(budget_bytes)
        self._folder = folder
        self._spill = SpillFolder(folder, "run-")
        self._memory: OrderedDict[int, tuple[State, int, int]] = OrderedDict()  # cid -> (state, bytes, round)
        self._spilled: dict[int, tuple[str, int]] = {}  # cid -> (file name, bytes on disk)
        self._bytes = 0
        self._held: deque[set[str]] = deque(maxlen=2)  # files named by the last two snapshots
        self._written: list[Path] = []  # spilled since the last snapshot (fsynced by the next)

    # ------------------------------------------------------------------ reading
    def get(self, cid: int) -> State:
        if cid in self._memory:
            return self._memory[cid][0]
        if cid in self._spilled:
            return self._load(cid)
        return self.initial(cid)

    def trained(self) -> list[int]:
        return sorted([*self._memory, *self._spilled])

    def __contains__(self, cid: object) -> bool:
        return cid in self._memory or cid in self._spilled

    @property
    def memory_bytes(self) -> int:
        """Bytes of the states held in memory (at most the budget after every commit)."""
        return self._bytes

    @property
    def spilled(self) -> int:
        """Clients whose committed state is on disk."""
        return len(self._spilled)

    def folder(self) -> Path:
        """The spill folder (created on first use)."""
        return self._spill.path()

    def _load(self, cid: int) -> State:
        name, size = self._spilled[cid]
        path = self.folder() / name
        state: State | None = None
        try:
            with open_no_link(path) as f:
                if os.fstat(f.fileno()).st_size == size:
                    state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception:  # missing, a link, truncated, a pickle payload: torch raises several types
            state = None
        if not isinstance(state, dict):
            raise FedskewError(
                f"client {cid}'s state file '{path}' is missing or damaged; rerun with --force to start over"
            )
        return state

    # ------------------------------------------------------------------ writing
    def commit(self, round_idx: int, states: Mapping[int, State]) -> None:
        for cid, state in states.items():
            self._forget(cid)
            nbytes = state_nbytes(state)
            self._memory[cid] = (state, nbytes, round_idx)
            self._bytes += nbytes
        self._fit()

    def _forget(self, cid: int) -> None:
        """Drop ``cid``'s committed state (it is being replaced)."""
        if cid in self._memory:
            self._bytes -= self._memory.pop(cid)[1]
        elif cid in self._spilled:
            name, _ = self._spilled.pop(cid)
            if not any(name in held for held in self._held):
                with contextlib.suppress(OSError):
                    (self.folder() / name).unlink(missing_ok=True)

    def _fit(self) -> None:
        """Spill the least recently committed states until the rest fit the budget. A state that cannot be
        written (disk full) stays in memory, with a warning: over budget, never lost."""
        while self._bytes > self.budget and self._memory:
            cid, (state, nbytes, round_idx) = next(iter(self._memory.items()))
            name = f"r{round_idx}-c{cid}.pt"
            try:
                size = self._write(name, state)
            except OSError as err:
                log.warning(
                    "cannot spill client states to '%s' (%s); keeping them in memory", self.folder(), err
                )
                return
            del self._memory[cid]
            self._spilled[cid] = (name, size)
            self._bytes -= nbytes

    def _write(self, name: str, state: State) -> int:
        """Write ``state`` as ``name`` in the spill folder (a temporary file, renamed); its size."""
        path = self.folder() / name
        size = write_file(path, state)
        if self._folder is not None:  # a run's own folder: flushed to disk by the next checkpoint
            self._written.append(path)
        return size

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The states in memory and the names of the spilled ones; files spilled since the last snapshot
        are flushed to disk first, and files no snapshot kept names any more are deleted."""
        for path in self._written:
            fsync(path)
        if self._written:
            fsync(self._written[0].parent)
        self._written = []
        named = {name for name, _ in self._spilled.values()}
        dropped = set().union(*self._held) - named if self._held else set()
        self._held.append(named)
        for name in dropped - set().union(*self._held):
            (self.folder() / name).unlink(missing_ok=True)
        return {
            "format": _FORMAT,
            "memory": {cid: state for cid, (state, _, _) in self._memory.items()},
            "rounds": {cid: r for cid, (_, _, r) in self._memory.items()},
            "spilled": {cid: list(entry) for cid, entry in self._spilled.items()},
        }

    def load_state_dict(self, sd: Mapping[Any, Any]) -> None:
        self._memory.clear()
        self._spilled.clear()
        self._bytes = 0
        if sd.get("format") != _FORMAT:  # a checkpoint of an older version: {cid: state}, all in memory
            self.commit(0, {int(cid): state for cid, state in sd.items()})
            return
        for cid, (name, size) in sd["spilled"].items():
            self._spilled[int(cid)] = (spill_name(name, STATE_FILE, "a client-state"), int(size))
        rounds = sd.get("rounds", {})
        for cid, state in sd["memory"].items():
            nbytes = state_nbytes(state)
            self._memory[int(cid)] = (state, nbytes, int(rounds.get(cid, 0)))
            self._bytes += nbytes
        # the checkpoint resumed from names these; the one before it (checkpoint.prev.pt) may name any file
        # already in the folder: keep them all until two more snapshots have been taken
        folder = self._folder
        on_disk = (
            {p.name for p in folder.iterdir() if STATE_FILE.fullmatch(p.name)}
            if folder is not None and folder.is_dir()
            else set()
        )
        self._held.clear()
        self._held.append(on_disk | {name for name, _ in self._spilled.values()})
        self._fit()

    def items(self) -> Iterator[tuple[int, State]]:
        """Every committed state, ascending by client (spilled ones read back one at a time)."""
        for cid in self.trained():
            yield cid, self.get(cid)


class JobStates(Mapping[int, State]):
    """The states of a round's clients, read from the store when an executor asks for one: a sequential
    round holds one never-trained client's initial state at a time, not all of them."""

    def __init__(self, store: ClientStates, cids: list[int]) -> None:
        self.store, self.cids, self._members = store, cids, frozenset(cids)

    def __getitem__(self, cid: int) -> State:
        if cid not in self._members:
            raise KeyError(cid)
        return self.store.get(cid)

    def __iter__(self) -> Iterator[int]:
        return iter(self.cids)

    def __len__(self) -> int:
        return len(self.cids)
