"""``fedskew report`` as a function: result folders in, the table in the chosen format, the paired
differences, the figures, the HTML page and the JSON sidecar of notes and provenance out (the CLI only
parses options)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fedskew.errors import FedskewError
from fedskew.experiment import provenance
from fedskew.experiment.report import (
    Group,
    Paired,
    find_runs,
    group_runs,
    pair_by_seed,
    paired_differences,
    paired_table,
    plot_accuracy,
    select_group,
    x_axis,
)
from fedskew.experiment.report_html import html_report, plot_client_accuracy
from fedskew.experiment.report_tables import (
    FORMATS,
    Table,
    build_table,
    check_columns,
    columns_for,
    render_csv,
    render_latex,
    render_markdown,
    table_notes,
)
from fedskew.experiment.report_time import accuracy_at_time


@dataclass
class ReportRequest:
    dirs: list[Path]
    format: str = "markdown"
    metrics: str | None = None  # "accuracy,loss,bytes_up"; None: the default columns
    target: float | None = None  # rounds-to-target column
    paired: str | None = None  # baseline group
    metric: str = "accuracy"  # the paired metric
    last: int = 0
    plot: Path | None = None  # default: report.png in the first result folder (never the cwd by accident)
    clients_plot: Path | None = None  # default: beside the plot, <stem>_clients.png
    html: Path | None = None
    sidecar: Path | None = None  # notes + provenance JSON; default: beside the plot, <stem>_provenance.json
    x: str = "round"  # the accuracy figure's x axis: round or virtual_time (report_time.X_AXES)


@dataclass
class ReportOutput:
    text: str  # what goes to standard output
    files: list[Path] = field(default_factory=list)


def make_report(req: ReportRequest) -> ReportOutput:
    """The report of ``req``; bad options raise :class:`FedskewError` (one line) before any file is
    written."""
    if req.format not in FORMATS:
        raise FedskewError(f"--format '{req.format}': unknown; allowed: {', '.join(FORMATS)}")
    if req.target is not None and not req.target > 0:
        raise FedskewError(f"--target {req.target}: expected a positive accuracy such as 0.9")
    groups = group_runs(find_runs(list(req.dirs)))
    axis = x_axis(req.x, groups)
    columns = columns_for(req.metrics, req.target, groups)
    check_columns(groups, columns, req.target)
    baseline = select_group(groups, req.paired) if req.paired is not None else None
    paired = paired_differences(groups, baseline, req.metric, req.last) if baseline is not None else []
    table = build_table(groups, columns, req.target, paired, req.metric)
    paired_md = paired_table(groups, baseline, req.metric, req.last) if baseline is not None else ""
    renderers = {
        "markdown": lambda: render_markdown(table) + ("\n" + paired_md if paired_md else ""),
        "latex": lambda: render_latex(table, baseline=baseline),
        "csv": lambda: render_csv(table),
    }
    text = renderers[req.format]()
    plot = req.plot if req.plot is not None else req.dirs[0] / "report.png"
    plot.parent.mkdir(parents=True, exist_ok=True)  # --out may name a folder not made yet
    files = [plot_accuracy(groups, plot, x=req.x)]
    figures = [(files[0], f"test accuracy {axis.caption}")]
    clients_path = req.clients_plot or plot.with_name(f"{plot.stem}_clients.png")
    clients = plot_client_accuracy(groups, clients_path)
    if clients is not None:
        files.append(clients)
        figures.append((clients, "final per-client accuracy, every seed's clients pooled"))
    if req.html is not None:
        note = "" if clients is not None else "No per-client accuracies: the runs used the global protocol."
        req.html.parent.mkdir(parents=True, exist_ok=True)
        req.html.write_text(html_report(table, figures, paired, baseline, req.metric, note), encoding="utf-8")
        files.append(req.html)
    sidecar = req.sidecar or plot.with_name(f"{plot.stem}_provenance.json")
    files.append(write_sidecar(sidecar, table))
    return ReportOutput(text, files)


def paired_at_time(
    groups: list[Group], baseline: Group, budget: float, key: str = "accuracy"
) -> list[Paired]:
    """Every other group against ``baseline`` at one virtual-time budget (each run's last evaluation by
    then: :func:`~fedskew.experiment.report_time.accuracy_at_time`), paired by seed; a seed either run of
    which had not been evaluated by ``budget`` counts as unpaired."""
    return pair_by_seed(groups, baseline, lambda g: accuracy_at_time(g, budget, key))


def write_sidecar(path: Path, table: Table) -> Path:
    """The report's notes and every run's provenance as JSON: what a CSV (or a table pasted elsewhere)
    cannot carry, written beside the figures whatever the format (issue 54, item 3)."""
    runs = [r for g in table.groups for r in g.runs]
    compared = provenance.compare([r.summary.get("provenance") for r in runs])
    record = {
        "notes": table_notes(table),
        "differ": sorted(provenance.differing(compared)),
        "compared": compared,
        "runs": [
            {
                "path": str(r.path),
                "group": g.label,
                "status": r.summary.get("status"),
                "flags": r.flags,
                "provenance": r.summary.get("provenance"),
            }
            for g in table.groups
            for r in g.runs
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path
