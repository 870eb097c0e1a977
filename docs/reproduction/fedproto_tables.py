"""Tables and plots of docs/reproduction/fedproto.md from the run folders of its grid.

    python docs/reproduction/fedproto_tables.py RUNS_DIR   # RUNS_DIR/<config name>[-<tag>]/seed<k>/

Cells are "mean over seeds of the across-client mean ± mean over seeds of the across-client std" (the
paper's ± is across clients), with the std of the mean across seeds in brackets.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from fedskew.experiment.config import load_config
from fedskew.experiment.report import Group, RunResult, plot_accuracy, runs_by_folder
from fedskew.experiment.runner import CHECKPOINT_FILE, CONFIG_FILE, build_simulation

METHODS = [
    ("Local", "mnist-n{n}-local"),
    ("FedAvg", "mnist-n{n}-fedavg"),
    ("FedProx", "mnist-n{n}-fedprox"),
    ("FedPer", "mnist-n{n}-fedper"),
    ("FedRep", "mnist-n{n}-fedrep"),
    ("FedProto", "mnist-n{n}"),
    ("FedProto-mh", "mnist-mh-n{n}"),
]


def cell(runs: list, key: str = "accuracy") -> str:
    if not runs:
        return "—"
    acc = np.array([r.summary["final"][key] for r in runs]) * 100
    std = np.array([r.summary["final"][key + "_std"] for r in runs]) * 100
    seeds = f" [{acc.std(ddof=1):.2f}]" if len(runs) > 1 else ""
    return f"{acc.mean():.2f} ± {std.mean():.2f}{seeds} ({len(runs)})"


def client_accuracies(run: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """Final per-client accuracies and test-set sizes, re-evaluated from the run's final checkpoint."""
    sim = build_simulation(load_config(run.path / CONFIG_FILE))
    sim.load_state_dict(torch.load(run.path / CHECKPOINT_FILE, map_location="cpu", weights_only=False))
    record = sim.evaluate()
    sizes = np.array([len(i) for i in sim.test_idx])
    return np.array(record["accuracy_clients"]), sizes


def code_cumulative(acc: np.ndarray, sizes: np.ndarray) -> tuple[float, float]:
    """Mean and std as the authors' evaluation prints them: its counters are never reset, so client i's
    "accuracy" is the running accuracy over clients 0..i."""
    running = np.cumsum(acc * sizes) / np.cumsum(sizes)
    return float(running.mean()), float(running.std())


def main(root: Path) -> None:
    runs = runs_by_folder(root)
    print("| Method | n = 3 | n = 4 | n = 5 | rounds | params up / round |")
    print("|---|---|---|---|---|---|")
    for label, pattern in METHODS:
        cells = [cell(runs.get(pattern.format(n=n), [])) for n in (3, 4, 5)]
        any_runs = [r for n in (3, 4, 5) for r in runs.get(pattern.format(n=n), [])]
        rounds = any_runs[0].summary["rounds"] if any_runs else "—"
        params = [r.metrics[-1]["round_params_up"] for r in any_runs if r.metrics]
        p = f"{np.mean(params):,.0f}" if params else "—"
        print(f"| {label} | {' | '.join(cells)} | {rounds} | {p} |")
    print("\nClassifier head (accuracy_logits) of FedProto:")
    for label, pattern in METHODS[-2:]:
        cells = [cell(runs.get(pattern.format(n=n), []), "accuracy_logits") for n in (3, 4, 5)]
        print(f"| {label} (classifier) | " + " | ".join(cells) + " |")
    print("\nλ sweep (MNIST n = 3, seed 1234):")
    print("| λ | nearest-prototype acc | classifier acc | proto_distance (final) |")
    print("|---|---|---|---|")
    sweep = {name: rs for name, rs in runs.items() if name.startswith("mnist-n3-lam")}
    sweep["mnist-n3-lam1"] = [r for r in runs.get("mnist-n3", []) if r.config["seed"] == 1234]
    for name in sorted(sweep, key=lambda s: float(s.removeprefix("mnist-n3-lam"))):
        for r in sweep[name]:
            f = r.summary["final"]
            lam = name.removeprefix("mnist-n3-lam")
            print(
                f"| {lam} | {100 * f['accuracy']:.2f} ± {100 * f['accuracy_std']:.2f} "
                f"| {100 * f['accuracy_logits']:.2f} ± {100 * f['accuracy_logits_std']:.2f} "
                f"| {r.metrics[-1]['proto_distance']:.4f} |"
            )
    print("\nAcross-client std: correct per-client evaluation vs the code's cumulative counters (seed 1234):")
    print("| Method | mean | std over clients | worst client | mean, code-style | std, code-style |")
    print("|---|---|---|---|---|---|")
    for label, pattern in METHODS:
        for r in runs.get(pattern.format(n=3), []):
            if r.config["seed"] == 1234 and (r.path / CHECKPOINT_FILE).is_file():
                acc, sizes = client_accuracies(r)
                cm, cs = code_cumulative(acc, sizes)
                print(
                    f"| {label} | {100 * acc.mean():.2f} | {100 * acc.std():.2f} | {100 * acc.min():.2f} "
                    f"| {100 * cm:.2f} | {100 * cs:.2f} |"
                )
    groups = []
    for label, pattern in METHODS:
        rs = runs.get(pattern.format(n=3), [])
        if rs:
            groups.append(Group(label, rs))
    img = Path(__file__).parent / "img" / "fedproto_mnist_n3.png"
    title = "MNIST n=3 (Stdev 2, k=100, 20 clients): personalized test accuracy, mean over seeds"
    plot_accuracy(groups, img, title)
    print(f"\nplot: {img}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
