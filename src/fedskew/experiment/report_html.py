"""Per-client views and the one-page HTML report.

* :func:`plot_client_accuracy`: the distribution of the final round's per-client accuracies of each group
  (all seeds pooled; clients without test data left out), a violin with a box inside, so that who is left
  behind shows, not only the mean;
* :func:`html_report`: one self-contained page (tables, paired intervals, the figures as inline PNGs, the
  table's notes and the runs' provenance; no script, no external file) to open in a browser.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedskew.experiment import provenance
from fedskew.experiment.fairness import client_accuracies
from fedskew.experiment.report import Group, Paired, save_figure, seeds_text
from fedskew.experiment.report_tables import Table, label_parts, seeds_label, table_notes


def final_client_accuracies(group: Group) -> list[float]:
    """The final round's per-client accuracies of every run of the group, pooled."""
    return [a for r in group.runs for a in client_accuracies(r.summary.get("final", {}))]


def plot_client_accuracy(groups: list[Group], path: str | Path, title: str = "") -> Path | None:
    """Violin + box of each group's final per-client accuracies (%); ``None`` when no group has any (runs
    evaluated under the global protocol)."""
    data = [(g, final_client_accuracies(g)) for g in groups]
    data = [(g, accs) for g, accs in data if accs]
    if not data:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.5, 1.3 * len(data) + 2), 4.2))
    values = [[100 * a for a in accs] for _, accs in data]
    positions = list(range(1, len(data) + 1))
    ax.violinplot(values, positions, showextrema=False, widths=0.8)
    ax.boxplot(values, positions=positions, widths=0.18, showfliers=True, flierprops={"markersize": 3})
    labels = [f"{g.label.split(' | ')[0]}\n({pooled_count(g)})" for g, _ in data]
    ax.set_xticks(positions, labels, fontsize=7)
    ax.set_ylabel("final per-client test accuracy (%)")
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, ax, path, title)


def pooled_count(group: Group) -> str:
    """What a group's pooled per-client values are: ``3 seeds × 10 clients`` (``30 clients`` would read as
    one federation of 30), or ``28 clients over 3 seeds`` when the runs scored different numbers."""
    counts = [n for r in group.runs if (n := len(client_accuracies(r.summary.get("final", {}))))]
    if len(set(counts)) == 1:
        return f"{seeds_text(len(counts))} × {counts[0]} clients"
    return f"{sum(counts)} clients over {seeds_text(len(counts))}"


def table_html(table: Table) -> str:
    """The report table as HTML: best mean of each column in bold, † where the paired interval excludes 0."""
    head = ["algorithm", "data", "model", "seeds", "rounds", *(c.header for c in table.columns)]
    rows = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    best = [table.best(j) for j in range(len(table.columns))]
    for i, g in enumerate(table.groups):
        cells = [html.escape(p) for p in label_parts(g)] + [
            html.escape(seeds_label(g)),
            str(g.runs[0].summary["rounds"]),
        ]
        for j, (cell, col) in enumerate(zip(table.cells[i], table.columns, strict=True)):
            text = html.escape(cell.text(col))
            text = f"<b>{text}</b>" if i in best[j] else text
            cells.append(text + ("&dagger;" if table.marks.get((i, j)) else ""))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    rows.append("</table>")
    return "\n".join(rows)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 96vw; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.82em; }
th, td { border-bottom: 1px solid #ccc; padding: 0.3em 0.7em; text-align: right; }
td { white-space: nowrap; }
th:nth-child(-n+3), td:nth-child(-n+3) { text-align: left; white-space: normal; }
th { border-bottom: 2px solid #444; }
figure { display: inline-block; margin: 0.5em 1em 0.5em 0; }
figcaption, .note { font-size: 0.85em; color: #555; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


def _figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def paired_html(paired: Sequence[Paired], baseline: Group, key: str) -> str:
    """The seed-paired differences to the baseline (group − baseline) with their 95% t-intervals."""
    scale, unit = (100.0, " (pp)") if "accuracy" in key else (1.0, "")
    head = [
        "group",
        "paired seeds",
        f"mean difference{unit}",
        f"std{unit}",
        f"95% t-interval{unit}",
        "excludes 0",
    ]
    rows = [
        f"<p>Against <b>{html.escape(baseline.label)}</b>, final <code>{html.escape(key)}</code>.</p>",
        "<table>",
        "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>",
    ]
    for p in paired:
        lo, hi = p.interval
        ci = "n/a" if math.isnan(lo) else f"[{scale * lo:+.2f}, {scale * hi:+.2f}]"
        excl = {None: "n/a", True: "yes", False: "no"}[p.excludes_zero]
        cells = [
            html.escape(p.group.label),
            str(p.n),
            f"{scale * p.mean:+.2f}",
            f"{scale * p.std:.2f}",
            ci,
            excl,
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    rows.append("</table>")
    return "\n".join(rows)


def provenance_html(table: Table) -> str:
    """Where the runs came from: the versions, commit and machine they share (a value per run where they
    differ, flagged), then each run's command and its config's difference from the defaults."""
    runs = [r for g in table.groups for r in g.runs]
    compared = provenance.compare([r.summary.get("provenance") for r in runs])
    differ = provenance.differing(compared)
    rows = ["<table>", "<tr><th>key</th><th>value (runs)</th></tr>"]
    for label, counts in compared.items():
        values = ", ".join(f"{v} ({n})" for v, n in sorted(counts.items()))
        text = f"<b>differs: {html.escape(values)}</b>" if label in differ else html.escape(values)
        rows.append(f"<tr><td>{html.escape(label)}</td><td>{text}</td></tr>")
    rows.append("</table>")
    lead = "The runs differ in " + ", ".join(differ) + "." if differ else "Every run shares these values."
    parts = [f'<p class="note">{html.escape(lead)}</p>', *rows]
    for r in runs:
        prov: Any = r.summary.get("provenance") or {}
        command = prov.get("command") or prov.get("entry") or "not recorded"
        listed = "\n".join(f"{k}: {v}" for k, v in (prov.get("config_changes") or {}).items())
        where, command = html.escape(str(r.path)), html.escape(str(command))
        parts.append(
            f"<details><summary>{where}: <code>{command}</code></summary>"
            f"<pre>{html.escape(listed or '(the defaults)')}</pre></details>"
        )
    return "\n".join(parts)


def html_report(
    table: Table,
    figures: list[tuple[Path, str]],
    paired: Sequence[Paired] = (),
    baseline: Group | None = None,
    paired_key: str = "accuracy",
    note: str = "",
    title: str = "fedskew report",
) -> str:
    """The page: the table, the paired differences, and the figures inline."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{len(table.groups)} groups, {sum(len(g.runs) for g in table.groups)} runs; '
        f"final-round metrics, mean ± std over seeds, best in bold. Written {stamp}.</p>",
        "<h2>Final metrics</h2>",
        table_html(table),
    ]
    if table.marks:
        parts.append(
            '<p class="note">&dagger;: the seed-paired 95% interval against the baseline excludes 0.</p>'
        )
    if note:
        parts.append(f'<p class="note">{html.escape(note)}</p>')
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in table_notes(table)[:-1]]  # last: provenance
    if baseline is not None:
        parts += ["<h2>Seed-paired differences</h2>", paired_html(paired, baseline, paired_key)]
    if figures:
        parts.append("<h2>Figures</h2>")
        parts += [_figure(path, caption) for path, caption in figures]
    parts += ["<h2>Provenance</h2>", provenance_html(table)]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
