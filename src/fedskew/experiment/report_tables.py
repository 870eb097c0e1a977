"""The report's table as data, and its three renderings: Markdown, LaTeX (booktabs) and CSV.

A table is one row per group and one :class:`Column` per chosen metric; each cell holds the per-run
values, so every format shows the same numbers: the mean over seeds ± the sample std (``± `` only with
two runs or more) at the column's scale and digits. LaTeX puts the best mean of each column in bold (the
column's direction: higher accuracy, lower loss, bytes, seconds, rounds, spread or Gini) and marks with
``†`` a cell whose seed-paired 95% interval against the ``--paired`` baseline excludes 0.

Every format says what it must not hide (issue 54): the unit of each spread (``±`` is over seeds; the std
over clients exists only under the personalized protocol, and is ``n/a`` for a run under the global one),
the runs that failed or ended non-finite (``3 (1 failed)`` in the seeds cell, and a note naming them), and
where the numbers came from (:mod:`fedskew.experiment.provenance`: one line, saying so when runs differ).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from fedskew.errors import FedskewError
from fedskew.experiment import provenance
from fedskew.experiment.fairness import client_accuracies, client_fairness
from fedskew.experiment.report import Group, Paired, RunResult, rounds_to

Better = Literal["high", "low"]
#: the formats ``fedskew report --format`` writes
FORMATS = ("markdown", "latex", "csv")


@dataclass(frozen=True)
class Column:
    """A metric column: ``key`` of ``summary.json`` (``final`` first, then its top level), or
    ``rounds_to`` (the first round reaching ``--target``)."""

    key: str
    header: str
    scale: float = 1.0
    digits: int = 2
    spread: bool = True  # ± the std over seeds
    better: Better = "high"


#: how a known metric is shown; any other numeric key is shown as it is stored, higher better
KNOWN: dict[str, Column] = {
    "accuracy": Column("accuracy", "final accuracy (%)", 100.0),
    "accuracy_std": Column("accuracy_std", "std over clients (%)", 100.0, better="low"),
    "accuracy_worst10": Column("accuracy_worst10", "worst 10% (%)", 100.0),
    "accuracy_gini": Column("accuracy_gini", "Gini", 1.0, 3, better="low"),
    "accuracy_weighted": Column("accuracy_weighted", "weighted accuracy (%)", 100.0),
    "val_accuracy": Column("val_accuracy", "val accuracy (%)", 100.0),
    "loss": Column("loss", "loss", 1.0, 4, better="low"),
    "bytes_up": Column("bytes_up", "MB up", 1 / 2**20, better="low"),
    "bytes_down": Column("bytes_down", "MB down", 1 / 2**20, better="low"),
    "wall_seconds": Column("wall_seconds", "s/run", 1.0, 1, better="low"),
    "rounds": Column("rounds", "rounds", 1.0, 0, spread=False),
    # summary.json's compute (fedskew.engine.compute): a step is one optimizer update on one mini-batch
    "client_steps": Column("client_steps", "client steps", 1.0, 0, better="low"),
    "client_samples": Column("client_samples", "client samples", 1.0, 0, better="low"),
    "eval_finetune_steps": Column("eval_finetune_steps", "eval fine-tune steps", 1.0, 0, better="low"),
    "eval_finetune_samples": Column("eval_finetune_samples", "eval fine-tune samples", 1.0, 0, better="low"),
    "total_steps": Column("total_steps", "total steps", 1.0, 0, better="low"),
    "total_samples": Column("total_samples", "total samples", 1.0, 0, better="low"),
}
#: the keys of summary.json's ``compute`` a column may name
COMPUTE = ("client_steps", "client_samples", "eval_finetune_steps", "eval_finetune_samples", "total_steps",
           "total_samples")  # fmt: skip

#: the Markdown table's columns since the first report (kept as they were)
DEFAULT_COLUMNS = (
    KNOWN["accuracy"],
    Column("accuracy_std", "std over clients (%)", 100.0, spread=False, better="low"),
    Column("loss", "loss", 1.0, 4, spread=False, better="low"),
    Column("bytes_up", "MB up", 1 / 2**20, spread=False, better="low"),
    Column("wall_seconds", "s/run", 1.0, 1, spread=False, better="low"),
)


#: the metrics that are a spread over one run's clients: none under the global protocol
PER_CLIENT = ("accuracy_std",)


def all_global(groups: Sequence[Group]) -> bool:
    """Every run was evaluated under the global protocol (one model, one test set: no per-client spread)."""
    return all(r.protocol == "global" for g in groups for r in g.runs)


def columns_for(metrics: str | None, target: float | None, groups: Sequence[Group] = ()) -> list[Column]:
    """The columns of ``--metrics a,b,c`` (default: the Markdown table's, without the std over clients
    when every run of ``groups`` used the global protocol), plus rounds-to-target."""
    cols = list(DEFAULT_COLUMNS) if not metrics else [metric_column(k) for k in _split(metrics)]
    if not metrics and groups and all_global(groups):
        cols = [c for c in cols if c.key not in PER_CLIENT]
    if not metrics:
        cols += compute_columns(groups)
    if target is not None:
        cols.append(Column("rounds_to", f"rounds to {_percent(target)}", 1.0, 1, better="low"))
    return cols


def compute_columns(groups: Sequence[Group]) -> list[Column]:
    """The default table's compute columns, so that unequal compute is visible (issue 52): client steps
    where a run counted its compute (runs written before have none: the table is as it was), evaluation-time
    fine-tuning steps where a run took any."""
    computes = [r.summary.get("compute") for g in groups for r in g.runs]
    counted = [c for c in computes if isinstance(c, dict)]
    cols = [replace(KNOWN["client_steps"], spread=False)] if counted else []
    if any(c.get("eval_finetune_steps") for c in counted):
        cols.append(replace(KNOWN["eval_finetune_steps"], spread=False))
    return cols


def _split(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        raise FedskewError("--metrics: expected comma-separated keys such as accuracy,loss,bytes_up")
    return keys


def _percent(target: float) -> str:
    return f"{100 * target:g}%" if target <= 1 else f"{target:g}"


def metric_column(key: str) -> Column:
    return KNOWN.get(key, Column(key, key, 1.0, 4))


def run_metric(run: RunResult, column: Column, target: float | None = None) -> float | None:
    """One run's value of a column (``None``: the run has none, e.g. a target never reached)."""
    if column.key == "rounds_to":
        reached = rounds_to(run, target if target is not None else math.inf)
        return None if reached is None else float(reached)
    if column.key in PER_CLIENT and run.protocol == "global":  # recorded as 0: there is no such spread
        return None
    final = dict(run.summary.get("final", {}))
    if column.key not in final:  # runs written before the fairness metrics: derived from their clients
        final.update(client_fairness(client_accuracies(final)))
    compute = run.summary.get("compute")
    counted = compute.get(column.key) if isinstance(compute, dict) and column.key in COMPUTE else None
    value = final.get(column.key, run.summary.get(column.key, counted))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_columns(groups: Sequence[Group], columns: Sequence[Column], target: float | None) -> None:
    """A column no run has a value for is a typo: one line naming the keys the runs do have."""
    for col in columns:
        if col.key == "rounds_to":
            continue
        if all(run_metric(r, col, target) is None for g in groups for r in g.runs):
            run = groups[0].runs[0]
            keys = {k for k, v in run.summary.get("final", {}).items() if isinstance(v, int | float)}
            keys |= {"bytes_up", "bytes_down", "wall_seconds", "rounds"}
            keys |= set(COMPUTE) if isinstance(run.summary.get("compute"), dict) else set()
            per_client = col.key in PER_CLIENT
            why = " (the runs used the global protocol: one model, one test set)" if per_client else ""
            keys -= set(PER_CLIENT) if per_client else set()
            raise FedskewError(
                f"--metrics '{col.key}': no run has it{why}; available: {', '.join(sorted(keys))}"
            )


@dataclass
class Cell:
    values: list[float]  # the runs that have a value
    runs: int  # the group's runs

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else 0.0

    def text(self, col: Column, pm: str = " ± ") -> str:
        if not self.values:
            return "n/a"
        body = f"{col.scale * self.mean:.{col.digits}f}"
        if col.spread and len(self.values) > 1:
            body += f"{pm}{col.scale * self.std:.{col.digits}f}"
        if len(self.values) < self.runs:  # e.g. runs that never reached the target
            body += f" ({len(self.values)}/{self.runs})"
        return body


@dataclass
class Table:
    groups: list[Group]
    columns: list[Column]
    cells: list[list[Cell]]  # [group][column]
    marks: dict[tuple[int, int], bool]  # (group, column) -> paired interval excludes 0

    def best(self, j: int) -> set[int]:
        """Rows holding the best mean of column ``j`` (ties: all of them; none when every row ties)."""
        means = [self.cells[i][j].mean for i in range(len(self.groups))]
        finite = [m for m in means if not math.isnan(m)]
        if len(finite) < 2 or min(finite) == max(finite):  # nothing to single out
            return set()
        top = max(finite) if self.columns[j].better == "high" else min(finite)
        return {i for i, m in enumerate(means) if m == top}


def build_table(
    groups: list[Group],
    columns: list[Column],
    target: float | None = None,
    paired: Sequence[Paired] = (),
    paired_key: str = "accuracy",
) -> Table:
    cells = [
        [
            Cell([v for r in g.runs if (v := run_metric(r, c, target)) is not None], len(g.runs))
            for c in columns
        ]
        for g in groups
    ]
    marks: dict[tuple[int, int], bool] = {}
    for p in paired:
        for j, c in enumerate(columns):
            if c.key == paired_key and p.excludes_zero:
                marks[(groups.index(p.group), j)] = True
    return Table(groups, columns, cells, marks)


def markdown_table(groups: list[Group]) -> str:
    """The report's Markdown table with its default columns (final accuracy mean ± std over seeds, the
    mean over seeds of the std over clients where there is one, loss, MB up, seconds a run) and its notes."""
    return render_markdown(build_table(groups, columns_for(None, None, groups)))


FLAGS = ("failed", "non-finite")


def seeds_label(group: Group) -> str:
    """The seeds cell: ``3``, or ``3 (1 failed)`` when runs of the group failed or ended non-finite."""
    counts = {flag: sum(flag in r.flags for r in group.runs) for flag in FLAGS}
    marks = ", ".join(f"{n} {flag}" for flag, n in counts.items() if n)
    return f"{len(group.runs)}" + (f" ({marks})" if marks else "")


def spread_note(table: Table) -> str:
    """What each spread of the table is over, per protocol."""
    runs = [r for g in table.groups for r in g.runs]
    parts = ["final-round metrics; ± is the sample std over seeds (the runs of a group)"]
    if all_global(table.groups):
        parts.append("global protocol: one model scored on one test set, so there is no per-client spread")
    elif any(c.key in PER_CLIENT for c in table.columns):
        some_global = any(r.protocol == "global" for r in runs)
        parts.append(
            "std over clients: the spread of a run's per-client test accuracies (personalized protocol), "
            "mean over seeds" + ("; n/a for runs under the global protocol" if some_global else "")
        )
    return "; ".join(parts) + "."


def table_notes(table: Table) -> list[str]:
    """The lines every rendering carries under its table: the spreads' units, each run that failed or
    ended non-finite (with its reason; included in the means), and the provenance."""
    notes = [spread_note(table)]
    for g in table.groups:
        for r in g.runs:
            if r.flags:
                reason = r.summary.get("failure") or "a non-finite loss or accuracy"
                notes.append(f"{' and '.join(r.flags).upper()} (included above): {r.path}: {reason}")
    compared = provenance.compare([r.summary.get("provenance") for g in table.groups for r in g.runs])
    notes.append(provenance.describe(compared))
    return notes


def label_parts(group: Group) -> list[str]:
    """A group's label as (algorithm, data, model)."""
    parts = group.label.split(" | ")
    return ([*parts, "", "", ""])[:3]


def render_markdown(table: Table) -> str:
    """The Markdown table: algorithm, data, model, seeds, rounds and the columns."""
    head = ["algorithm", "data", "model", "seeds", "rounds", *(c.header for c in table.columns)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g, cells in zip(table.groups, table.cells, strict=True):
        texts = [cell.text(col) for cell, col in zip(cells, table.columns, strict=True)]
        rows.append(
            f"| {g.label} | {seeds_label(g)} | {g.runs[0].summary['rounds']} | " + " | ".join(texts) + " |"
        )
    return "\n".join([*rows, "", *table_notes(table)]) + "\n"


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
}  # fmt: skip


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def render_latex(table: Table, caption: str = "", baseline: Group | None = None) -> str:
    """A booktabs ``table`` environment (needs ``\\usepackage{booktabs}``): mean $\\pm$ std over seeds,
    the best mean of each column in bold, ``$^\\dagger$`` where the paired interval excludes 0."""
    head = ["Algorithm", "Data", "Model", "Seeds", *(latex_escape(c.header) for c in table.columns)]
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\begin{tabular}{lll" + "r" * (1 + len(table.columns)) + "}",
        r"\toprule",
        " & ".join(head) + r" \\",
        r"\midrule",
    ]
    best = [table.best(j) for j in range(len(table.columns))]
    for i, g in enumerate(table.groups):
        cells = []
        for j, (cell, col) in enumerate(zip(table.cells[i], table.columns, strict=True)):
            text = latex_escape(cell.text(col, pm="\x00")).replace("\x00", " $\\pm$ ")
            if i in best[j]:
                text = rf"\textbf{{{text}}}"
            if table.marks.get((i, j)):
                text += r"$^\dagger$"
            cells.append(text)
        parts = [latex_escape(p) for p in label_parts(g)]
        lines.append(" & ".join([*parts, latex_escape(seeds_label(g)), *cells]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    note = caption or "Final-round metrics, mean $\\pm$ std over seeds; best in bold."
    if any(r.flags for g in table.groups for r in g.runs):
        note += " Runs marked failed or non-finite are included in the means."
    if baseline is not None:
        note += (
            " $^\\dagger$: the seed-paired 95\\% t-interval of the difference to "
            f"{latex_escape(baseline.label.split(' | ')[0])} excludes 0."
        )
    lines += [rf"\caption{{{note}}}", r"\end{table}"]
    lines += ["% " + " ".join(n.splitlines()) for n in table_notes(table)]  # the notes, as comments
    return "\n".join(lines) + "\n"


def render_csv(table: Table) -> str:
    """One row per group: its label parts, seeds, and per column ``<key>_mean`` / ``<key>_std`` / ``<key>_n``
    (raw values as stored, unscaled), then ``failed_runs`` and ``nonfinite_runs``. The notes and the
    provenance do not fit a CSV: ``fedskew report`` writes them to a JSON sidecar (``reporting.py``)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    head = ["algorithm", "data", "model", "detail", "seeds"]
    for c in table.columns:
        head += [f"{c.key}_mean", f"{c.key}_std", f"{c.key}_n"]
    writer.writerow([*head, "failed_runs", "nonfinite_runs"])
    for i, g in enumerate(table.groups):
        row: list[object] = [*[p.strip() for p in label_parts(g)], g.detail, len(g.runs)]
        for cell in table.cells[i]:
            row += [_num(cell.mean), _num(cell.std) if len(cell.values) > 1 else "", len(cell.values)]
        writer.writerow([*row, *(sum(flag in r.flags for r in g.runs) for flag in FLAGS)])
    return buf.getvalue()


def _num(value: float) -> str:
    return "" if math.isnan(value) else repr(value)
