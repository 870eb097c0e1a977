"""The fairness of the global model across clients, against a baseline (global.md, q-FedAvg's claim).

    python docs/reproduction/fairness_tables.py RUNS BASELINE

``RUNS``: one sweep folder whose groups (``RUNS/<name>/seed<k>``) ran with ``eval.protocol: personalized`` and
``data.test: {}``: a method without personal models is then scored as a global model on each client's own
test split (drawn like its training data), which is q-FFL's notion of fairness: the spread of the one model's
accuracy over the clients. Per group: the mean client accuracy, the std of the clients' accuracies and the
mean of the worst 10% of clients (each mean ± sample std over seeds), and the seed-paired differences to
``BASELINE`` with 95% t-intervals (``*``: excludes 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

from global_tables import cell, paired, paired_text

from fedskew.experiment.report import Group, runs_by_folder

KEYS = {"accuracy": "client mean", "accuracy_std": "client std", "accuracy_worst10": "worst 10%"}


def table(root: Path, baseline: str) -> str:
    groups = {n: Group(n, runs) for n, runs in sorted(runs_by_folder(root).items())}
    head = ["method", *(f"{v} (%)" for v in KEYS.values())]
    head += [f"{v} − {baseline} (pp)" for v in KEYS.values()]
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, group in groups.items():
        cells = [name, *(cell(group, k) for k in KEYS)]
        same = name == baseline
        cells += ["—" if same else paired_text(paired(group, groups[baseline], k)) for k in KEYS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(table(Path(sys.argv[1]), sys.argv[2]))
