"""Tables of the FedEnt learning-rate runs in docs/reproduction/fedent.md ("Does a larger rate explain the
paper's numbers?").

    python docs/reproduction/fedent_settle.py RUNS_DIR   # RUNS_DIR/<method>-lr<rate>/seed<k>/

Per folder: the final-round test accuracy and the mean of the last 5 rounds (finished runs, mean ± std over
seeds, per seed), the round at which the run first reached the paper's FedEnt accuracy (97.24%), and for
FedEnt the share of participants in the regime 1 + cG < 0 per round (mean and max over rounds) and how
often the cost's minimiser differs from the stationary point. Where two or more seeds of FedEnt and FedAvg at
one rate finished, their paired difference with its 95% t-interval. Unfinished runs show their last round.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fedskew.errors import FedskewError
from fedskew.experiment.report import Group, paired_differences, run_value, runs_by_folder
from fedskew.experiment.runner import METRICS_FILE

PAPER_FEDENT = 97.24


def cell(values: list[float]) -> str:
    arr = np.array(values)
    spread = f" ± {arr.std(ddof=1):.2f}" if len(arr) > 1 else ""
    return f"{arr.mean():.2f}{spread} [{len(arr)}]"


def regime(rows: list[dict]) -> str:
    share = [m["fedent_neg_den"] for m in rows if "fedent_neg_den" in m]
    differ = [m["fedent_solvers_differ"] for m in rows if "fedent_solvers_differ" in m]
    if not share:
        return "—"
    return (
        f"{100 * np.mean(share):.0f}% / {100 * np.max(share):.0f}%; minimiser ≠ root for "
        f"{100 * np.mean(differ):.0f}%"
    )


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
        "| run | final round (%) | last 5 rounds (%) | per seed, final | first round ≥ 97.24% | "
        "1 + cG < 0: mean / max share of participants per round |"
    )
    print("|---|---|---|---|---|---|")
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
                f"| {folder.name} | {cell(final)} | {cell(last5)} | {seeds} | "
                f"{' / '.join(str(x or 'never') for x in reach)} | {regime(rows)} |"
            )
        for line in unfinished(folder):
            print(f"| {folder.name} (unfinished) | {line} | | | | |")
    for rate in sorted({f.split("-lr")[-1] for f in finished if "-lr" in f}):
        base, other = finished.get(f"fedavg-lr{rate}"), finished.get(f"fedent-lr{rate}")
        if not base or not other:
            continue
        for p in paired_differences([Group("FedEnt", other)], Group("FedAvg", base), "accuracy", 0):
            if p.n >= 2:
                lo, hi = p.interval
                print(
                    f"\nlr {rate}: FedEnt − FedAvg over {p.n} paired seeds: {100 * p.mean:+.2f} "
                    f"[{100 * lo:+.2f}, {100 * hi:+.2f}]"
                )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
