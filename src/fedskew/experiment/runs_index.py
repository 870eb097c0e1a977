"""The runs under a folder and their state, for ``fedskew runs DIR``: what finished, what was interrupted (and
resumes with ``--resume``), what failed and what is running now.

A run is a folder holding ``config.yaml`` (the results contract, :mod:`fedskew.experiment.results`). Its
state, read without changing anything:

* **running**: another process holds the folder's ``flock`` on ``.lock`` (the kernel drops it when that
  process dies, so a killed run never looks running, whatever pid the file still holds);
* **failed**: ``summary.json`` says ``status: failed``, or a sweep left ``error.log`` and no summary;
* **finished**: a readable ``summary.json`` covering the rounds ``config.yaml`` asks for;
* **interrupted**: anything else (killed, stopped, or a summary that cannot be read): ``--resume`` continues.

Damaged files never stop the listing: the run gets a ``note`` saying which file could not be read.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from fedskew.engine.states import STATES_DIR
from fedskew.experiment.results import CONFIG_FILE, LOCK_FILE, METRICS_FILE, SUMMARY_FILE

__all__ = ["RunEntry", "find_run_folders", "index_runs", "read_run"]

#: what a sweep writes into a run folder whose run raised (experiment/sweep.py)
ERROR_FILE = "error.log"


@dataclass(frozen=True)
class RunEntry:
    """One run folder: its state, rounds done / asked for, what it runs and its headline metric."""

    folder: Path
    state: str  # finished, interrupted, failed, running
    rounds_done: int
    rounds_total: int | None
    algorithm: str | None
    dataset: str | None
    accuracy: float | None  # the final accuracy; unfinished runs: the last evaluated round's
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "folder": str(self.folder)}


def find_run_folders(root: Path) -> list[Path]:
    """Every folder under ``root`` (``root`` included) holding ``config.yaml``, sorted; a run folder's own
    subfolders (client states, tracker files) are not searched."""
    found: list[Path] = []
    for here, dirs, files in os.walk(root):
        if CONFIG_FILE in files:
            found.append(Path(here))
            dirs.clear()
        else:
            dirs[:] = [d for d in dirs if d != STATES_DIR and not d.startswith(".")]
    return sorted(found)


def is_locked(folder: Path) -> bool:
    """Another process holds the folder's lock (a shared, non-blocking probe, released at once)."""
    path = folder / LOCK_FILE
    try:
        import fcntl
    except ImportError:  # no flock on this platform: no lock to see
        return False
    try:
        fh = open(path)  # noqa: SIM115  (closed below, after the probe)
    except OSError:
        return False
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        return False
    finally:
        fh.close()


def _read_mapping(path: Path, load: Any) -> tuple[dict[str, Any] | None, str]:
    """``(mapping, "")``, ``(None, "")`` when absent, ``(None, note)`` when it cannot be read as one."""
    if not path.is_file():
        return None, ""
    try:
        data = load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        data = None
    if not isinstance(data, dict):
        return None, f"{path.name} unreadable"
    return data, ""


def _last_record(folder: Path) -> dict[str, Any]:
    """The last whole record of ``metrics.jsonl`` (a line cut by a kill is skipped)."""
    path = folder / METRICS_FILE
    if not path.is_file():
        return {}
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in reversed(path.read_text(encoding="utf-8").splitlines()):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and isinstance(record.get("round"), int):
                    return record
    return {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _state(folder: Path, summary: dict[str, Any] | None, total: int | None, done: int) -> str:
    if is_locked(folder):
        return "running"
    if summary is not None and summary.get("status") == "failed":
        return "failed"
    if summary is not None and (total is None or done >= total):
        return "finished"
    return "failed" if (folder / ERROR_FILE).is_file() else "interrupted"


def read_run(folder: Path) -> RunEntry:
    """The :class:`RunEntry` of one run folder (never raises on damaged files: see ``note``)."""
    config, config_note = _read_mapping(folder / CONFIG_FILE, yaml.safe_load)
    summary, summary_note = _read_mapping(folder / SUMMARY_FILE, json.loads)
    cfg = config or {}
    last = _last_record(folder)
    rounds = summary.get("rounds") if summary is not None else None
    done = rounds if isinstance(rounds, int) else int(last.get("round", 0))
    total = cfg.get("rounds") if isinstance(cfg.get("rounds"), int) else None
    final = summary.get("final") if summary is not None else None
    accuracy = _number(final.get("accuracy")) if isinstance(final, dict) else _number(last.get("accuracy"))
    section = {k: v if isinstance(v, dict) else {} for k, v in cfg.items()}
    return RunEntry(
        folder=folder,
        state=_state(folder, summary, total, done),
        rounds_done=done,
        rounds_total=total,
        algorithm=section.get("algorithm", {}).get("name"),
        dataset=section.get("data", {}).get("dataset"),
        accuracy=accuracy,
        note="; ".join(n for n in (config_note, summary_note) if n),
    )


def index_runs(root: Path) -> list[RunEntry]:
    """Every run under ``root`` (:func:`find_run_folders`), read with :func:`read_run`."""
    return [read_run(folder) for folder in find_run_folders(root)]
