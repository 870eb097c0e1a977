"""Paired tables of the FedSKC settling sweep in docs/reproduction/fedskc.md.

    python docs/reproduction/fedskc_settle.py RUNS_DIR [BASELINE_FOLDER]   # RUNS_DIR/<name>/seed<k>/

For every run folder against the baseline folder (default ``fmnist-dir0.2-fedavg``): the final-round test
accuracy and the mean of the last 5 rounds, mean ± std over seeds, and the per-seed paired differences
with their 95% t-interval (only seeds both folders finished are paired).
"""

from __future__ import annotations

import sys

from fedskew.experiment.report import Group, paired_differences, run_value, runs_by_folder

LABELS = {
    "fedavg": "FedAvg",
    "": "FedSKC (paper defaults)",
    "u1": "FedSKC, U = 1",
    "code": "FedSKC as the public code (no GDA, printed Eq. 5 β = 0.99, LCL warm-up, U = 1, no SiLU)",
    "gpr-literal-only": "FedAvg + printed Eq. 5 only (β = 0.99; no LCL, no GDA)",
}


def label(folder: str) -> str:
    suffix = folder.split("dir0.2", 1)[-1].lstrip("-") if "dir0.2" in folder else folder
    return f"{LABELS.get(suffix, folder)} [{folder}]"


def cell(group: Group, last: int) -> str:
    vals = [100 * run_value(r, "accuracy", last) for r in group.runs]
    mean = sum(vals) / len(vals)
    std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
    return f"{mean:.2f} ± {std:.2f} [{len(vals)}]"


def main(root: str, baseline: str) -> None:
    folders = runs_by_folder(root)
    groups = {name: Group(name, runs) for name, runs in sorted(folders.items())}
    base = groups[baseline]
    print("| Method | final round (%) | mean of the last 5 rounds (%) |\n|---|---|---|")
    for name, g in groups.items():
        print(f"| {label(name)} | {cell(g, 0)} | {cell(g, 5)} |")
    for last, what in ((0, "final round"), (5, "mean of the last 5 rounds")):
        print(f"\nPaired against {label(baseline)}, {what} (percentage points, group − baseline):\n")
        print("| Method | pairs | mean | std | 95% t-interval | excludes 0 |\n|---|---|---|---|---|---|")
        for p in paired_differences(list(groups.values()), base, "accuracy", last):
            lo, hi = p.interval
            print(
                f"| {label(p.group.label)} | {p.n} | {100 * p.mean:+.2f} | {100 * p.std:.2f} | "
                f"[{100 * lo:+.2f}, {100 * hi:+.2f}] | {'yes' if p.excludes_zero else 'no'} |"
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "fmnist-dir0.2-fedavg")
