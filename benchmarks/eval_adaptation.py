"""Personalization at evaluation time (issue 53, item 5): the papers' procedure (``fresh``: fine-tune / adapt
the model being evaluated on the client's training data) against fedskew's former one (``stale``: the
fine-tune made in the client's last round, kept in its state), for FedAvg-FT, FedBABU and Per-FedAvg.

digits, 20 clients, Dirichlet(0.3), half of them a round, 20 rounds, the personalized protocol evaluated at
the last round only; seeds 0, 1, 2 (paired: the same partition and training in both procedures, which
differ only in what is scored). Final-round test accuracy, the seed-paired mean difference with its 95%
t-interval, and seconds per run (the stale procedure fine-tunes in every client round, the fresh one at
evaluations only). Fixed hyper-parameters (the methods' defaults): a comparison of two evaluation
procedures of one trained federation, not of methods.

    OMP_NUM_THREADS=1 python benchmarks/eval_adaptation.py
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy import stats

from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment

METHODS = {"fedavg_ft": "eval_finetune", "fedbabu": "eval_finetune", "perfedavg": "eval_adapt"}
SEEDS = (0, 1, 2)


def config(name: str, procedure: str, seed: int) -> dict:
    return {
        "seed": seed,
        "rounds": 20,
        "data": {"dataset": "digits", "num_clients": 20, "partition": {"name": "dirichlet", "alpha": 0.3}},
        "model": {"name": "mlp_mpfedcl"},
        "algorithm": {"name": name, METHODS[name]: procedure},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.5, "fraction": 0.5},
        "eval": {"protocol": "personalized", "every": 20},
    }


def measure(name: str, procedure: str) -> tuple[list[float], float]:
    accuracies, seconds = [], []
    for seed in SEEDS:
        start = time.perf_counter()
        summary = run_experiment(build_config(config(name, procedure, seed)), None)
        seconds.append(time.perf_counter() - start)
        accuracies.append(float(summary["final"]["accuracy"]))
    return accuracies, float(np.mean(seconds))


def main() -> None:
    print("| method | fresh | stale | fresh − stale (95% CI) | s/run fresh | s/run stale |")
    print("|---|---|---|---|---|---|")
    for name in METHODS:
        (fresh, t_fresh), (stale, t_stale) = measure(name, "fresh"), measure(name, "stale")
        diff = np.array(fresh) - np.array(stale)
        half = stats.t.ppf(0.975, len(diff) - 1) * diff.std(ddof=1) / math.sqrt(len(diff))
        print(
            f"| {name} | {np.mean(fresh):.4f} | {np.mean(stale):.4f} | {diff.mean():+.4f} ± {half:.4f} "
            f"| {t_fresh:.1f} | {t_stale:.1f} |"
        )


if __name__ == "__main__":
    main()
