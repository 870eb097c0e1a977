"""What the commands share: the Typer application, the console and the per-round progress display."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

# add_completion: Typer's --install-completion / --show-completion for bash, zsh, fish and PowerShell
app = typer.Typer(add_completion=True, no_args_is_help=True, help="Federated learning under non-IID data.")
data_app = typer.Typer(no_args_is_help=True, help="Inspect datasets and partitions.")
app.add_typer(data_app, name="data")
#: markup off by default: messages quote paths, config values and exceptions, and rich would take their
#: brackets for style tags (``pip install 'fedskew[tracking]'`` printed as ``pip install 'fedskew'``); a
#: message that styles itself passes ``markup=True`` and escapes what it quotes (rich.markup.escape).
#: soft_wrap: a message is one line the terminal wraps, never broken inside a path (tables still fit)
console = Console(markup=False, soft_wrap=True)


def _print_version(value: bool) -> None:
    if value:
        import fedskew

        typer.echo(f"fedskew {fedskew.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="print fedskew's version and exit"
    ),
) -> None:
    """Federated learning under non-IID data."""


def registries() -> dict[str, Any]:
    from fedskew.plugins import prepare

    prepare()  # the built-ins, then the installed plugins' entry points (fedskew.plugins)
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.data.base import DATASETS, PARTITIONERS
    from fedskew.data.generators import GENERATORS
    from fedskew.engine.modes import EXECUTORS
    from fedskew.models.backbones import BACKBONES
    from fedskew.models.base import MODELS
    from fedskew.runtimes import RUNTIMES

    return {
        "algorithms": ALGORITHMS,
        "executors": EXECUTORS,
        "models": MODELS,
        "datasets": DATASETS,
        "partitions": PARTITIONERS,
        "backbones": BACKBONES,
        "generators": GENERATORS,
        "runtimes": RUNTIMES,
    }


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}", style="bold", markup=False),  # a label may hold brackets
        BarColumn(),
        TextColumn("round {task.completed}/{task.total}"),
        TextColumn("acc {task.fields[acc]}"),
        TextColumn("{task.fields[spr]} s/round"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def run_with_progress(cfg: Any, out: Path | None, resume: bool, force: bool, label: str) -> dict[str, Any]:
    from fedskew.experiment.runner import run_experiment

    with _progress() as progress:
        task = progress.add_task(label, total=cfg.rounds, acc="-", spr="-")
        start = time.perf_counter()
        first: list[int] = []

        def on_round(sim: Any, record: dict[str, Any] | None) -> None:
            if not first:
                first.append(sim.round - 1)
            done = sim.round - first[0]
            fields: dict[str, Any] = {"spr": f"{(time.perf_counter() - start) / max(done, 1):.2f}"}
            if record is not None:
                fields["acc"] = f"{100 * record['accuracy']:.2f}%"
            progress.update(task, completed=sim.round, **fields)

        return run_experiment(cfg, out, resume=resume, force=force, on_round=on_round)


def one_line(err: BaseException) -> str:
    """The error's message on one line, even when it quotes input holding line breaks."""
    return " ".join(str(err).splitlines())


class LiveStderrHandler(logging.StreamHandler):
    """Log records to whatever ``sys.stderr`` is *now*: while a progress bar is live on a terminal, rich
    swaps in a proxy that prints above the bar; a handler holding the original stream wrote between the
    bar's redraws instead, and the redraw erased or repeated log lines (seen with a run's rejected
    uploads)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it; the live one is used
        pass


def configure_logging() -> None:
    """WARNING and above on stderr, one plain line each, through :class:`LiveStderrHandler`."""
    handler = LiveStderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
