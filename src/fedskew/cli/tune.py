"""``fedskew tune``: equal-budget tuning of every method's declared knobs (experiment/tune.py)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.markup import escape
from rich.table import Table

from fedskew.cli.common import app, console
from fedskew.errors import FedskewError
from fedskew.threads import check_threads_option, resolve_threads, run_processes

if TYPE_CHECKING:
    from fedskew.experiment.sweep import SweepListener


class _Lines:
    """One line per finished or failed run (a tune's runs are many and short: no progress bars); every
    SweepListener method, not a subclass (experiment.sweep is imported lazily, as in cli/sweep.py)."""

    def run_started(self, run: Any) -> None:
        pass

    def run_round(self, run: Any, round_: int, accuracy: float | None) -> None:
        pass

    def run_finished(self, run: Any, summary: dict[str, Any]) -> None:
        val = (summary.get("final") or {}).get("val_accuracy")
        text = "n/a" if val is None else f"{100 * val:.2f}%"
        console.print(f"done   {run.folder}  val accuracy {text}", highlight=False)

    def run_failed(self, run: Any, message: str) -> None:
        console.print(
            f"[red]failed[/] {escape(str(run.folder))}: {escape(message)}", markup=True, highlight=False
        )


def _value(key: str, value: Any, starred: Sequence[str] = ()) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"{key}={text}{'*' if key in starred else ''}"


def _trial_line(method: str, number: int, values: dict[str, Any], value: float) -> None:
    knobs = ", ".join(_value(k, v) for k, v in values.items())
    console.print(f"trial  {method} #{number}: {knobs} -> val accuracy {100 * value:.2f}%", highlight=False)


def _table(record: dict[str, Any]) -> Table:
    """Per method: trials, the best trial's validation accuracy and values (* on a range's end)."""
    seeds = ", ".join(map(str, record["seeds"]))
    title = f"tuned: {record['trials_per_method']} trials per method, seeds {seeds} ({record['sampler']})"
    table = Table(title=title, title_justify="left")
    for column in ("method", "trials", "best val acc", "chosen values (* = on its range's boundary)"):
        table.add_column(column, overflow="fold")
    for method, m in record["methods"].items():
        best = m["best"]
        values = ", ".join(_value(k, v, best["at_boundary"]) for k, v in best["values"].items())
        table.add_row(method, str(m["trials"]), f"{100 * best['value']:.2f}%", values)
    return table


def _split(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


@app.command()
def tune(
    config: Path = typer.Argument(..., help="base YAML config (with a validation split: data.val_fraction)"),
    methods: str = typer.Option(..., "--methods", help="methods to tune, e.g. fedavg,fedprox"),
    trials: int = typer.Option(
        ..., "--trials", help="completed trials per method (the same for every method)"
    ),
    seeds: str = typer.Option(..., "--seeds", help="tuning seeds, e.g. 100,101 (report on other seeds)"),
    out: Path = typer.Option(..., "--out", help="the study's folder: journal, runs, chosen/, budget.json"),
    jobs: int = typer.Option(1, "--jobs", help="runs in parallel processes"),
    threads: int = typer.Option(0, "--threads", help="torch threads per run process; 0 = auto"),
    sampler: str = typer.Option("tpe", "--sampler", help="Optuna sampler: tpe, random or grid"),
    sampler_seed: int = typer.Option(0, "--sampler-seed", help="seed of the sampler's proposals"),
    set_: list[str] = typer.Option([], "--set", help="fixed override of the base config (repeatable)"),
    knobs: str = typer.Option(
        "", "--knobs", help="tune only these declared knobs, e.g. client.lr,algorithm.mu (default: all)"
    ),
) -> None:
    """Tune lr × each method's declared knobs with the same number of trials per method, on the validation
    split of the tuning seeds; rerun the same command to resume. Writes OUT/chosen/<method>.yaml for
    `fedskew sweep` and OUT/budget.json."""
    from fedskew.experiment.sweep import parse_seeds
    from fedskew.experiment.tune import TuneSpec, check_spec, run_tune

    if importlib.util.find_spec("optuna") is None:
        raise FedskewError("fedskew tune needs the 'optuna' package: pip install 'fedskew[tune]'")
    if jobs < 1:
        raise FedskewError(f"--jobs {jobs}: allowed: at least 1")
    check_threads_option(threads)
    spec = TuneSpec(
        config, _split(methods), trials, tuple(parse_seeds(seeds)), out, sampler, sampler_seed,
        tuple(set_), _split(knobs),
    )  # fmt: skip
    plan = check_spec(spec)
    workers = max(int(b["engine"].get("workers", 1)) for b in plan.base.values())
    threads = resolve_threads(threads, jobs * run_processes(workers))[0]
    try:
        outcome = run_tune(plan, jobs, threads, cast("SweepListener", _Lines()), _trial_line)
    except KeyboardInterrupt:
        outcome = None
    if outcome is None or outcome.interrupted:
        print("interrupted: progress kept; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    console.print(_table(outcome.results))
    console.print(f"chosen configs -> {out / 'chosen'}; budget -> {out / 'budget.json'}", highlight=False)
