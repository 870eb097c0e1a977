"""``fedskew`` command line: run, list, report, demo, data show.

Bad input exits with code 2 and one line naming the problem and the allowed values.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fedskew.errors import FedskewError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated learning under non-IID data.")
data_app = typer.Typer(no_args_is_help=True, help="Inspect datasets and partitions.")
app.add_typer(data_app, name="data")
console = Console()


def _registries() -> dict[str, Any]:
    from fedskew import algorithms, data, models  # noqa: F401  (import registers)
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.data.base import DATASETS, PARTITIONERS
    from fedskew.models.base import MODELS

    return {"algorithms": ALGORITHMS, "models": MODELS, "datasets": DATASETS, "partitions": PARTITIONERS}


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
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
            fields = {"spr": f"{(time.perf_counter() - start) / max(done, 1):.2f}"}
            if record is not None:
                fields["acc"] = f"{100 * record['accuracy']:.2f}%"
            progress.update(task, completed=sim.round, **fields)

        return run_experiment(cfg, out, resume=resume, force=force, on_round=on_round)


@app.command()
def run(
    config: Path = typer.Argument(..., help="YAML config file"),
    set_: list[str] = typer.Option([], "--set", help="override: dotted.key=value (repeatable)"),
    out: Path | None = typer.Option(None, "--out", help="output folder (default runs/<config name>)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the checkpoint in --out"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output folder"),
) -> None:
    """Run one experiment and write config.yaml, metrics.jsonl, summary.json and a checkpoint."""
    from fedskew.experiment.config import load_config

    cfg = load_config(config, set_)
    out = out or Path("runs") / config.stem
    summary = run_with_progress(cfg, out, resume, force, cfg.algorithm.name)
    f = summary["final"]
    console.print(
        f"final accuracy {100 * f['accuracy']:.2f}% (± {100 * f.get('accuracy_std', 0.0):.2f} over clients) "
        f"after {summary['rounds']} rounds in {summary['wall_seconds']:.1f} s -> {out}"
    )


@app.command("list")
def list_() -> None:
    """List algorithms, models, datasets and partition schemes, one line each."""
    for title, reg in _registries().items():
        table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for name, doc in reg.items():
            table.add_row(name, doc)
        console.print(table)
        console.print()


@app.command()
def report(
    dirs: list[Path] = typer.Argument(..., help="result folders (searched recursively)"),
    plot: Path | None = typer.Option(None, "--plot", help="accuracy-vs-round PNG (default: report.png)"),
) -> None:
    """Markdown table of final metrics (mean ± std over seeds) and an accuracy-vs-round plot."""
    from fedskew.experiment.report import find_runs, group_runs, markdown_table, plot_accuracy

    groups = group_runs(find_runs(list(dirs)))
    typer.echo(markdown_table(groups))  # plain: markdown must not be wrapped
    path = plot_accuracy(groups, plot or Path("report.png"))
    console.print(f"plot: {path}")


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="output folder"),
    rounds: int = typer.Option(30, "--rounds", help="communication rounds"),
) -> None:
    """FedAvg, FedProx and Local on scikit-learn digits, Dirichlet(0.3), 10 clients: table + plot."""
    from fedskew.experiment.config import build_config
    from fedskew.experiment.demo import DEMO_ALGORITHMS, demo_config
    from fedskew.experiment.report import find_runs, group_runs, markdown_table, plot_accuracy

    for name in DEMO_ALGORITHMS:
        cfg = build_config(demo_config(name, rounds))
        run_with_progress(cfg, out / name, resume=False, force=True, label=name)
    groups = group_runs(find_runs([out / n for n in DEMO_ALGORITHMS]))
    console.print()
    typer.echo(markdown_table(groups))  # plain: markdown must not be wrapped
    path = plot_accuracy(
        groups, out / "accuracy.png", "digits, Dirichlet(0.3), 10 clients, personalized test"
    )
    console.print(f"plot: {path}")


@data_app.command("show")
def data_show(
    config: Path = typer.Argument(..., help="YAML config file"),
    set_: list[str] = typer.Option([], "--set", help="override: dotted.key=value (repeatable)"),
    out: Path | None = typer.Option(None, "--out", help="PNG heatmap path (default <config>-partition.png)"),
) -> None:
    """Print the partition of a config as a table and write a PNG heatmap of it."""
    from fedskew.data.plot import partition_table, plot_partition
    from fedskew.experiment.config import load_config
    from fedskew.experiment.runner import build_data

    cfg = load_config(config, set_)
    fd = build_data(cfg)
    rows = partition_table(fd)
    table = Table(title=f"{cfg.data.dataset}: {cfg.data.partition}", title_justify="left")
    for col in rows[0]:
        table.add_column(str(col), justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in rows[0]))
    console.print(table)
    path = plot_partition(fd, out or Path(f"{config.stem}-partition.png"))
    console.print(f"heatmap: {path}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        # Outside standalone mode typer *returns* the exit code of an Exit, and Ctrl-C becomes Exit(130)
        code = app(standalone_mode=False)
        if code == 130:
            raise KeyboardInterrupt
        if isinstance(code, int) and code:
            sys.exit(code)
    except FedskewError as err:
        print(f"error: {err}", file=sys.stderr)  # one unwrapped line
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: progress kept in the checkpoint; continue with --resume", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as err:  # click usage errors
        import click

        if isinstance(err, click.exceptions.ClickException):
            err.show()
            sys.exit(2)
        if isinstance(err, click.exceptions.Abort):
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
