"""``fedskew run``, ``flower-app`` and ``demo``: one experiment, a Flower app folder, the digits demo."""

from __future__ import annotations

from pathlib import Path

import typer

from fedskew.cli.common import app, console, run_with_progress
from fedskew.threads import apply_policy, check_threads_option

THREADS_HELP = (
    "torch threads of the run's process (engine.threads); default 0 = auto: the cores free now divided by "
    "the processes the run starts, at least 1"
)


@app.command()
def run(
    config: Path = typer.Argument(..., help="YAML config file"),
    set_: list[str] = typer.Option([], "--set", help="override: dotted.key=value (repeatable)"),
    out: Path | None = typer.Option(None, "--out", help="output folder (default runs/<config name>)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the checkpoint in --out"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output folder"),
    rounds: int | None = typer.Option(
        None,
        "--rounds",
        help="communication rounds (the same as --set rounds=N); with --resume it extends a finished or "
        "interrupted run to N rounds, exactly as a run of N rounds from the start",
    ),
    threads: int | None = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """Run one experiment and write config.yaml, metrics.jsonl, summary.json and a checkpoint."""
    from fedskew.experiment.config import load_config  # loads the config's plugins before checking it
    from fedskew.runtimes import RUNTIMES

    check_threads_option(threads)
    pinned = [f"engine.threads={threads}"] if threads is not None else []  # as --set engine.threads=N
    cfg = load_config(config, [*set_, *([f"rounds={rounds}"] if rounds is not None else []), *pinned])
    runtime = RUNTIMES.get(cfg.engine.runtime)
    apply_policy(cfg.engine.threads, runtime.processes(cfg.engine))  # before the run's first torch operation
    out = out or Path("runs") / config.stem
    if runtime.in_process:  # rounds reported here: a live progress bar
        summary = run_with_progress(cfg, out, resume, force, cfg.algorithm.name)
    else:
        console.print(f"{cfg.algorithm.name} on {cfg.engine.runtime} with {cfg.engine.nodes} nodes ...")
        if runtime.log is not None:
            label, file = runtime.log
            console.print(f"{label}: {out / file}", markup=False, highlight=False)
        summary = runtime.start(cfg, out, resume=resume, force=force)
    from fedskew.experiment.failure import check_finished, final_line

    console.print(final_line(summary, out), markup=False, highlight=False)
    check_finished(summary, out)  # a failed run: its files are written; one line and exit code 1


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


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="output folder"),
    rounds: int = typer.Option(30, "--rounds", help="communication rounds"),
    threads: int | None = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """FedAvg, FedProx and Local on scikit-learn digits, Dirichlet(0.3), 10 clients: table + plot."""
    check_threads_option(threads)
    apply_policy(threads or 0, 1)  # the three runs in turn, in this process
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
