"""The fedskew columns of docs/reproduction/pfllib.md from the sweeps of ``pfllib_runs.sh``.

    python docs/reproduction/pfllib_tables.py RUNS   # RUNS: the sweeps' --out (runs/pfllib)

For every ``RUNS/<partition>-<method>/seed<k>`` group: ``accuracy_weighted`` (correct over all the clients'
test samples, PFLlib's "averaged test accuracy") at the final round, and its best round over the run (PFLlib's
statistic: max over evaluated rounds of test accuracy, so selected on the test set), each as mean ± sample std
over seeds, beside PFLlib's published number (www.pfllib.com/benchmark.html = TsingZ0/PFLlib
docs/benchmark.html at commit d832e76: mean ± std of the best round over three trials, 2,000 rounds).
"""

from __future__ import annotations

import sys

import numpy as np

from fedskew.experiment.report import RunResult, runs_by_folder

KEY = "accuracy_weighted"
#: PFLlib's Fashion-MNIST numbers (pathological, practical Dir(0.1)) for the methods fedskew has
PFLLIB = {
    "fedavg": ("80.41 ± 0.08", "85.85 ± 0.19"),
    "fedprox": ("78.08 ± 0.15", "85.63 ± 0.57"),
    "fedgen": ("79.76 ± 0.60", "84.90 ± 0.31"),
    "perfedavg": ("99.18 ± 0.08", "95.10 ± 0.10"),
    "pfedme": ("99.35 ± 0.14", "97.25 ± 0.17"),
    "ditto": ("99.44 ± 0.06", "97.47 ± 0.04"),
    "apfl": ("99.41 ± 0.02", "97.25 ± 0.08"),
    "fedfomo": ("99.46 ± 0.01", "97.21 ± 0.02"),
    "fedala": ("99.57 ± 0.01", "97.66 ± 0.02"),
    "fedper": ("99.47 ± 0.03", "97.44 ± 0.06"),
    "fedrep": ("99.56 ± 0.03", "97.56 ± 0.04"),
    "fedrod": ("99.52 ± 0.05", "97.52 ± 0.04"),
    "fedbabu": ("99.41 ± 0.05", "97.46 ± 0.07"),
    "fedproto": ("99.49 ± 0.04", "97.40 ± 0.02"),
}
PARTS = {"pat": 0, "dir0.1": 1}


def cell(values: list[float]) -> str:
    """Mean ± sample std in %, or the one value of a single seed."""
    a = 100 * np.array(values, dtype=float)
    return f"{a.mean():.2f} ± {a.std(ddof=1):.2f}" if a.size > 1 else f"{a.mean():.2f}"


def best(run: RunResult) -> float:
    return max(float(r[KEY]) for r in run.metrics if r.get(KEY) is not None)


def seconds_per_round(runs: list[RunResult]) -> float:
    """Wall seconds per round (training and evaluation), mean over the runs' rounds."""
    return float(np.mean([float(r["seconds"]) for run in runs for r in run.metrics if "seconds" in r]))


def side(runs: list[RunResult]) -> list[str]:
    """fedskew's cells of one partition: final, best round, rounds × seeds, seconds per round."""
    if not runs:
        return ["not run", "", "", ""]
    final = [float(r.summary["final"][KEY]) for r in runs]
    rounds = ",".join(map(str, sorted({int(r.summary["rounds"]) for r in runs})))
    cells = [cell(final), cell([best(r) for r in runs]), f"{rounds} × {len(runs)}"]
    return [*cells, f"{seconds_per_round(runs):.0f}"]


def main(root: str) -> None:
    """The page's table: per method and partition, PFLlib's number, fedskew's final and best round, the round
    budget and seeds, and the wall seconds per round (one run per core of the 2-core machine)."""
    groups = runs_by_folder(root)
    head = ["method"]
    for part in PARTS:
        head += [f"PFLlib {part}", f"fedskew {part} final", f"fedskew {part} best", "R × seeds", "s / round"]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for method, published in PFLLIB.items():
        cells = [method]
        for part, col in PARTS.items():
            cells += [published[col], *side(groups.get(f"{part}-{method}", []))]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/pfllib")
