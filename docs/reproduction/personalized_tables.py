"""The tables of docs/reproduction/personalized.md from the sweeps' result folders (commands in that file).

    python docs/reproduction/personalized_tables.py RUNS      # RUNS: the --out root of the sweeps (runs/)

Per method, the learning rate with the best final-round validation accuracy on seed 0 (stage A of the
commands); its final-round personalized test accuracy (each client on its own test split, mean over
clients) over seeds 0-2 (stage B ran seeds 1 and 2 at that rate), mean ± std over seeds, and the
seed-paired differences to FedAvg and to Local with 95% t-intervals.
"""

from __future__ import annotations

import sys
from pathlib import Path

from global_tables import cell, paired_cell, points

from fedskew.experiment.report import Group, values_by_seed


def chosen_on_seed(candidates: list[Group], seed: int = 0) -> Group:
    """The grid point with the best final validation accuracy on ``seed`` (test accuracy never looked at)."""
    return max(candidates, key=lambda g: values_by_seed(g, "val_accuracy").get(seed, float("-inf")))


SETTINGS = [
    ("MNIST, FedProto's n-way k-shot (n = 3, k = 100)", "pers-mnist-nway"),
    ("Fashion-MNIST, FedProto's n-way k-shot (n = 3, k = 100)", "pers-fmnist-nway"),
    ("MNIST, Dirichlet(0.1)", "pers-mnist-dir0.1"),
    ("Fashion-MNIST, Dirichlet(0.1)", "pers-fmnist-dir0.1"),
    (
        "MNIST, Dirichlet(0.1), tested on 40 images of every class a client holds",
        "pers-mnist-dir0.1-perclass40",
    ),
    (
        "Fashion-MNIST, Dirichlet(0.1), tested on 40 images of every class a client holds",
        "pers-fmnist-dir0.1-perclass40",
    ),
]


def table(root: Path) -> str:
    picks = {m: chosen_on_seed(gs) for m, gs in points(root).items()}
    base, local = picks["fedavg"], picks["local"]
    rows = [
        "| method | lr chosen on validation | val acc. (%) | test acc. (%) | − fedavg (pp, 95% CI) "
        "| − local (pp, 95% CI) |",
        "|---|---|---|---|---|---|",
    ]
    order = ["fedavg", "local", *sorted(m for m in picks if m not in ("fedavg", "local"))]
    for m in order:
        g = picks[m]
        lr = g.runs[0].config["client"]["lr"]
        rows.append(
            f"| {m} | {lr} | {cell(g, 'val_accuracy')} | {cell(g)} | {paired_cell(g, base)} "
            f"| {paired_cell(g, local)} |"
        )
    return "\n".join(rows)


def main(root: Path) -> None:
    for heading, folder in SETTINGS:
        if (root / folder).is_dir():
            print(f"### {heading}\n\n{table(root / folder)}\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs"))
