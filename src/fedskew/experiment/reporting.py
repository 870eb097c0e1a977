"""``fedskew report`` as a function: result folders in, the table in the chosen format, the paired
differences, the figures and the HTML page out (the CLI only parses options)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedskew.errors import FedskewError
from fedskew.experiment.report import (
    find_runs,
    group_runs,
    paired_differences,
    paired_table,
    plot_accuracy,
    select_group,
)
from fedskew.experiment.report_html import html_report, plot_client_accuracy
from fedskew.experiment.report_tables import (
    FORMATS,
    build_table,
    check_columns,
    columns_for,
    render_csv,
    render_latex,
    render_markdown,
)


@dataclass
class ReportRequest:
    dirs: list[Path]
    format: str = "markdown"
    metrics: str | None = None  # "accuracy,loss,bytes_up"; None: the default columns
    target: float | None = None  # rounds-to-target column
    paired: str | None = None  # baseline group
    metric: str = "accuracy"  # the paired metric
    last: int = 0
    plot: Path = Path("report.png")
    clients_plot: Path | None = None  # default: beside the plot, <stem>_clients.png
    html: Path | None = None


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
    columns = columns_for(req.metrics, req.target)
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
    files = [plot_accuracy(groups, req.plot)]
    figures = [(files[0], "test accuracy vs round: mean over seeds, band ± std")]
    clients_path = req.clients_plot or req.plot.with_name(f"{req.plot.stem}_clients.png")
    clients = plot_client_accuracy(groups, clients_path)
    if clients is not None:
        files.append(clients)
        figures.append((clients, "final per-client accuracy, every seed's clients pooled"))
    if req.html is not None:
        note = "" if clients is not None else "No per-client accuracies: the runs used the global protocol."
        req.html.parent.mkdir(parents=True, exist_ok=True)
        req.html.write_text(html_report(table, figures, paired, baseline, req.metric, note), encoding="utf-8")
        files.append(req.html)
    return ReportOutput(text, files)
