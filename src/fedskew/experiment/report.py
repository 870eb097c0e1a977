"""Reports over result folders: a markdown table of final metrics (mean ± std over seeds), seed-paired
differences against a baseline group, and an accuracy-vs-round plot. Runs are grouped by everything in
their config except the seed and the name.

A label (algorithm | data | model) never hides what tells the compared runs apart (issue 54, item 9):
every *result-changing* key whose value differs between the groups is appended to the label of each group
it concerns (an algorithm's hyper-parameter only among the groups of that algorithm, a model's option only
among those of that model); keys that change how a run is executed or watched, not its numbers
(:data:`RUNTIME_ONLY`), are appended only where labels would otherwise coincide."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.stats

from fedskew.errors import FedskewError
from fedskew.experiment.config import RUNTIME_ONLY as CONFIG_RUNTIME_ONLY
from fedskew.experiment.config import WATCH_ONLY, read_saved_config, results_config
from fedskew.experiment.config_diff import flatten as flatten_config
from fedskew.experiment.report_time import TIME_AXIS, XAxis, require_key
from fedskew.experiment.runner import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from fedskew.experiment.tune_section import check_no_tuning_runs


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

    @property
    def protocol(self) -> str:
        """The protocol the run was evaluated under: as its summary records it; for a summary without it,
        ``personalized`` when it holds per-client accuracies, else the config's ``eval.protocol``."""
        if "protocol" in self.summary:
            return str(self.summary["protocol"])
        if self.summary.get("final", {}).get("accuracy_clients"):
            return "personalized"
        return str((self.config.get("eval") or {}).get("protocol", "global"))

    @property
    def flags(self) -> list[str]:
        """``failed`` (summary.json says so) and ``non-finite`` (a non-finite loss or accuracy in an
        evaluated round, or none left in the final one): what a reader of the table must be told."""
        final = self.summary.get("final", {})
        nonfinite = bool(self.summary.get("nonfinite_rounds")) or any(
            k in final and final[k] is None for k in ("accuracy", "loss")
        )
        failed = self.summary.get("status") == "failed"
        return [flag for flag, on in (("failed", failed), ("non-finite", nonfinite)) if on]


@dataclass
class Group:
    label: str
    runs: list[RunResult] = field(default_factory=list)
    detail: str = ""  # "key=value,...": what tells apart groups whose labels would otherwise coincide

    @property
    def algorithm(self) -> str:
        return str(self.runs[0].config["algorithm"]["name"])

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
                    read_saved_config(d / CONFIG_FILE),  # keys added since: their defaults
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


def value_text(value: Any) -> str:
    """A config value as YAML-like text: ``fedavg``, ``0.5``, ``true``, ``null``, ``[1, 2]``."""
    return value if isinstance(value, str) else json.dumps(value)


#: config keys (a name covers the keys below it) that change how a run is executed or watched, not its
#: numbers: shown in a label only where labels would otherwise coincide. It starts with what
#: ``results_config`` leaves out (config.WATCH_ONLY, config.RUNTIME_ONLY), so the two cannot drift apart.
RUNTIME_ONLY = (
    *WATCH_ONLY, *(f"{section}.{key}" for section, keys in CONFIG_RUNTIME_ONLY.items() for key in keys),
    "checkpoint", "data.root", "engine.workers", "engine.memory_mb", "engine.state_memory_mb",
    "engine.fold_uploads", "engine.max_skipped_share", "engine.round_timeout", "engine.ray_address",
    "engine.runtime", "engine.nodes", "eval.per_class",
)  # fmt: skip
#: keys the label itself shows (algorithm | dataset partition(args) | model), and the seed
IN_LABEL = ("seed", "algorithm.name", "data.dataset", "data.partition", "model.name")
#: sections of a named variant: their keys are compared only among the groups of the same variant (FedProx's
#: mu tells two FedProx groups apart; against FedAvg it is part of being FedProx)
SCOPED = {"algorithm": "algorithm.name", "model": "model.name"}


def _under(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(f"{n}.") for n in names)


def group_runs(runs: list[RunResult]) -> list[Group]:
    groups: dict[str, Group] = {}
    for r in runs:
        key_cfg = {k: v for k, v in results_config(r.config).items() if k not in ("seed", "name")}
        key = json.dumps(key_cfg, sort_keys=True)
        groups.setdefault(key, Group(r.label)).runs.append(r)
    found = list(groups.values())
    for g in found:  # a tune's trial runs never average into its chosen config's reported numbers
        seen = [(r.config["seed"], r.config.get("tuning"), str(r.path)) for r in g.runs]
        check_no_tuning_runs(g.label, seen)
    _label_differences(found)
    _disambiguate(found)
    return found


def _flat(group: Group) -> dict[str, str]:
    return {k: json.dumps(v, sort_keys=True) for k, v in flatten_config(group.runs[0].config).items()}


def _append(group: Group, keys: list[str]) -> None:
    flat = flatten_config(group.runs[0].config)
    detail = ",".join(f"{k}={value_text(flat.get(k))}" for k in keys)
    group.detail = ",".join(d for d in (group.detail, detail) if d)
    head, sep, tail = group.label.partition(" | ")  # the markdown table splits labels on " | "
    group.label = f"{head.split(' (')[0]} ({group.detail}){sep}{tail}"


def _label_differences(groups: list[Group]) -> None:
    """Append to each label the result-changing keys whose value differs between it and the groups it is
    compared with (all of them; for a :data:`SCOPED` key, those of the same variant)."""
    flats = [_flat(g) for g in groups]
    keys = sorted({k for f in flats for k in f if not _under(k, RUNTIME_ONLY + IN_LABEL)})
    for g, flat in zip(groups, flats, strict=True):
        shown = []
        for k in keys:
            scope = SCOPED.get(k.split(".")[0])
            peers = [f for f in flats if scope is None or f.get(scope) == flat.get(scope)]
            if k in flat and len({f.get(k) for f in peers}) > 1:
                shown.append(k)
        if shown:
            _append(g, shown)


def _disambiguate(groups: list[Group]) -> None:
    """Append to labels that still coincide the (runtime-only) config keys whose values differ among
    those groups."""
    by_label: dict[str, list[Group]] = {}
    for g in groups:
        by_label.setdefault(g.label, []).append(g)
    for same in by_label.values():
        if len(same) < 2:
            continue
        flats = [_flat(g) for g in same]
        keys = set().union(*flats) - {"seed", "name"}
        differing = sorted(k for k in keys if len({f.get(k) for f in flats}) > 1)
        for g in same:
            _append(g, differing)


def seeds_text(n: int) -> str:
    """``1 seed``, ``3 seeds``: how many runs a group's mean is over."""
    return f"{n} seed{'s' * (n != 1)}"


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


def draw_rounds(ax: Any, group: Group, key: str, scale: float, label: str) -> None:
    """A group's mean curve over its rounds, shaded ± std over seeds (the ``--x round`` figure)."""
    rounds, mean, std = mean_curve(group, key)
    ax.plot(rounds, scale * mean, label=label, lw=1.6)
    if len(group.runs) > 1:
        ax.fill_between(rounds, scale * (mean - std), scale * (mean + std), alpha=0.2)


#: ``--x``: what the accuracy figure is drawn against
X_AXES = {
    "round": XAxis("round", "vs round: mean over seeds, band ± std", draw_rounds),
    "virtual_time": TIME_AXIS,
}


def x_axis(name: str, groups: list[Group]) -> XAxis:
    """The axis ``--x name`` once every run of ``groups`` logs what it needs (else one line naming the
    first result folder without it)."""
    axis = X_AXES.get(name)
    if axis is None:
        raise FedskewError(f"--x '{name}': unknown x axis; allowed: {', '.join(X_AXES)}")
    require_key(f"--x {name}", axis.needs, groups, "; allowed for it: --x round")
    return axis


def plot_accuracy(
    groups: list[Group],
    path: str | Path,
    title: str = "",
    key: str = "accuracy",
    ylabel: str = "test accuracy (%)",
    scale: float = 100.0,
    x: str = "round",
) -> Path:
    """A per-round metric (test accuracy by default) vs round (mean over seeds, shaded ± std) or, with
    ``x="virtual_time"``, vs the virtual clock's time (each seed's curve, and their mean up to the shortest
    run's end: :mod:`fedskew.experiment.report_time`). Any ``metrics.jsonl`` key works, e.g. ``key="loss",
    scale=1`` for the test loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = x_axis(x, groups)  # before any figure: an unknown axis or a run without its key is one line
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for g in groups:
        axis.draw(ax, g, key, scale, f"{g.label.split(' | ')[0]} ({seeds_text(len(g.runs))})")
    ax.set_xlabel(axis.label)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, ax, path, title)


def save_figure(fig: Any, ax: Any, path: str | Path, title: str = "") -> Path:
    """Title (if any), tight layout, a PNG at 110 dpi, and the figure closed: every report figure ends so."""
    import matplotlib.pyplot as plt

    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- seed-paired differences
def select_group(groups: list[Group], name: str) -> Group:
    """The group named by ``name``: its exact label, else the sweep folder holding its runs
    (``OUT/<name>/seed<k>``), else its algorithm name, else a part of its label (the first of these rules
    that matches anything must match exactly one group)."""
    rules = (
        [g for g in groups if g.label == name],
        [g for g in groups if any(r.path.parent.name == name for r in g.runs)],
        [g for g in groups if g.algorithm == name],
        [g for g in groups if name in g.label],
    )
    for matches in rules:
        if len(matches) == 1:
            return matches[0]
        if matches:
            labels = "; ".join(f"'{g.label}'" for g in matches)
            raise FedskewError(
                f"--paired '{name}' matches {len(matches)} groups: {labels}; give more of a label"
            )
    labels = "; ".join(f"'{g.label}'" for g in groups)
    raise FedskewError(
        f"--paired '{name}': no group's label, sweep folder or algorithm matches; groups: {labels}"
    )


def run_value(run: RunResult, key: str = "accuracy", last: int = 0) -> float:
    """``final[key]`` of the summary, or with ``last > 0`` the mean of ``key`` over the last evaluated
    rounds of ``metrics.jsonl``. A list (``accuracy_clients``, ``accuracy_classes``) is no such metric."""
    if last > 0:
        vals = [m[key] for m in run.metrics if _number(m.get(key))][-last:]
        value = float(np.mean(vals)) if vals else None
    else:
        value = run.summary["final"].get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        keys = ", ".join(k for k, v in run.summary["final"].items() if _number(v))
        raise FedskewError(f"--metric '{key}': no number in the results of '{run.path}'; available: {keys}")
    return float(value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def values_by_seed(group: Group, key: str = "accuracy", last: int = 0) -> dict[int, float]:
    """``{seed: value}`` over a group's runs; two runs of one seed cannot be paired."""
    out: dict[int, float] = {}
    for r in group.runs:
        seed = r.config["seed"]
        if seed in out:
            raise FedskewError(
                f"group '{group.label}' has two runs of seed {seed} (one is '{r.path}'); report one"
            )
        out[seed] = run_value(r, key, last)
    return out


@dataclass
class Paired:
    """A group's per-seed differences to the baseline (group − baseline) and their 95% t-interval."""

    group: Group
    diffs: dict[int, float]  # seed -> difference, over the seeds both groups have
    unpaired: int  # seeds of either group without a partner

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.diffs.values()))) if self.diffs else float("nan")

    @property
    def std(self) -> float:
        return float(np.std(list(self.diffs.values()), ddof=1)) if self.n > 1 else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        """mean ± t_{0.975, n−1} · std / √n (nan below two pairs)."""
        half = (
            float(scipy.stats.t.ppf(0.975, self.n - 1)) * self.std / np.sqrt(self.n) if self.n > 1 else np.nan
        )
        return self.mean - half, self.mean + half

    @property
    def excludes_zero(self) -> bool | None:
        lo, hi = self.interval
        return None if np.isnan(lo) else bool(lo > 0 or hi < 0)


def pair_by_seed(
    groups: list[Group], baseline: Group, values: Callable[[Group], Mapping[int, float | None]]
) -> list[Paired]:
    """Every other group against ``baseline``, paired by seed on ``values(group)`` (``{seed: value}``); a
    seed that either group lacks, or has no value for (``None``), is unpaired."""
    base = values(baseline)
    out = []
    for g in groups:
        if g is baseline:
            continue
        vals = values(g)
        diffs: dict[int, float] = {}
        for seed in sorted(vals.keys() & base.keys()):
            value, reference = vals[seed], base[seed]
            if value is not None and reference is not None:
                diffs[seed] = value - reference
        out.append(Paired(g, diffs, len(vals.keys() | base.keys()) - len(diffs)))
    return out


def paired_differences(
    groups: list[Group], baseline: Group, key: str = "accuracy", last: int = 0
) -> list[Paired]:
    """Every other group against ``baseline``, paired by seed."""
    return pair_by_seed(groups, baseline, lambda g: values_by_seed(g, key, last))


def paired_table(groups: list[Group], baseline: Group, key: str = "accuracy", last: int = 0) -> str:
    """Markdown: per-seed differences to the baseline, their mean, sample std and 95% t-interval; in
    percentage points for accuracies."""
    scale, unit = (100.0, " (pp)") if "accuracy" in key else (1.0, "")
    what = f"mean of the last {last} evaluated rounds of {key}" if last > 0 else f"final {key}"
    rows = [
        f"Paired by seed against '{baseline.label}' ({len(baseline.runs)} runs): {what}, group − baseline",
        "",
        f"| algorithm | data | model | paired seeds | difference per seed{unit} | mean{unit} | std{unit} "
        f"| 95% t-interval{unit} | excludes 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in paired_differences(groups, baseline, key, last):
        per_seed = ", ".join(f"{s}: {scale * d:+.2f}" for s, d in p.diffs.items()) or "—"
        lo, hi = p.interval
        ci = "n/a" if np.isnan(lo) else f"[{scale * lo:+.2f}, {scale * hi:+.2f}]"
        excl = {None: "n/a", True: "yes", False: "no"}[p.excludes_zero]
        count = f"{p.n}" + (f" ({p.unpaired} unpaired)" if p.unpaired else "")
        rows.append(
            f"| {p.group.label} | {count} | {per_seed} | {scale * p.mean:+.2f} | {scale * p.std:.2f} | {ci} "
            f"| {excl} |"
        )
    return "\n".join(rows) + "\n"
