"""FedNova's mixing weights on the reporting seeds of a sweep (global.md, "Section 3 re-run", quantity skew).

    python docs/reproduction/fednova_weights.py REPORT_DIR   # REPORT_DIR/fednova/seed<k>/

FedNova's server step is x + τ_eff Σ p_i (y_i − x)/‖a_i‖₁ (Wang et al. 2020, § "Proposed method:
FedNova"; src/fedskew/algorithms/fednova.py). Per seed this prints the clients' training sizes,
τ_eff = Σ p_i ‖a_i‖₁ recomputed from the partition (local steps by the engine's own batching rule)
beside the value the run logged (``metrics.jsonl``), the sum of the weights τ_eff·p_i/‖a_i‖₁ (1 when
every client runs the same number of steps, when FedNova is FedAvg) and the final test accuracy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedskew.algorithms.batching import batches_per_epoch
from fedskew.algorithms.fednova import normalizer
from fedskew.experiment.build import build_data
from fedskew.experiment.config import load_config


def weights_row(run: Path) -> str:
    cfg = load_config(run / "config.yaml")
    sizes = build_data(cfg).client_sizes.tolist()
    total = sum(sizes)
    norms = [
        normalizer(cfg.client.epochs * batches_per_epoch(n, cfg.client.batch_size), cfg.client.momentum)
        for n in sizes
    ]
    tau = sum(n / total * a for n, a in zip(sizes, norms, strict=True))
    weight_sum = sum(tau * n / total / a for n, a in zip(sizes, norms, strict=True))
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["tau_eff"]
    final = json.loads((run / "summary.json").read_text())["final"]["accuracy"]
    return f"| {run.name} | {sizes} | {tau:.4f} | {logged:.4f} | {weight_sum:.2f} | {100 * final:.1f} |"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print("| seed | client sizes | τ_eff (partition) | τ_eff (logged) | sum of weights | test acc. (%) |")
    print("|---|---|---|---|---|---|")
    for seed_dir in sorted(Path(sys.argv[1]).glob("fednova/seed*")):
        print(weights_row(seed_dir))
