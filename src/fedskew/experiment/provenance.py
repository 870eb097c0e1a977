"""Where a result came from: ``summary.json["provenance"]`` and the provenance lines of every report.

A table is only as good as the trail back to what produced it, so every run records (issue 54, item 3):

* ``command``: the command line when the run was started by the ``fedskew`` CLI (``main`` calls
  :func:`record_command`; the line travels in ``$FEDSKEW_COMMAND`` to the processes a run starts: sweep
  workers, Flower apps), else ``None`` and ``entry``, the Python program that called the library;
* ``fedskew``: the version, and the git commit and dirty flag when the package is imported from a git
  checkout (``git`` with a short timeout; ``None`` outside a checkout, without git, or when git is slow);
* ``versions``: Python, torch, numpy and flwr (``None`` when not installed; read from the installed
  metadata, flwr is not imported);
* ``machine``: the platform, the cores and those this process may use, the torch threads in use, and the
  device the run trained on;
* ``config_changes``: the config's difference from the defaults (``build_config({})``) as a flat
  ``{dotted.key: value}``, computed on the config as given (``engine.device: auto`` stays ``auto``; the
  device it resolved to is in ``machine``); a default key the config lacks is recorded as ``None``;
* ``started_round`` and, after a resume, ``resumed_from``: the provenance of the earlier processes of the
  run (oldest first), kept in the checkpoint, so a run resumed on another machine or commit says so.

:func:`compare` tells which of these differ between the runs of a report.
"""

from __future__ import annotations

import functools
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fedskew
from fedskew import threads

if TYPE_CHECKING:  # the CLI imports this module for record_command before anything heavy
    from fedskew.experiment.config import Config

#: the environment variable carrying the CLI's command line to the processes a run starts
COMMAND_ENV = "FEDSKEW_COMMAND"
#: seconds one git call may take (a network file system, a huge repository): past it, no git entry
GIT_TIMEOUT = 3.0
#: the packages whose versions are recorded (as installed; a missing one is ``None``)
PACKAGES = ("torch", "numpy", "flwr")


def record_command(argv: Sequence[str]) -> None:
    """Record the CLI's command line (``fedskew`` and its arguments) for the runs of this process and
    of the processes it starts."""
    command = shlex.join(["fedskew", *argv[1:]])
    os.environ[COMMAND_ENV] = command.replace("\0", "\\0")  # an environment value cannot hold a NUL


@functools.lru_cache(maxsize=4)
def git_state(folder: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` when ``folder`` (the package's) is tracked in a git checkout, else
    ``None``; never raises. Tracked, not merely inside a work tree: a package installed into a virtual
    environment inside some other repository must not record that repository's commit. Dirty counts
    tracked files only (``None`` when the status could not be read in time)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(folder), *args],
                capture_output=True,
                text=True,
                timeout=GIT_TIMEOUT,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):  # no git, a timeout, an unreadable folder
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    if not commit or git("ls-files", "--error-unmatch", "__init__.py") is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def package_versions() -> dict[str, str | None]:
    """Python and the :data:`PACKAGES` versions, from the installed metadata (nothing is imported)."""

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), **{name: version(name) for name in PACKAGES}}


def machine(device: str) -> dict[str, Any]:
    """The platform, the cores (all, and those this process may run on), the threads and the device."""
    return {
        "platform": platform.platform(terse=True),
        "cores": os.cpu_count(),
        "usable_cores": threads.affinity_cores(),
        "threads": threads.threads_in_use(),
        "device": device,
    }


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    from fedskew.experiment.config import build_config

    return build_config({}).to_dict()


def config_changes(config: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``config`` (a config mapping) whose value differs from the defaults, flat and sorted
    (:func:`fedskew.experiment.config_diff.flat_diff`). A default key the config lacks is ``None``, unless
    the config sets keys below it (``data.options`` holds ``{}`` by default, ``data.options.x`` a config)."""
    from fedskew.experiment.config_diff import flat_diff

    diff = flat_diff(_defaults(), config)
    return {
        k: new
        for k, (_, new) in diff.items()
        if not (new is None and any(key.startswith(f"{k}.") for key in diff))
    }


def collect(cfg: Config, device: str | None = None, started_round: int = 0) -> dict[str, Any]:
    """The provenance of a run of ``cfg`` (as given, before its device is resolved) in this process;
    ``device``: the device it trains on (default: the config's)."""
    command = os.environ.get(COMMAND_ENV)
    git = git_state(Path(fedskew.__file__).resolve().parent)
    return {
        "command": command,
        "entry": None if command is not None else shlex.join(sys.argv[:1]) or None,
        "fedskew": {
            "version": fedskew.__version__,
            "commit": None if git is None else git["commit"],
            "dirty": None if git is None else git["dirty"],
        },
        "versions": package_versions(),
        "machine": machine(device or cfg.engine.device),
        "config_changes": config_changes(cfg.to_dict()),
        "started_round": started_round,
    }


def recorded_threads(previous: dict[str, Any] | None) -> int | None:
    """The torch threads the run of a checkpoint's provenance ``previous`` trained with (``None``: not
    recorded). A resume under ``engine.threads: auto`` keeps it: thread counts change the last bits of CPU
    reductions, and the automatic count depends on the load when a process starts, so re-deciding it would
    make the resumed rounds differ from an uninterrupted run's."""
    machine_ = previous.get("machine") if isinstance(previous, dict) else None
    count = machine_.get("threads") if isinstance(machine_, dict) else None
    return count if isinstance(count, int) and count > 0 else None


def resumed(current: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """``current`` with the checkpoint's provenance (``previous``, if any) and its own earlier entries
    appended to ``resumed_from`` (oldest first)."""
    if not isinstance(previous, dict):
        return current
    earlier = [p for p in previous.get("resumed_from", []) if isinstance(p, dict)]
    entry = {k: v for k, v in previous.items() if k != "resumed_from"}
    return {**current, "resumed_from": [*earlier, entry]}


# ---------------------------------------------------------------------------- comparing runs
#: what two runs of one table should share, by label: (section, key) in the provenance
COMPARED = {
    "fedskew": ("fedskew", "version"),
    "commit": ("fedskew", "commit"),
    "dirty": ("fedskew", "dirty"),
    "python": ("versions", "python"),
    "torch": ("versions", "torch"),
    "numpy": ("versions", "numpy"),
    "flwr": ("versions", "flwr"),
    "cores": ("machine", "cores"),
    "threads": ("machine", "threads"),
    "device": ("machine", "device"),
}
#: the value of a key in runs that recorded no provenance (written before it existed)
UNRECORDED = "unrecorded"


def _entries(prov: Any) -> list[dict[str, Any]]:
    """A run's provenance and those of the processes it was resumed from."""
    if not isinstance(prov, dict):
        return []
    return [prov, *(p for p in prov.get("resumed_from", []) if isinstance(p, dict))]


def _value(entry: dict[str, Any], where: tuple[str, str]) -> str:
    section = entry.get(where[0])
    value = section.get(where[1]) if isinstance(section, dict) else None
    if where[1] == "commit" and isinstance(value, str):
        return value[:12]
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def compare(provenances: Sequence[Any]) -> dict[str, dict[str, int]]:
    """``{label: {value: runs}}`` for each :data:`COMPARED` key over the runs' provenances (a resumed run
    counts every process it ran in); a run without provenance counts as :data:`UNRECORDED`."""
    out: dict[str, dict[str, int]] = {label: {} for label in COMPARED}
    for prov in provenances:
        entries = _entries(prov)
        for label, where in COMPARED.items():
            values = {_value(e, where) for e in entries} or {UNRECORDED}
            for v in values:
                out[label][v] = out[label].get(v, 0) + 1
    return out


def differing(compared: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The keys of :func:`compare` with more than one value."""
    return {label: counts for label, counts in compared.items() if len(counts) > 1}


def describe(compared: dict[str, dict[str, int]]) -> str:
    """One line: the shared values (``fedskew 0.1.0, commit 20193d31e740, ...``) and, when runs differ,
    ``runs differ in commit: abc (2 runs), def (1 run)``."""
    if all(set(c) == {UNRECORDED} for c in compared.values()):
        return "provenance: not recorded (runs written before fedskew recorded it)"
    same = [f"{label} {next(iter(c))}" for label, c in compared.items() if len(c) == 1]
    text = "provenance: " + (", ".join(same) or "—")
    differ = differing(compared)
    if differ:
        parts = [
            f"{label}: " + ", ".join(f"{v} ({n} run{'s' * (n != 1)})" for v, n in sorted(counts.items()))
            for label, counts in differ.items()
        ]
        text += "; RUNS DIFFER in " + "; ".join(parts)
    return text


def for_run(cfg: Config, device: str, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """The provenance a run of ``cfg`` (as given) on ``device`` records, resumed from ``checkpoint``
    (``None``: a fresh start)."""
    if checkpoint is None:
        return collect(cfg, device)
    here = collect(cfg, device, started_round=int(checkpoint.get("round", 0)))
    return resumed(here, checkpoint.get("provenance"))
