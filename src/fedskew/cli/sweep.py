"""``fedskew sweep``: configs × grid points × seeds, with one progress display for the whole sweep."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from fedskew.cli.common import app, console
from fedskew.errors import FedskewError

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
        self.progress.console.print(f"[red]failed[/] {run.folder}: {message}", markup=True, highlight=False)


def _print_plan(runs: list[Any]) -> None:
    from fedskew.experiment.sweep import describe

    for r in runs:
        typer.echo(f"{r.state.value:<11}  {r.folder}  <- {describe(r)}")
    counts = {s: sum(r.state is s for r in runs) for s in {r.state for r in runs}}
    states = ", ".join(f"{n} {s.value}" for s, n in sorted(counts.items(), key=lambda kv: kv[0].value))
    typer.echo(f"{len(runs)} runs: {states}")


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
    threads: int = typer.Option(1, "--threads", help="torch threads per run"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="list the planned runs and their state, run nothing"
    ),
) -> None:
    """Run configs × grid points × seeds, skipping finished runs and resuming interrupted ones."""
    from fedskew.experiment.sweep import parse_seeds, plan_sweep
    from fedskew.experiment.sweep_pool import run_sweep

    if jobs < 1 or threads < 1:
        raise FedskewError(f"--jobs {jobs} --threads {threads}: both must be at least 1")
    runs = plan_sweep(configs, out, parse_seeds(seeds) if seeds else None, grid, set_, name)
    if dry_run:
        _print_plan(runs)
        return
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
