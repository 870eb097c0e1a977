"""``fedskew init`` and ``fedskew runs``: a starter in the user's folder, and the runs under a folder with
their state (``--version`` and shell completion are options of the app itself: cli/common.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from fedskew.cli.common import app, console
from fedskew.errors import FedskewError

#: the help's panel of these commands (after the experiment commands)
PANEL = "Project"
#: the colour of each run state in the table
STATE_STYLE = {"finished": "green", "interrupted": "yellow", "failed": "red", "running": "cyan"}


@app.command(rich_help_panel=PANEL)
def init(
    folder: Path = typer.Argument(Path("."), help="folder to write into (created; default: the current one)"),
    force: bool = typer.Option(False, "--force", help="overwrite existing starter files"),
) -> None:
    """Write a commented starter config (fedskew.yaml: FedAvg on digits, runs in seconds) and a method
    skeleton (my_method.py: FedAvg with a server learning rate) into FOLDER; never overwrites without
    --force."""
    from fedskew.experiment.starter import write_starter

    for path in write_starter(folder, force):
        console.print(f"wrote {path}")
    config = folder / "fedskew.yaml"
    console.print(f"next: fedskew run {config} --out {folder / 'runs' / 'first'}", highlight=False)


def _rounds(done: int, total: int | None) -> str:
    return f"{done}/{'?' if total is None else total}"


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


@app.command("runs", rich_help_panel=PANEL)
def runs(
    folder: Path = typer.Argument(Path("runs"), help="folder searched recursively (default: runs)"),
    as_json: bool = typer.Option(False, "--json", help="a JSON list, one object per run, for scripts"),
) -> None:
    """The runs under FOLDER (folders holding config.yaml): state (finished, interrupted, failed, running),
    rounds done / asked for, algorithm, dataset and final accuracy (unfinished: the last evaluated)."""
    from fedskew.experiment.runs_index import index_runs

    if not folder.is_dir():
        raise FedskewError(f"fedskew runs: '{folder}' is not a folder; expected a folder of run results")
    entries = index_runs(folder)
    if as_json:
        typer.echo(json.dumps([e.to_dict() for e in entries], indent=2))
        return
    if not entries:
        console.print(f"no runs under {folder} (a run is a folder holding config.yaml)")
        return
    table = Table(title=f"runs under {folder}", title_justify="left", box=None, pad_edge=False)
    for name in ("run", "state", "rounds", "algorithm", "dataset", "accuracy", "note"):
        table.add_column(name, justify="right" if name in ("rounds", "accuracy") else "left", overflow="fold")
    for e in entries:
        where = e.folder.relative_to(folder).as_posix() if e.folder != folder else "."
        state = Text(e.state, style=STATE_STYLE.get(e.state, ""))  # a styled cell, no markup parsed
        cells = (e.algorithm or "?", e.dataset or "?", _accuracy(e.accuracy), e.note)
        table.add_row(where, state, _rounds(e.rounds_done, e.rounds_total), *cells)
    console.print(table)
