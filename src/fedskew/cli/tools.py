"""CacheFL's tools: backbone features to a file, α / β search, post-hoc re-choice on finished runs."""

from __future__ import annotations

from pathlib import Path

import typer

from fedskew.cli.common import app, console


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
