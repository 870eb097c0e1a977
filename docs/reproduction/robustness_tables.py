"""The tables of docs/reproduction/robustness.md from the sweeps' result folders (commands in that file).

    python docs/reproduction/robustness_tables.py RUNS      # RUNS: the --out root of the sweeps (runs/)

Each table is `fedskew report`'s, with seed-paired 95% t-intervals against the named baseline group.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from fedskew.errors import FedskewError
from fedskew.experiment.reporting import ReportRequest, make_report

#: (heading, sweep folders under RUNS, columns, paired baseline: a part of the group's label)
TABLES = [
    ("IID, 30% sign flipping (scale 1) against the clean run", ["robust/clean", "robust/fmnist-signflip"],
     "accuracy,loss", "attack.name=none"),
    ("IID, 30% sign flipping (scale 1) against FedAvg's mean under the attack", ["robust/fmnist-signflip"],
     "accuracy", "defence.name=mean"),
    ("IID, 30% sign flipping (scale 4) against the clean run", ["robust/clean", "robust/scale4"],
     "accuracy,loss", "attack.name=none"),
    ("Dirichlet(0.3), 30% sign flipping (scale 1) against the clean run",
     ["robust-dir/clean-dir0.3", "robust-dir/dir0.3"], "accuracy", "attack.name=none"),
    ("Dirichlet(0.3), 30% sign flipping (scale 1) against FedAvg's mean under the attack",
     ["robust-dir/dir0.3"], "accuracy", "defence.name=mean"),
    ("Backdoor (target 0), 10% and 30% malicious: clean accuracy and attack success rate", ["backdoor"],
     "accuracy,attack_success_rate", None),
    ("DP-FedAvg (fixed-size sample, replace-one, calibrated with RDP): accuracy against ε (δ = 1e-5) and "
     "the non-private run", ["dp/fmnist-dp", "dp/nonprivate"], "accuracy,epsilon_rdp", "nonprivate"),
    ("DP-FedAvg (Poisson sample, add/remove, calibrated with PLD): accuracy against ε (δ = 1e-5) and the "
     "non-private run", ["dp/poisson", "dp/nonprivate"], "accuracy,epsilon_rdp,epsilon_pld", "nonprivate"),
]  # fmt: skip


def main(root: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for heading, folders, metrics, paired in TABLES:
            dirs = [root / f for f in folders]
            if not all(d.is_dir() for d in dirs):
                continue
            req = ReportRequest(dirs, metrics=metrics, paired=paired, plot=Path(tmp) / "p.png")
            try:
                print(f"### {heading}\n\n{make_report(req).text}")
            except FedskewError as err:  # a sweep not (yet) complete
                print(f"### {heading}\n\n(not available: {err})\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs"))
