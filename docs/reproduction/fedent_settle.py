"""Tables of the FedEnt learning-rate runs in docs/reproduction/fedent.md ("Does a larger learning rate
explain the paper's numbers?").

    python docs/reproduction/fedent_settle.py RUNS_DIR   # RUNS_DIR/<method>-lr<rate>/seed<k>/

Per folder: the final-round test accuracy with the 95% t-interval of its mean and the mean of the last 5
rounds (finished runs, mean ± std over seeds, per seed), the round at which the run first reached the
paper's FedEnt accuracy (97.24%), and for FedEnt the share of participants in the regime 1 + cG < 0 per
round (mean and max over rounds, and by phase) and how often the cost's minimiser differs from the
stationary point. Then the seed-paired differences of the final accuracy with their 95% t-intervals:
FedEnt against FedAvg at each rate, each rate against lr 0.01 (the Table III grid), FedAvg against the
paper's FedEnt, and the two solvers. Unfinished runs show their last round.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fedskew.errors import FedskewError
from fedskew.experiment.report import Group, Paired, RunResult, run_value, runs_by_folder
from fedskew.experiment.runner import METRICS_FILE

PAPER_FEDENT = 97.24
# Final-round accuracies (%) of the Table III grid at lr 0.01 (runs/fedent, seeds 0-2), the rows of
# fedent.md's Table III: the baseline rate of the cross-rate pairs.
TABLE_III_LR001 = {"fedavg": {0: 95.00, 1: 95.57, 2: 94.68}, "fedent": {0: 95.00, 1: 95.56, 2: 94.70}}


def cell(values: list[float]) -> str:
    arr = np.array(values)
    spread = f" ± {arr.std(ddof=1):.2f}" if len(arr) > 1 else ""
    return f"{arr.mean():.2f}{spread} [{len(arr)}]"


def as_paired(label: str, values: dict[int, float]) -> Paired:
    """Per-seed values (or differences) with the report's mean, std and 95% t-interval."""
    return Paired(Group(label), values, 0)


def interval(values: list[float]) -> str:
    """95% t-interval of the mean, to set against the paper's 97.24."""
    if len(values) < 2:
        return "—"
    lo, hi = as_paired("", dict(enumerate(values))).interval
    return f"[{lo:.2f}, {hi:.2f}]"


PHASES = ((1, 10), (11, 25), (26, 50))


def regime(rows: list[dict]) -> str:
    """Share of participants with 1 + cG < 0: mean / max over rounds, then the mean in rounds 1–10, 11–25
    and 26–50, and how often the cost's minimiser differs from the stationary point."""
    share = [m["fedent_neg_den"] for m in rows if "fedent_neg_den" in m]
    differ = [m["fedent_solvers_differ"] for m in rows if "fedent_solvers_differ" in m]
    if not share:
        return "—"
    phases = " / ".join(
        f"{100 * np.mean([m['fedent_neg_den'] for m in rows if lo <= m['round'] <= hi]):.0f}%"
        for lo, hi in PHASES
    )
    return (
        f"{100 * np.mean(share):.0f}% / {100 * np.max(share):.0f}%; by phase {phases}; "
        f"minimiser ≠ root for {100 * np.mean(differ):.0f}%"
    )


def finals(runs: list[RunResult] | None) -> dict[int, float]:
    return {int(r.config["seed"]): 100 * run_value(r) for r in runs or []}


def print_pairs(finished: dict[str, list[RunResult]]) -> None:
    """Seed-paired differences of final accuracy (points) with their 95% t-interval: FedEnt against FedAvg
    at each rate, each rate against lr 0.01, FedAvg against the paper's FedEnt, and the two solvers."""
    runs = {name: finals(group) for name, group in finished.items()}
    runs.update({f"{m}-lr0.01": v for m, v in TABLE_III_LR001.items()})
    pairs = [(f"FedEnt − FedAvg, lr {r}", f"fedent-lr{r}", f"fedavg-lr{r}") for r in ("0.01", "0.03", "0.1")]
    pairs += [
        (f"{m} lr {r} − {m} lr 0.01", f"{m.lower()}-lr{r}", f"{m.lower()}-lr0.01")
        for m in ("FedAvg", "FedEnt")
        for r in ("0.03", "0.1")
    ]
    pairs += [
        (f"FedAvg lr {r} − the paper's FedEnt (97.24)", f"fedavg-lr{r}", "paper") for r in ("0.03", "0.1")
    ]
    pairs += [
        ("FedEnt, minimiser − stationary point, lr 0.01", "fedent-minimiser-lr0.01", "fedent-lr0.01"),
        ("FedEnt minimiser lr 0.01 − FedAvg lr 0.03", "fedent-minimiser-lr0.01", "fedavg-lr0.03"),
    ]
    print("\n| comparison | paired seeds | per seed | mean | std | 95% t-interval |")
    print("|---|---|---|---|---|---|")
    for label, left, right in pairs:
        a = runs.get(left, {})
        b = dict.fromkeys(a, PAPER_FEDENT) if right == "paper" else runs.get(right, {})
        diffs = {seed: a[seed] - b[seed] for seed in sorted(set(a) & set(b))}
        if not diffs:
            continue
        p = as_paired(label, diffs)
        lo, hi = p.interval
        per_seed = ", ".join(f"{v:+.2f}" for v in diffs.values())
        std = "—" if p.n < 2 else f"{p.std:.2f}"
        ci = "—" if p.n < 2 else f"[{lo:+.2f}, {hi:+.2f}]"
        print(f"| {label} | {p.n} | {per_seed} | {p.mean:+.2f} | {std} | {ci} |")


def unfinished(folder: Path) -> list[str]:
    out = []
    for d in sorted(folder.glob("seed*")):
        if (d / "summary.json").is_file() or not (d / METRICS_FILE).is_file():
            continue
        rows = [json.loads(x) for x in (d / METRICS_FILE).read_text().splitlines() if x.strip()]
        if rows:
            out.append(f"{d.name}: {100 * rows[-1]['accuracy']:.2f} at round {rows[-1]['round']}")
    return out


def main(root: Path) -> None:
    try:
        finished = runs_by_folder(root)
    except FedskewError:  # nothing finished yet: the unfinished rows only
        finished = {}
    print(
        "| run | final round (%) | final: 95% t-interval | last 5 rounds (%) | per seed, final | "
        "first round ≥ 97.24% | "
        "1 + cG < 0: share of participants per round, mean / max; rounds 1–10 / 11–25 / 26–50 |"
    )
    print("|---|---|---|---|---|---|---|")
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        runs = finished.get(folder.name, [])
        rows = [json.loads(x) for r in runs for x in (r.path / METRICS_FILE).read_text().splitlines() if x]
        if runs:
            final = [100 * run_value(r) for r in runs]
            last5 = [100 * run_value(r, last=5) for r in runs]
            reach = [
                next((m["round"] for m in r.metrics if 100 * m["accuracy"] >= PAPER_FEDENT), None)
                for r in runs
            ]
            seeds = " / ".join(f"{v:.2f}" for v in final)
            print(
                f"| {folder.name} | {cell(final)} | {interval(final)} | {cell(last5)} | {seeds} | "
                f"{' / '.join(str(x or 'never') for x in reach)} | {regime(rows)} |"
            )
        for line in unfinished(folder):
            print(f"| {folder.name} (unfinished) | {line} | | | | | |")
    print_pairs(finished)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
