"""``fedskew list``, ``report`` and ``data show``: what is registered, tables and plots of results, a
partition."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from fedskew.cli.common import app, console, data_app, registries


@app.command("list")
def list_() -> None:
    """List algorithms, models, datasets, partition schemes, backbones and generators, one line each."""
    for title, reg in registries().items():
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
    paired: str | None = typer.Option(
        None,
        "--paired",
        help="baseline group (its label, sweep folder, algorithm name or part of its label): "
        "seed-paired differences",
    ),
    metric: str = typer.Option("accuracy", "--metric", help="--paired metric: a key of summary.json's final"),
    last: int = typer.Option(0, "--last", help="--paired on the mean of the last K evaluated rounds"),
    fmt: str = typer.Option("markdown", "--format", help="table format: markdown, latex (booktabs) or csv"),
    metrics: str | None = typer.Option(
        None, "--metrics", help="table columns, e.g. accuracy,loss,bytes_up,accuracy_worst10,accuracy_gini"
    ),
    target: float | None = typer.Option(
        None, "--target", help="add rounds-to-target: the first round each run reaches this accuracy"
    ),
    html: Path | None = typer.Option(None, "--html", help="also write one self-contained HTML page"),
) -> None:
    """The table of final metrics (mean ± std over seeds) as Markdown, LaTeX or CSV, optionally the
    seed-paired differences to a baseline group with 95% t-intervals, the accuracy-vs-round and per-client
    accuracy plots, and an HTML page with all of it."""
    from fedskew.experiment.reporting import ReportRequest, make_report

    request = ReportRequest(
        list(dirs), fmt, metrics, target, paired, metric, last, plot or Path("report.png"), html=html
    )
    result = make_report(request)
    typer.echo(result.text.rstrip("\n") + "\n")  # plain: tables must not be wrapped
    notices = console if fmt == "markdown" else Console(stderr=True)  # keep LaTeX / CSV output clean
    for path in result.files:
        notices.print(f"{'page' if path.suffix == '.html' else 'plot'}: {path}")


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
