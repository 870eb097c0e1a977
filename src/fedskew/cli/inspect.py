"""``fedskew list``, ``report`` and ``data show``: what is registered, tables and plots of results, a
partition. Every file they write goes under ``--out`` or a stated default beside their input, never the
working directory by accident (docs/decisions.md, "Where commands write")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from fedskew.cli.common import app, console, data_app, registries
from fedskew.errors import FedskewError, did_you_mean
from fedskew.search_space import search_spaces

#: ``list --params``'s columns, in order (also the keys of each ``--json`` row)
PARAM_COLUMNS = ("name", "type", "default", "search", "description")

#: ``data show``'s heatmap file name; by default in ``runs/``, beside the folder ``fedskew run`` gives the
#: config's run (``runs/<stem>``; runs/ is git-ignored, a config folder is not)
PARTITION_PNG = "{stem}-partition.png"
DEFAULT_ROOT = Path("runs")


def _chosen(kind: str | None) -> dict[str, list[tuple[str, str]]]:
    regs = registries()
    if kind is not None and kind not in regs:
        raise FedskewError(
            f"fedskew list {kind}: unknown kind{did_you_mean(kind, regs)}; allowed: {', '.join(regs)}"
        )
    return {title: reg.items() for title, reg in regs.items() if kind in (None, title)}


@app.command("list")
def list_(
    kind: str | None = typer.Argument(
        None, help="one kind only: algorithms, executors, models, datasets, partitions, backbones, generators"
    ),
    plain: bool = typer.Option(False, "--plain", help="KIND<TAB>NAME<TAB>DOC, one per line, never wrapped"),
    as_json: bool = typer.Option(False, "--json", help="{kind: {name: doc}} as JSON"),
    params: str | None = typer.Option(
        None,
        "--params",
        metavar="NAME",
        help="the hyper-parameters of algorithm NAME, client.lr first: type, default, declared search "
        "space (what `fedskew tune` searches) and description",
    ),
    plugin: list[str] = typer.Option(
        [], "--plugin", help="also load this plugin first: a .py file or a module name (repeatable)"
    ),
) -> None:
    """List algorithms, models, datasets, partition schemes, backbones and generators, one line each; with
    --params NAME, one algorithm's hyper-parameters and their search spaces."""
    if plugin:
        from fedskew.plugins import load_plugins, resolve_plugins

        load_plugins(resolve_plugins(list(plugin), None))
    if params is not None:
        _list_params(params, kind, plain, as_json)
        return
    chosen = _chosen(kind)
    if as_json:
        typer.echo(json.dumps({title: dict(items) for title, items in chosen.items()}, indent=2))
        return
    if plain:
        for title, items in chosen.items():
            for name, doc in items:
                typer.echo(f"{title}\t{name}\t{doc}")
        return
    for title, items in chosen.items():
        table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
        table.add_column(style="bold cyan", overflow="fold")  # wrapped at the terminal's width, never cut
        table.add_column(overflow="fold")
        for name, doc in items:
            table.add_row(name, doc)
        console.print(table)
        console.print()


def _type_text(annotation: Any) -> str:
    """``float``, ``int | None``, ``Literal['a', 'b']``: the annotation as a reader writes it."""
    name = getattr(annotation, "__name__", None)
    return name if isinstance(annotation, type) and name else str(annotation).replace("typing.", "")


def param_rows(model: type[BaseModel], prefix: str = "") -> list[dict[str, Any]]:
    """One row per field of ``model`` (see :data:`PARAM_COLUMNS`); ``search`` is the declared space
    (:func:`fedskew.search_space.search_spaces`) or None."""
    spaces = search_spaces(model)
    rows = []
    for name, info in model.model_fields.items():
        space = spaces.get(name)
        default = "required" if info.is_required() else info.default
        row = {"name": prefix + name, "type": _type_text(info.annotation), "default": default}
        rows.append(row | {"search": space, "description": info.description or ""})
    return rows


def _list_params(name: str, kind: str | None, plain: bool, as_json: bool) -> None:
    """``list --params NAME``: ``client.lr`` (every method's searched lr), then NAME's ``Params``."""
    from fedskew.settings import ClientSection

    algorithms = registries()["algorithms"]
    if kind not in (None, "algorithms"):
        raise FedskewError(f"fedskew list --params: takes an algorithm name, not a {kind!r} kind; drop KIND")
    if name not in algorithms:
        raise FedskewError(
            f"fedskew list --params {name}: unknown algorithm{did_you_mean(name, algorithms)}; allowed: "
            f"{', '.join(algorithms.names())}"
        )
    lr = [row for row in param_rows(ClientSection, "client.") if row["name"] == "client.lr"]
    rows = lr + param_rows(algorithms.get(name).Params, "algorithm.")
    if as_json:
        out = [row | {"search": None if row["search"] is None else row["search"].as_dict()} for row in rows]
        typer.echo(json.dumps({"algorithm": name, "params": out}, indent=2, default=str))
        return
    cells = [[str(row[c]) if c != "search" else _space_text(row[c]) for c in PARAM_COLUMNS] for row in rows]
    if plain:
        for line in cells:
            typer.echo("\t".join(line))
        return
    table = Table(
        title=f"{name}: hyper-parameters (search: what `fedskew tune` searches)", title_justify="left"
    )
    for column in PARAM_COLUMNS:  # every column but the description stays on one line
        table.add_column(column, no_wrap=column != "description", overflow="fold")
    for line in cells:
        table.add_row(*line)
    console.print(table)


def _space_text(space: Any) -> str:
    if space is None:
        return "—"
    only = "" if space.protocols is None else f" ({', '.join(space.protocols)} only)"
    return f"{space.text()}{only}"


def _report_paths(dirs: list[Path], out: Path | None, plot: Path | None) -> Path:
    """The accuracy figure's path: ``--plot`` as given, else ``report.png`` in ``--out`` (default: the first
    results folder), the per-client figure beside it."""
    return plot if plot is not None else (out if out is not None else dirs[0]) / "report.png"


@app.command()
def report(
    dirs: list[Path] = typer.Argument(..., help="result folders (searched recursively)"),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="folder for the figures report.png and report_clients.png (created; default: the first "
        "result folder given)",
    ),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="accuracy-vs-round PNG path (default: OUT/report.png); the per-client figure "
        "goes beside it as <name>_clients.png",
    ),
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
    html: Path | None = typer.Option(None, "--html", help="also write one self-contained HTML page here"),
    x: str = typer.Option(
        "round",
        "--x",
        help="the accuracy figure's x axis: round, or virtual_time (runs with a clock: section; each "
        "seed's curve and their mean up to the shortest run's end)",
    ),
) -> None:
    """The table of final metrics (mean ± std over seeds) as Markdown, LaTeX or CSV, optionally the
    seed-paired differences to a baseline group with 95% t-intervals, the accuracy-vs-round and per-client
    accuracy plots, and an HTML page with all of it."""
    from fedskew.experiment.reporting import ReportRequest, make_report

    request = ReportRequest(
        list(dirs), fmt, metrics, target, paired, metric, last, _report_paths(dirs, out, plot), html=html, x=x
    )
    result = make_report(request)
    typer.echo(result.text.rstrip("\n") + "\n")  # plain: tables must not be wrapped
    # keep LaTeX / CSV output clean; paths are printed as they are (no markup)
    notices = console if fmt == "markdown" else Console(stderr=True, markup=False, soft_wrap=True)
    for path in result.files:
        notices.print(f"{ {'.html': 'page', '.json': 'provenance'}.get(path.suffix, 'plot') }: {path}")


def partition_png(config: Path, out: Path | None) -> Path:
    """Where ``data show`` writes its heatmap: ``--out`` when it names a .png, ``OUT/<stem>-partition.png``
    when it names a folder, else ``runs/<stem>-partition.png`` (beside the run's default folder)."""
    name = PARTITION_PNG.format(stem=config.stem)
    if out is None:
        return DEFAULT_ROOT / name
    return out if out.suffix.lower() == ".png" and not out.is_dir() else out / name


@data_app.command("show")
def data_show(
    config: Path = typer.Argument(..., help="YAML config file"),
    set_: list[str] = typer.Option([], "--set", help="override: dotted.key=value (repeatable)"),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="heatmap: a .png path, or a folder for <config stem>-partition.png (default: runs/, beside "
        "the run folder `fedskew run` uses, runs/<config stem>)",
    ),
) -> None:
    """Print the partition of a config as a table and write a PNG heatmap of it."""
    from fedskew.data.plot import partition_table, plot_partition
    from fedskew.experiment.config import load_config
    from fedskew.experiment.data_warnings import warn_small_clients
    from fedskew.experiment.runner import build_data

    cfg = load_config(config, set_)
    fd = build_data(cfg)
    warn_small_clients(cfg, fd.class_counts().sum(1).tolist())
    rows = partition_table(fd)
    table = Table(title=f"{cfg.data.dataset}: {cfg.data.partition}", title_justify="left")
    for col in rows[0]:
        table.add_column(str(col), justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in rows[0]))
    console.print(table)
    path = plot_partition(fd, partition_png(config, out))
    console.print(f"heatmap: {path}")
