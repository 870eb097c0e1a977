"""Tables and plots of docs/reproduction/fedent.md from the run folders of its grid.

    python docs/reproduction/fedent_tables.py RUNS_DIR   # RUNS_DIR/<config name>[-<tag>]/seed<k>/

FedEnt's Table III reports the global model's test accuracy, so a cell is the mean ± std over seeds of
the final-round accuracy. Runs cut short (no summary.json) are shown with their last completed round.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fedskew.experiment.report import Group, plot_accuracy, runs_by_folder
from fedskew.experiment.runner import METRICS_FILE

IMG = Path(__file__).parent / "img"
METHODS = [
    ("FedAvg", "-fedavg"),
    ("FedAdam", "-fedadam"),
    ("FedProx", "-fedprox"),
    ("FedDyn", "-feddyn"),
    ("FedEnt", "-fedent"),
]
PAPER_MNIST = {"FedAvg": 85.53, "FedAdam": 94.89, "FedProx": 86.72, "FedDyn": 88.95, "FedEnt": 97.24}
MNIST = "mnist-pathological"
SYMBOL = {"beta": "β", "gamma": "γ"}


def final(r, key: str = "accuracy") -> float:
    return 100 * r.summary["final"][key]


def seeds_cell(runs: list) -> str:
    acc = np.array([final(r) for r in runs])
    spread = f" ± {acc.std(ddof=1):.2f}" if len(runs) > 1 else ""
    return f"{acc.mean():.2f}{spread}"


def rounds_to(r, target: float) -> int | None:
    return next((m["round"] for m in r.metrics if m.get("accuracy", 0) >= target), None)


def partial(root: Path, name: str) -> str:
    """Last completed round of runs that did not finish (the folder has metrics but no summary)."""
    cells = []
    for d in sorted((root / name).glob("seed*")):
        rows = [json.loads(x) for x in (d / METRICS_FILE).read_text().splitlines() if x.strip()]
        evals = [m for m in rows if "accuracy" in m]
        if evals and not (d / "summary.json").is_file():
            cells.append(f"{100 * evals[-1]['accuracy']:.2f} (stopped at round {evals[-1]['round']})")
    return "; ".join(cells) or "—"


def eta_summary(r) -> dict[str, float]:
    """How far the learning rate FedEnt actually used strayed from the configured one, and how often the
    raw closed form was 0, clipped or fell back."""
    lr = r.config["client"]["lr"]
    pre = r.config["algorithm"]["name"]  # fedent / fedcos / fednorm prefix their diagnostics
    ms = [m for m in r.metrics if f"{pre}_eta_median" in m]

    def mean(key: str) -> float:
        return float(np.mean([m.get(f"{pre}_{key}", np.nan) for m in ms]))

    return {
        "eta_lo": min(m[f"{pre}_eta_min"] for m in ms) / lr,
        "eta_hi": max(m[f"{pre}_eta_max"] for m in ms) / lr,
        "median_last": ms[-1][f"{pre}_eta_median"] / lr,
        "raw_zero": mean("eta_raw_zero"),
        "raw_clip": mean("eta_raw_clip"),
        "fallback": mean("fallback"),
        "raw_mean": mean("eta_raw_mean") / lr,
        "phi2_converged": mean("phi2_converged"),
    }


def table_iii(runs: dict[str, list]) -> None:
    print(
        "| Method | ours, final round (3 seeds) | per seed | paper | ours − paper | rounds to 90% "
        "| final loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, suffix in METHODS:
        rs = runs.get(MNIST + suffix, [])
        if not rs:
            continue
        per_seed = ", ".join(f"{final(r):.2f}" for r in rs)
        mean = np.mean([final(r) for r in rs])
        to90 = [rounds_to(r, 0.90) for r in rs]
        to90s = "/".join("—" if t is None else str(t) for t in to90)
        loss = np.mean([r.summary["final"]["loss"] for r in rs])
        print(
            f"| {label} | {seeds_cell(rs)} | {per_seed} | {PAPER_MNIST[label]:.2f} "
            f"| {mean - PAPER_MNIST[label]:+.2f} | {to90s} | {loss:.4f} |"
        )


def fmnist(root: Path, runs: dict[str, list]) -> None:
    print("| Method | α_d = 1.0 | α_d = 0.5 |")
    print("|---|---|---|")
    for label, suffix in METHODS:
        cells = []
        for alpha in ("1.0", "0.5"):
            name = f"fmnist-dir{alpha}{suffix}"
            cells.append(seeds_cell(runs[name]) if name in runs else partial(root, name))
        print(f"| {label} | {' | '.join(cells)} |")


def adaptation(r) -> str:
    """What the method adapted, read off its diagnostics: the learning-rate range (FedEnt, FedNorm) or the
    cosine aggregation weights (FedCos)."""
    name = r.config["algorithm"]["name"]
    if name == "fedcos":
        ms = [m for m in r.metrics if "fedcos_cos_min" in m]
        cos = min(m["fedcos_cos_min"] for m in ms)
        wmax = max(m["fedcos_weight_max"] for m in ms)
        return f"cos ≥ {cos:.4f}; largest weight {wmax:.4f} (uniform 0.05)"
    if name == "fedavg":
        return "η = lr, uniform weights"
    d = eta_summary(r)
    return f"η / lr in {d['eta_lo']:.3f}–{d['eta_hi']:.3f}; raw η = 0 for {100 * d['raw_zero']:.0f}%"


def variants(runs: dict[str, list]) -> None:
    print("| Method (distance metric) | final accuracy (3 seeds) | per seed | what adapted (seed 0) |")
    print("|---|---|---|---|")
    for label, name in [
        ("FedEnt (entropy)", "-fedent"),
        ("FedCos (cosine)", "-fedcos"),
        ("FedNorm (Euclidean)", "-fednorm"),
        ("FedAvg (none)", "-fedavg"),
    ]:
        rs = runs.get(MNIST + name, [])
        if rs:
            per_seed = ", ".join(f"{final(r):.2f}" for r in rs)
            print(f"| {label} | {seeds_cell(rs)} | {per_seed} | {adaptation(rs[0])} |")


def sweep(runs: dict[str, list], param: str, default: str) -> None:
    """One FedEnt hyper-parameter varied at seed 0 (folders ``<setting>-<param><value>``); the main run
    supplies the default value."""
    print(
        f"| {SYMBOL[param]} | final accuracy | final loss | η range / lr "
        "| median η / lr (last round) | raw η = 0 |"
    )
    print("|---|---|---|---|---|---|")
    prefix = f"{MNIST}-{param}"
    values = {name.removeprefix(prefix): rs for name, rs in runs.items() if name.startswith(prefix)}
    values[default] = [r for r in runs.get(MNIST + "-fedent", []) if r.config["seed"] == 0]
    for value in sorted(values, key=float):
        for r in values[value]:
            d = eta_summary(r)
            print(
                f"| {value} | {final(r):.2f} | {r.summary['final']['loss']:.4f} "
                f"| {d['eta_lo']:.3f}–{d['eta_hi']:.3f} | {d['median_last']:.3f} "
                f"| {100 * d['raw_zero']:.0f}% |"
            )


def diagnostics(runs: dict[str, list]) -> None:
    print(
        "| seed | η min / lr | η max / lr | median η / lr, last round | mean raw η / lr | raw η = 0 "
        "| raw η clipped | fallback | φ2 fixed point converged |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs.get(MNIST + "-fedent", []):
        d = eta_summary(r)
        print(
            f"| {r.config['seed']} | {d['eta_lo']:.3f} | {d['eta_hi']:.3f} | {d['median_last']:.3f} "
            f"| {d['raw_mean']:.3f} | {100 * d['raw_zero']:.0f}% | {100 * d['raw_clip']:.0f}% "
            f"| {100 * d['fallback']:.0f}% | {100 * d['phi2_converged']:.0f}% |"
        )


def plot_eta(runs: list, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lr = runs[0].config["client"]["lr"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in runs:
        ms = [m for m in r.metrics if "fedent_eta_median" in m]
        t = [m["round"] for m in ms]
        ax.plot(
            t, [m["fedent_eta_median"] / lr for m in ms], lw=1.4, label=f"median, seed {r.config['seed']}"
        )
        ax.fill_between(
            t, [m["fedent_eta_min"] / lr for m in ms], [m["fedent_eta_max"] / lr for m in ms], alpha=0.15
        )
        bx.plot(t, [100 * m["fedent_eta_raw_zero"] for m in ms], lw=1.2, label=f"seed {r.config['seed']}")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("round")
    ax.set_ylabel("η_i(t) / configured lr (band: min–max)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.set_xlabel("round")
    bx.set_ylabel("participants with raw η = 0 (%)")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle("FedEnt on MNIST pathological: learning rates actually used", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(root: Path) -> None:
    runs = runs_by_folder(root)
    print("Table III, MNIST pathological non-IID (20% of 100 clients, 50 rounds):")
    table_iii(runs)
    print("\nFashion-MNIST, Dirichlet, cnn_mnist (CIFAR10 protocol of Table III; not a paper row; seed 0):")
    fmnist(root, runs)
    print("\nDistance metrics (Fig. 9, MNIST pathological):")
    variants(runs)
    print("\nβ sweep (Fig. 12, MNIST pathological, seed 0):")
    sweep(runs, "beta", "0.99")
    print("\nFedEnt learning-rate diagnostics (MNIST pathological, over all 50 rounds):")
    diagnostics(runs)
    groups = [Group(label, runs[MNIST + s]) for label, s in METHODS if MNIST + s in runs]
    title = "MNIST pathological, 20% of 100 clients (mean ± std over 3 seeds)"
    plot_accuracy(groups, IMG / "fedent_mnist_accuracy.png", title)
    plot_accuracy(
        groups,
        IMG / "fedent_mnist_train_loss.png",
        title,
        key="train_loss",
        ylabel="training loss (mean over participants)",
        scale=1.0,
    )
    plot_eta(runs[MNIST + "-fedent"], IMG / "fedent_mnist_eta.png")
    print(f"\nplots: {IMG}/fedent_mnist_{{accuracy,train_loss,eta}}.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
