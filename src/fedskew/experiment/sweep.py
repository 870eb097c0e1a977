"""Sweeps: the cross product of configs × grid points × seeds, one result folder per run, run in parallel
processes; finished runs are skipped and interrupted ones resumed, so rerunning a sweep continues it.

A run's folder is ``OUT/<name>/seed<k>``. ``<name>`` comes from a template, by default ``{stem}/{grid}``:
the config file's stem, then the grid point as ``key=value,...`` (empty parts dropped). Template fields
are ``stem``, ``grid`` and any dotted key of the run's resolved config (``{algorithm.name}``,
``{data.partition.alpha}``), so a sweep can keep an existing folder layout. Field values are sanitised to
``[A-Za-z0-9._+=,-]``.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import re
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config, read_saved_config, results_config
from fedskew.experiment.config_marks import MarkedConfig, locate, read_marked
from fedskew.experiment.report import flatten_config, value_text
from fedskew.experiment.runner import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    recorded_config,
)
from fedskew.experiment.sweep_grid import Axis, check_axes_used, preview, scope_axis, skip_reason

DEFAULT_NAME = "{stem}/{grid}"
#: a failed run's traceback, in its folder (removed when the run later succeeds)
ERROR_FILE = "error.log"

_SEEDS = re.compile(r"^(\d+)(?:-(\d+))?$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,-]+")
_OPEN, _CLOSE = "[{(", "]})"


class RunState(enum.Enum):
    NEW = "new"
    INTERRUPTED = "interrupted"  # results started (checkpoint or metrics) but no summary: resumed
    FINISHED = "finished"  # summary.json written: skipped


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its config file, the overrides applied to it, its seed and its folder."""

    config_path: Path
    overrides: tuple[str, ...]
    seed: int
    folder: Path
    config: dict[str, Any] = field(compare=False, repr=False)  # the resolved config it will run

    @property
    def state(self) -> RunState:
        return run_state(self.folder)

    @property
    def rounds(self) -> int:
        return int(self.config["rounds"])


def run_state(folder: Path) -> RunState:
    """Finished when ``summary.json`` exists; interrupted when a checkpoint or metrics exist without it."""
    if (folder / SUMMARY_FILE).is_file():
        return RunState.FINISHED
    if (folder / CHECKPOINT_FILE).is_file() or (folder / METRICS_FILE).is_file():
        return RunState.INTERRUPTED
    return RunState.NEW


# ---------------------------------------------------------------------------- command-line values
def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"``, ``"0-9"`` or a mix (``"0-2,7"``) -> the seeds in order, without repeats."""
    seeds: list[int] = []
    for token in text.split(","):
        m = _SEEDS.match(token.strip())
        if m is None or int(m[2] or m[1]) < int(m[1]):
            raise ConfigError(f"--seeds '{text}': expected seeds and ranges such as 0,1,2 or 0-9")
        seeds += [s for s in range(int(m[1]), int(m[2] or m[1]) + 1) if s not in seeds]
    return seeds


def split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes, so a value may be a YAML list: ``[1,2],[3]``."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN or ch in _CLOSE:
            depth += 1 if ch in _OPEN else -1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
        if depth < 0:
            break
    if depth != 0 or quote:
        raise ConfigError(f"'{text}': unbalanced brackets or quotes")
    return [*parts, text[start:].strip()]


def parse_grid(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``["client.lr=0.01,0.1", ...]`` -> ``[("client.lr", ["0.01", "0.1"]), ...]`` (values as typed;
    they are parsed as YAML like ``--set`` values when the config is built)."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            raise ConfigError(f"--grid '{spec}': expected key=v1,v2,... e.g. client.lr=0.01,0.1")
        if key == "seed":
            raise ConfigError(f"--grid '{spec}': give seeds with --seeds, e.g. --seeds 0-4")
        if key in (k for k, _ in axes):
            raise ConfigError(f"--grid '{spec}': key '{key}' given twice; list all its values in one --grid")
        try:
            vals = split_values(values)
        except ConfigError as err:
            raise ConfigError(f"--grid {err}") from None
        if not all(vals):
            raise ConfigError(f"--grid '{spec}': empty value; expected key=v1,v2,...")
        axes.append((key, vals))
    return axes


# ---------------------------------------------------------------------------- folder names
def sanitize(text: str) -> str:
    """Folder-safe text: runs of other characters become ``_``."""
    return _UNSAFE.sub("_", text).strip("_") or "_"


class _NameFormatter(string.Formatter):
    """``str.format`` whose fields are ``stem``, ``grid`` or dotted config keys, sanitised."""

    def __init__(self, fields: dict[str, str], config: dict[str, Any], template: str) -> None:
        super().__init__()
        self.fields, self.flat, self.template = fields, flatten_config(config), template

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Any) -> tuple[Any, str]:
        if field_name in self.fields:
            return self.fields[field_name], field_name
        if field_name not in self.flat:
            raise ConfigError(
                f"--name '{self.template}': unknown field '{field_name}'; use stem, grid or a config key "
                "such as algorithm.name"
            )
        return sanitize(value_text(self.flat[field_name])), field_name


def render_name(template: str, stem: str, grid: str, config: dict[str, Any]) -> Path:
    """The group folder of a run (relative to the sweep's ``--out``)."""
    try:
        text = _NameFormatter({"stem": sanitize(stem), "grid": grid}, config, template).format(template)
    except ConfigError:
        raise
    except (ValueError, IndexError) as err:  # str.format's own errors: unbalanced braces, {0}
        raise ConfigError(f"--name '{template}': {err}") from None
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ConfigError(f"--name '{template}': gives the folder '{text}'; expected a relative name")
    return Path(*parts)


# ---------------------------------------------------------------------------- planning
def check_saved_config(run: PlannedRun) -> None:
    """A folder that already holds another config is refused (it would be skipped or resumed wrongly)."""
    saved = run.folder / CONFIG_FILE
    if not saved.is_file():
        return
    planned = recorded_config(build_config(run.config)).to_dict()  # as the run will record it
    old = flatten_config(results_config(read_saved_config(saved)))
    new = flatten_config(results_config(planned))
    diff = [k for k in sorted(old.keys() | new.keys()) if old.get(k, ...) != new.get(k, ...)]
    if diff:
        k = diff[0]
        raise ConfigError(
            f"sweep: '{run.folder}' holds a run of another config ({k}: {old.get(k)!r} saved, "
            f"{new.get(k)!r} planned); use another --out or --name, or remove that folder"
        )


@dataclass(frozen=True)
class SkippedPoint:
    """A grid point of a config that its run cannot take (``sweep_grid``): not planned, for any seed."""

    config_path: Path
    overrides: tuple[str, ...]
    reason: str

    def line(self) -> str:
        sets = "".join(f" --set {o}" for o in self.overrides)
        return f"skipped: {self.config_path}{sets}: {self.reason}"


@dataclass
class SweepPlan:
    """The runs of a sweep, and the grid points skipped because their run cannot take them."""

    runs: list[PlannedRun] = field(default_factory=list)
    skipped: list[SkippedPoint] = field(default_factory=list)


class _Skip(Exception):
    def __init__(self, point: SkippedPoint, axis: str) -> None:
        super().__init__(point.reason)
        self.point, self.axis = point, axis


def _plan_one(
    doc: MarkedConfig,
    out: Path,
    point: list[tuple[Axis, str]],
    seed: int | None,
    sets: Sequence[str],
    name: str,
) -> PlannedRun:
    overrides = (*sets, *(f"{a.target}={v}" for a, v in point))
    every = [*overrides, *([f"seed={seed}"] if seed is not None else [])]
    try:
        cfg = build_config(doc.data, every, base=doc.path.resolve().parent).to_dict()
    except ConfigError as err:
        why = skip_reason(err, point)
        if why is None:
            raise locate(err, doc, every) from None
        raise _Skip(SkippedPoint(doc.path, overrides, why[0]), why[1]) from None
    grid = ",".join(f"{sanitize(a.target)}={sanitize(v)}" for a, v in point)
    group = render_name(name, doc.path.stem, grid, cfg)
    folder = out / group / f"seed{cfg['seed']}"
    cfg["name"] = group.as_posix()  # the run's group in trackers (watch-only: config.WATCH_ONLY)
    return PlannedRun(doc.path, overrides, cfg["seed"], folder, cfg)


def _where(doc: MarkedConfig, out: Path, point: list[tuple[Axis, str]], seed: int | None, name: str) -> str:
    """The folder a run that failed to plan would have had, as far as its raw config tells (else its file)."""
    raw = preview(doc.data, [f"{a.target}={v}" for a, v in point])
    grid = ",".join(f"{sanitize(a.target)}={sanitize(v)}" for a, v in point)
    try:
        group = render_name(name, doc.path.stem, grid, raw)
    except ConfigError:
        return str(doc.path)
    return str(out / group / f"seed{seed if seed is not None else raw.get('seed', 0)}")


@contextlib.contextmanager
def _notes_once() -> Iterator[None]:
    """Each ``--set`` note once while a sweep is planned (its seeds would repeat it)."""
    seen: set[str] = set()

    def first(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return text not in seen and not seen.add(text)  # type: ignore[func-returns-value]

    logger = logging.getLogger("fedskew.config")
    logger.addFilter(first)
    try:
        yield
    finally:
        logger.removeFilter(first)


def plan_runs(
    configs: Sequence[str | Path],
    out: str | Path,
    seeds: Sequence[int] | None = None,
    grid: Sequence[str] = (),
    sets: Sequence[str] = (),
    name: str = DEFAULT_NAME,
) -> SweepPlan:
    """Every run of the sweep, seed-major (all configs and grid points of a seed before the next seed, so
    that paired comparisons fill in early), and the grid points skipped (``sweep_grid``). Builds every
    run's config up front; raises ConfigError (``sweep: <run folder>: <problem>``) before anything runs."""
    axes = [scope_axis(k, vals) for k, vals in parse_grid(grid)]
    points = list(itertools.product(*[[(a, v) for v in a.values] for a in axes]))
    docs = [read_marked(Path(c)) for c in configs]
    plan, owners, used, skips = SweepPlan(), dict[Path, PlannedRun](), set[str](), dict[str, str]()
    settled: set[tuple[Any, ...]] = set()  # (config, grid point) skipped, for every seed
    with _notes_once():
        seed_list: Sequence[int | None] = seeds or [None]
        for seed in seed_list:
            planned: set[tuple[Any, ...]] = set()
            for doc, full in itertools.product(docs, points):
                raw = preview(doc.data, [*sets, *(f"{a.target}={v}" for a, v in full if a.section is None)])
                point = [(a, v) for a, v in full if a.applies(raw)]
                key = (doc.path, tuple((a.key, v) for a, v in point))
                if key in planned or key in settled:
                    continue  # a scoped key left out made it another point's run
                planned.add(key)
                try:
                    run = _plan_one(doc, Path(out), point, seed, sets, name)
                except _Skip as skip:
                    settled.add(key)
                    plan.skipped.append(skip.point)
                    skips.setdefault(skip.axis, skip.point.reason)
                    continue
                except ConfigError as err:
                    raise ConfigError(f"sweep: {_where(doc, Path(out), point, seed, name)}: {err}") from None
                used.update(a.key for a, _ in point)
                other = owners.setdefault(run.folder, run)
                if other is not run:
                    raise ConfigError(
                        f"sweep: {describe(other)} and {describe(run)} would share the folder "
                        f"'{run.folder}'; add distinguishing fields to --name"
                    )
                check_saved_config(run)
                plan.runs.append(run)
    check_axes_used(axes, used, skips)
    return plan


def plan_sweep(
    configs: Sequence[str | Path],
    out: str | Path,
    seeds: Sequence[int] | None = None,
    grid: Sequence[str] = (),
    sets: Sequence[str] = (),
    name: str = DEFAULT_NAME,
) -> list[PlannedRun]:
    """:func:`plan_runs`' runs (the skipped grid points left out)."""
    return plan_runs(configs, out, seeds, grid, sets, name).runs


def describe(run: PlannedRun) -> str:
    """``configs/x.yaml --set a=1 seed 0``: a run as the user would type it."""
    sets = "".join(f" --set {o}" for o in run.overrides)
    return f"{run.config_path}{sets} seed {run.seed}"


# ---------------------------------------------------------------------------- running
class SweepListener:
    """Progress of a sweep, called in the parent process; the default methods do nothing."""

    def run_started(self, run: PlannedRun) -> None:
        """``run`` began (or resumed)."""

    def run_round(self, run: PlannedRun, round_: int, accuracy: float | None) -> None:
        """``run`` completed round ``round_`` (``accuracy`` when that round was evaluated)."""

    def run_finished(self, run: PlannedRun, summary: dict[str, Any]) -> None:
        """``run`` wrote its summary."""

    def run_failed(self, run: PlannedRun, message: str) -> None:
        """``run`` raised; ``message`` is one line, the traceback is in its folder's ``error.log``."""


@dataclass
class SweepOutcome:
    """What a sweep did: runs skipped as already finished, finished now, failed (with a one-line reason),
    and left unfinished because the sweep was interrupted."""

    skipped: list[PlannedRun] = field(default_factory=list)
    finished: list[PlannedRun] = field(default_factory=list)
    failed: list[tuple[PlannedRun, str]] = field(default_factory=list)
    interrupted: list[PlannedRun] = field(default_factory=list)


def execute_run(config: dict[str, Any], folder: Path, on_round: Any = None) -> dict[str, Any]:
    """Run one resolved config into ``folder``, resuming whatever is there (the plan checked its config)."""
    from fedskew.experiment.config import build_config
    from fedskew.experiment.failure import check_finished
    from fedskew.experiment.runner import run_experiment

    resume = folder.is_dir() and any(folder.iterdir())
    summary = run_experiment(build_config(config), folder, resume=resume, on_round=on_round)
    (folder / ERROR_FILE).unlink(missing_ok=True)
    check_finished(summary, folder)  # a run that counts as failed (its files written) fails the sweep
    return summary


def round_accuracy(record: dict[str, Any] | None) -> float | None:
    return None if record is None else record.get("accuracy")


def settle(
    outcome: SweepOutcome,
    listener: SweepListener,
    run: PlannedRun,
    summary: dict[str, Any] | None = None,
    error: BaseException | None = None,
) -> None:
    """Record how one run ended; a failure's traceback goes to its folder's ``error.log``."""
    import traceback

    if error is None:
        outcome.finished.append(run)
        listener.run_finished(run, summary or {})
    elif isinstance(error, KeyboardInterrupt):
        outcome.interrupted.append(run)
    else:
        text = str(error).strip().splitlines()
        message = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
        run.folder.mkdir(parents=True, exist_ok=True)
        (run.folder / ERROR_FILE).write_text("".join(traceback.format_exception(error)))
        outcome.failed.append((run, message))
        listener.run_failed(run, message)


def run_in_process(
    todo: Sequence[PlannedRun], threads: int, listener: SweepListener, outcome: SweepOutcome
) -> None:
    """Runs one after the other in this process; Ctrl-C leaves the current run's checkpoint and stops."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, run in enumerate(todo):

            def on_round(sim: Any, record: dict[str, Any] | None, run: PlannedRun = run) -> None:
                listener.run_round(run, sim.round, round_accuracy(record))

            try:
                listener.run_started(run)
                summary = execute_run(run.config, run.folder, on_round)
            except KeyboardInterrupt:
                outcome.interrupted.extend(todo[i:])
                return
            except Exception as err:
                settle(outcome, listener, run, error=err)
                continue
            settle(outcome, listener, run, summary)
    finally:
        torch.set_num_threads(previous)
