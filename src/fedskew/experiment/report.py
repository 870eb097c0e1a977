"""Reports over result folders: a markdown table of final metrics (mean ± std over seeds) and an
accuracy-vs-round plot. Runs are grouped by everything in their config except the seed and the name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedskew.errors import FedskewError
from fedskew.experiment.runner import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE


@dataclass
class RunResult:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]

    @property
    def label(self) -> str:
        c = self.config
        part = dict(c["data"]["partition"])
        scheme = part.pop("name")
        args = ",".join(f"{k}={v}" for k, v in sorted(part.items()))
        return f"{c['algorithm']['name']} | {c['data']['dataset']} {scheme}({args}) | {c['model']['name']}"


@dataclass
class Group:
    label: str
    runs: list[RunResult] = field(default_factory=list)

    def stat(self, key: str) -> tuple[float, float]:
        vals = [r.summary["final"].get(key) for r in self.runs]
        arr = np.array([v for v in vals if v is not None], dtype=float)
        if arr.size == 0:
            return float("nan"), float("nan")
        return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def find_runs(paths: list[str | Path]) -> list[RunResult]:
    """Every folder holding a ``summary.json`` at or below the given paths."""
    found: list[RunResult] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FedskewError(f"report: '{p}' does not exist")
        candidates = [p] if (p / SUMMARY_FILE).is_file() else sorted(s.parent for s in p.rglob(SUMMARY_FILE))
        for d in candidates:
            metrics = [
                json.loads(line) for line in (d / METRICS_FILE).read_text().splitlines() if line.strip()
            ]
            found.append(
                RunResult(
                    d,
                    yaml.safe_load((d / CONFIG_FILE).read_text()),
                    json.loads((d / SUMMARY_FILE).read_text()),
                    metrics,
                )
            )
    if not found:
        raise FedskewError(f"report: no finished runs (no {SUMMARY_FILE}) under {', '.join(map(str, paths))}")
    return found


def runs_by_folder(root: str | Path) -> dict[str, list[RunResult]]:
    """Finished runs under ``root`` laid out as ``<name>/seed<k>/``, keyed by ``<name>``, sorted by seed."""
    out: dict[str, list[RunResult]] = {}
    for r in find_runs([root]):
        out.setdefault(r.path.parent.name, []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r.config["seed"])
    return out


def group_runs(runs: list[RunResult]) -> list[Group]:
    groups: dict[str, Group] = {}
    for r in runs:
        key_cfg = {k: v for k, v in r.config.items() if k not in ("seed", "name")}
        key = json.dumps(key_cfg, sort_keys=True)
        groups.setdefault(key, Group(r.label)).runs.append(r)
    return list(groups.values())


def _pm(mean: float, std: float) -> str:
    return "n/a" if np.isnan(mean) else f"{100 * mean:.2f} ± {100 * std:.2f}"


def markdown_table(groups: list[Group]) -> str:
    """Final-round accuracy (%) mean ± std over seeds, and the mean over seeds of the std over clients."""
    rows = [
        "| algorithm | data | model | seeds | rounds | final accuracy (%) | std over clients (%) | loss "
        "| MB up | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        mean, std = g.stat("accuracy")
        acc = _pm(mean, std) if len(g.runs) > 1 else f"{100 * mean:.2f}"
        client_std = g.stat("accuracy_std")[0]
        loss = g.stat("loss")[0]
        mb = np.mean([r.summary["bytes_up"] for r in g.runs]) / 2**20
        secs = np.mean([r.summary["wall_seconds"] for r in g.runs])
        rounds = g.runs[0].summary["rounds"]
        rows.append(
            f"| {g.label} | {len(g.runs)} | {rounds} | {acc} | {100 * client_std:.2f} | {loss:.4f} | "
            f"{mb:.2f} | {secs:.1f} |"
        )
    return "\n".join(rows) + "\n"


def seeds_cell(runs: list[RunResult], key: str = "accuracy", scale: float = 100.0) -> str:
    """``mean ± std`` over seeds (sample std) of a final-round metric, in percent by default."""
    vals = np.array([scale * r.summary["final"][key] for r in runs])
    return f"{vals.mean():.2f} ± {vals.std(ddof=1):.2f}" if len(vals) > 1 else f"{vals.mean():.2f}"


def rounds_to(run: RunResult, target: float, key: str = "accuracy") -> int | None:
    """First evaluated round whose ``key`` reaches ``target`` (Table III-style R_x%), or None."""
    return next((m["round"] for m in run.metrics if (m.get(key) or 0) >= target), None)


def mean_curve(group: Group, key: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Rounds at which any run of the group logged ``key``, and the mean and std over its runs there."""
    rounds = sorted({m["round"] for r in group.runs for m in r.metrics if m.get(key) is not None})
    table = np.full((len(group.runs), len(rounds)), np.nan)
    for i, r in enumerate(group.runs):
        for m in r.metrics:
            if m.get(key) is not None:
                table[i, rounds.index(m["round"])] = m[key]
    return rounds, np.nanmean(table, 0), np.nanstd(table, 0)


def plot_accuracy(
    groups: list[Group],
    path: str | Path,
    title: str = "",
    key: str = "accuracy",
    ylabel: str = "test accuracy (%)",
    scale: float = 100.0,
) -> Path:
    """A per-round metric (test accuracy by default) vs round: mean over seeds, shaded ± std. Any
    ``metrics.jsonl`` key works, e.g. ``key="loss", scale=1`` for the test loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for g in groups:
        rounds, mean, std = mean_curve(g, key)
        ax.plot(rounds, scale * mean, label=g.label.split(" | ")[0], lw=1.6)
        if len(g.runs) > 1:
            ax.fill_between(rounds, scale * (mean - std), scale * (mean + std), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
