"""``fedskew`` command line: run, flower-app, sweep, list, report, demo, data show, features,
cachefl-search, cachefl-posthoc.

Bad input exits with code 2 and one line naming the problem and the allowed values.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fedskew.errors import FedskewError, RunFailure

if TYPE_CHECKING:
    from fedskew.experiment.sweep import SweepListener

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated learning under non-IID data.")
data_app = typer.Typer(no_args_is_help=True, help="Inspect datasets and partitions.")
app.add_typer(data_app, name="data")
console = Console()


def _registries() -> dict[str, Any]:
    from fedskew import algorithms, data, models  # noqa: F401  (import registers)
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.data.base import DATASETS, PARTITIONERS
    from fedskew.data.generators import GENERATORS
    from fedskew.engine.modes import EXECUTORS
    from fedskew.models.backbones import BACKBONES
    from fedskew.models.base import MODELS

    return {
        "algorithms": ALGORITHMS,
        "executors": EXECUTORS,
        "models": MODELS,
        "datasets": DATASETS,
        "partitions": PARTITIONERS,
        "backbones": BACKBONES,
        "generators": GENERATORS,
    }


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
            fields: dict[str, Any] = {"spr": f"{(time.perf_counter() - start) / max(done, 1):.2f}"}
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
    if cfg.engine.runtime == "embedded":
        summary = run_with_progress(cfg, out, resume, force, cfg.algorithm.name)
    else:
        from fedskew.flower.launch import run_flower

        console.print(f"{cfg.algorithm.name} on {cfg.engine.runtime} with {cfg.engine.nodes} nodes ...")
        summary = run_flower(cfg, out, resume=resume, force=force)
    f = summary["final"]
    console.print(
        f"final accuracy {100 * f['accuracy']:.2f}% (± {100 * f.get('accuracy_std', 0.0):.2f} over clients) "
        f"after {summary['rounds']} rounds in {summary['wall_seconds']:.1f} s -> {out}"
    )


@app.command("flower-app")
def flower_app(
    config: Path = typer.Argument(..., help="YAML config file"),
    out: Path = typer.Option(..., "--out", help="the app folder to write (pyproject.toml, README.md)"),
    set_: list[str] = typer.Option([], "--set", help="override: dotted.key=value (repeatable)"),
    results: str = typer.Option(
        "", "--results", help="results folder on the SuperLink (default runs/<stem>)"
    ),
    force: bool = typer.Option(False, "--force", help="overwrite the app files of an existing folder"),
) -> None:
    """Write a standalone Flower app running CONFIG on fedskew's ServerApp and ClientApp (the resolved
    config in its run config); submit it with `flwr run OUT CONNECTION`."""
    from fedskew.experiment.config import load_config
    from fedskew.flower.app_folder import write_app

    cfg = load_config(config, set_)
    files = write_app(out, cfg, results or f"runs/{config.stem}", config.stem, force=force)
    typer.echo(
        f"wrote {', '.join(map(str, files))}; run: flwr run {out} CONNECTION ({cfg.engine.nodes} SuperNodes)"
    )


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


@app.command("list")
def list_() -> None:
    """List algorithms, models, datasets, partition schemes, backbones and generators, one line each."""
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


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="output folder"),
    rounds: int = typer.Option(30, "--rounds", help="communication rounds"),
) -> None:
    """FedAvg, FedProx and Local on scikit-learn digits, Dirichlet(0.3), 10 clients: table + plot."""
    from fedskew.experiment.config import build_config
    from fedskew.experiment.demo import DEMO_ALGORITHMS, demo_config
    from fedskew.experiment.report import find_runs, group_runs, plot_accuracy
    from fedskew.experiment.report_tables import markdown_table

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


@app.command()
def features(
    config: Path = typer.Argument(..., help="YAML config file with data.vision_language"),
    out: Path = typer.Option(..., "--out", help="output .pt file (load it with backbone 'features')"),
    set_: list[str] = typer.Option([], "--set", help="override: dotted.key=value (repeatable)"),
) -> None:
    """Extract a config's backbone features (train, test, synthetic cache, text) into one .pt file."""
    from fedskew.experiment.cachefl_tools import export_features
    from fedskew.experiment.config import load_config

    path = export_features(load_config(config, set_), out)
    console.print(f"features: {path}")


@app.command("cachefl-search")
def cachefl_search(
    config: Path = typer.Argument(
        ..., help="config with data.vision_language and data.val_fraction > 0 or data.val_shots"
    ),
    set_: list[str] = typer.Option([], "--set", help="override: dotted.key=value (repeatable)"),
    alpha_max: float = typer.Option(10.0, "--alpha-max", help="Tip-Adapter search scale of α"),
    beta_max: float = typer.Option(10.0, "--beta-max", help="Tip-Adapter search scale of β"),
    trained: bool = typer.Option(False, "--trained", help="search with the keys after a full federated run"),
    out: Path | None = typer.Option(None, "--out", help="write the choice as JSON"),
) -> None:
    """Choose CacheFL's α and β by Tip-Adapter's grid search on the clients' validation split."""
    import json

    from fedskew.experiment.cachefl_tools import search_alpha_beta
    from fedskew.experiment.config import load_config

    result = search_alpha_beta(load_config(config, set_), alpha_max, beta_max, trained)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(json.dumps(result))
    typer.echo(f"--set algorithm.alpha={result['alpha']} --set algorithm.beta={result['beta']}")


@app.command("cachefl-posthoc")
def cachefl_posthoc(
    runs: list[Path] = typer.Argument(..., help="finished CacheFL / AdapterFL run folders (<name>/seed<k>)"),
    out: Path = typer.Option(..., "--out", help="folder: writes OUT/<name>/seed<k>.json per run"),
    alpha_max: float = typer.Option(10.0, "--alpha-max", help="Tip-Adapter search scale of α"),
    beta_max: float = typer.Option(10.0, "--beta-max", help="Tip-Adapter search scale of β"),
) -> None:
    """Re-choose a finished run's head hyper-parameters (CacheFL α/β, AdapterFL ρ) on its validation split
    with the trained head (Tip-Adapter-F's order); the test accuracy of the choice is reported beside it."""
    import json

    from fedskew.experiment.cachefl_tools import posthoc_search

    for run in runs:
        result = posthoc_search(run, alpha_max, beta_max)
        dest = out / run.parent.name / f"{run.name}.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(result, indent=2) + "\n")
        scores = f"val {result['val_accuracy']:.4f} test {result['accuracy']:.4f}"
        typer.echo(f"{run}: {json.dumps(result['choice'])} {scores}")


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


def _one_line(err: BaseException) -> str:
    """The error's message on one line, even when it quotes input holding line breaks."""
    return " ".join(str(err).splitlines())


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
        print(f"error: {_one_line(err)}", file=sys.stderr)  # one unwrapped line
        sys.exit(2)
    except RunFailure as err:  # a fault, not bad input: the committed rounds are kept for --resume
        print(f"error: {_one_line(err)}", file=sys.stderr)
        sys.exit(1)
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
