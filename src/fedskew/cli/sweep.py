"""``fedskew sweep``: configs × grid points × seeds, with one progress display for the whole sweep."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from fedskew.cli.common import app, console
from fedskew.errors import FedskewError
from fedskew.threads import check_threads_option, resolve_threads, run_processes

if TYPE_CHECKING:
    from fedskew.experiment.sweep import SweepListener


class SweepDisplay:
    """One progress display for a whole sweep: runs done / total and rounds done across runs."""

    def __init__(self, progress: Progress, runs: list[Any]) -> None:
        from fedskew.experiment.sweep import RunState

        self.progress = progress
        done = {r.folder for r in runs if r.state is RunState.FINISHED}
        self.rounds = {r.folder: r.rounds if r.folder in done else 0 for r in runs}
        self.running = self.failed = 0
        self.runs_task = progress.add_task("runs", total=len(runs), completed=len(done), info="")
        self.rounds_task = progress.add_task(
            "rounds", total=sum(r.rounds for r in runs), completed=sum(self.rounds.values()), info=""
        )
        self._info()

    def _info(self) -> None:
        failed = f", [red]{self.failed} failed[/]" if self.failed else ""
        self.progress.update(self.runs_task, info=f"{self.running} running{failed}")

    def run_started(self, run: Any) -> None:
        self.running += 1
        self._info()

    def run_round(self, run: Any, round_: int, accuracy: float | None) -> None:
        self.progress.advance(self.rounds_task, round_ - self.rounds[run.folder])
        self.rounds[run.folder] = round_

    def run_finished(self, run: Any, summary: dict[str, Any]) -> None:
        self.run_round(run, run.rounds, None)
        self.running -= 1
        self.progress.advance(self.runs_task)
        self._info()
        acc = summary["final"].get("accuracy")
        acc_text = "n/a" if acc is None else f"{100 * acc:.2f}%"
        self.progress.console.print(
            f"done   {run.folder}  accuracy {acc_text}  {summary['wall_seconds']:.1f} s"
        )

    def run_failed(self, run: Any, message: str) -> None:
        self.running -= 1
        self.failed += 1
        self.progress.advance(self.runs_task)
        self._info()
        from rich.markup import escape  # the folder and the error are quoted as written, brackets and all

        self.progress.console.print(
            f"[red]failed[/] {escape(str(run.folder))}: {escape(message)}", markup=True, highlight=False
        )


def _print_plan(runs: list[Any], skipped: list[Any]) -> None:
    from fedskew.experiment.sweep import describe

    for r in runs:
        typer.echo(f"{r.state.value:<11}  {r.folder}  <- {describe(r)}")
    for point in skipped:  # grid points a run cannot take: not planned (experiment/sweep_grid.py)
        typer.echo(point.line())
    counts = {s: sum(r.state is s for r in runs) for s in {r.state for r in runs}}
    states = ", ".join(f"{n} {s.value}" for s, n in sorted(counts.items(), key=lambda kv: kv[0].value))
    typer.echo(f"{len(runs)} runs: {states}" + (f"; {len(skipped)} grid points skipped" if skipped else ""))


def _checked_plan(
    configs: list[Path], out: Path, seeds: str | None, grid: list[str], sets: list[str], name: str, dry: bool
) -> Any:
    """The sweep's plan, every run's config, packages and trackers checked before any run starts
    (experiment/sweep_check.py); the grid points skipped, one line each on stderr (a dry run lists them)."""
    from fedskew.experiment.sweep import parse_seeds, plan_runs
    from fedskew.experiment.sweep_check import check_runs

    plan = plan_runs(configs, out, parse_seeds(seeds) if seeds else None, grid, sets, name)
    check_runs(plan.runs)
    for point in [] if dry else plan.skipped:
        print(point.line(), file=sys.stderr)
    return plan


def _check_jobs_threads(jobs: int, threads: int) -> None:
    if jobs < 1:
        raise FedskewError(f"--jobs {jobs}: allowed: at least 1")
    check_threads_option(threads)


def _run_threads(requested: int, jobs: int, runs: list[Any]) -> int:
    """Torch threads of each run process: fedskew's one policy (fedskew/threads.py) over the ``jobs``
    processes and, within each, its engine's worker processes."""
    workers = max((int(r.config["engine"].get("workers", 1)) for r in runs), default=1)
    return resolve_threads(requested, jobs * run_processes(workers))[0]


@app.command()
def sweep(
    configs: list[Path] = typer.Argument(..., help="YAML config files"),
    out: Path = typer.Option(..., "--out", help="root folder: one run per OUT/<name>/seed<k>/"),
    seeds: str | None = typer.Option(
        None, "--seeds", help="seeds: 0,1,2 or ranges 0-9 (default: the config's)"
    ),
    grid: list[str] = typer.Option([], "--grid", help="key=v1,v2,... (repeatable: the cross product)"),
    set_: list[str] = typer.Option([], "--set", help="fixed override: dotted.key=value (repeatable)"),
    name: str = typer.Option(
        "{stem}/{grid}",
        "--name",
        help="run folder template: {stem}, {grid} or config keys, e.g. {algorithm.name}",
    ),
    jobs: int = typer.Option(1, "--jobs", help="runs in parallel processes"),
    threads: int = typer.Option(
        0, "--threads", help="torch threads per run process; 0 = auto: the cores free now divided by --jobs"
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="list the planned runs and their state, run nothing"
    ),
) -> None:
    """Run configs × grid points × seeds, skipping finished runs and resuming interrupted ones."""
    from fedskew.experiment.sweep_pool import run_sweep

    _check_jobs_threads(jobs, threads)
    plan = _checked_plan(configs, out, seeds, grid, set_, name, dry_run)
    runs = plan.runs
    if dry_run:
        _print_plan(runs, plan.skipped)
        return
    threads = _run_threads(threads, jobs, runs)
    progress = Progress(
        TextColumn("[bold]{task.description:>6}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
    )
    try:
        with progress:
            # SweepDisplay has every SweepListener method (not a subclass: sweep is imported lazily)
            outcome = run_sweep(runs, jobs, threads, cast("SweepListener", SweepDisplay(progress, runs)))
    except KeyboardInterrupt:  # a Ctrl-C after the runs had already stopped
        outcome = None
    if outcome is None or outcome.interrupted:
        left = f"{len(outcome.interrupted)} of {len(runs)} runs unfinished, " if outcome else ""
        print(f"interrupted: {left}progress kept; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    if outcome.failed:
        folders = ", ".join(str(r.folder) for r, _ in outcome.failed)
        print(
            f"sweep: {len(outcome.failed)} of {len(runs)} runs failed (see error.log): {folders}",
            file=sys.stderr,
        )
        raise typer.Exit(1)
    console.print(
        f"{len(outcome.finished)} runs finished, {len(outcome.skipped)} already done -> {out}",
        highlight=False,
    )
