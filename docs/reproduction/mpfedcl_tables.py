"""Tables and plots of docs/reproduction/mpfedcl.md from the run folders of its grid.

    python docs/reproduction/mpfedcl_tables.py RUNS_DIR   # RUNS_DIR/<config name>[-<tag>]/seed<k>/

MP-FedCL reports the client-averaged accuracy on local test sets, mean (std) over 3 seeds (here the
sample std over seeds). A cell is "mean (std over seeds)", with the mean over seeds of the across-client std
after a "±" where it helps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from fedskew.experiment.config import build_config, load_config
from fedskew.experiment.report import Group, RunResult, plot_accuracy, runs_by_folder
from fedskew.experiment.runner import CHECKPOINT_FILE, CONFIG_FILE, build_simulation

IMG = Path(__file__).parent / "img"
TABLE_VI = [
    ("FedAvg", "-fedavg", 66.40),
    ("FedProx", "-fedprox", 64.85),
    ("FedProto", "-fedproto", 33.27),
    ("DP-FedCL", "-dpfedcl", 78.49),
    ("SP-FedCL", "-spfedcl", 79.44),
    ("MP-FedCL", "-mpfedcl", 79.95),
    ("Local", "-local", None),
]
DOMAINS = ["mnist", "usps_like", "synth_digits", "mnist_m"]


def acc(runs: list[RunResult], key: str = "accuracy") -> np.ndarray:
    return np.array([100 * r.summary["final"][key] for r in runs if key in r.summary["final"]])


def cell(runs: list[RunResult], key: str = "accuracy") -> str:
    a = acc(runs, key)
    if a.size == 0:
        return "—"
    return f"{a.mean():.2f} ({a.std(ddof=1):.2f})" if a.size > 1 else f"{a.mean():.2f}"


def client_std(runs: list[RunResult]) -> str:
    return f"{np.mean([100 * r.summary['final']['accuracy_std'] for r in runs]):.2f}"


def global_accuracy(run: RunResult) -> float:
    """The run's final checkpoint re-evaluated on the whole, balanced MNIST test set with the global model
    (and, for the prototype methods, the final pool): the question is which test protocol the paper used."""
    raw = load_config(run.path / CONFIG_FILE).model_dump()
    raw["eval"]["protocol"] = "global"
    sim = build_simulation(build_config(raw))
    sim.load_state_dict(torch.load(run.path / CHECKPOINT_FILE, map_location="cpu", weights_only=False))
    return 100 * float(sim.evaluate()["accuracy"])


def table_vi(runs: dict[str, list[RunResult]]) -> None:
    print(
        "| Method | ours, local test sets | ± across clients | classifier head | paper (Table VI) "
        "| ours − paper | balanced test set, global model | rounds | floats up / client / round |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, suffix, paper in TABLE_VI:
        rs = runs.get("mnist-dir0.05" + suffix, [])
        if not rs:
            continue
        mean = acc(rs).mean()
        diff = f"{mean - paper:+.2f}" if paper is not None else "—"
        balanced = "—"
        if suffix not in ("-fedproto", "-local") and all((r.path / CHECKPOINT_FILE).is_file() for r in rs):
            g = np.array([global_accuracy(r) for r in rs])
            balanced = f"{g.mean():.2f} ({g.std(ddof=1):.2f})" if g.size > 1 else f"{g.mean():.2f}"
        up = np.mean([r.metrics[-1]["round_params_up"] for r in rs]) / rs[0].config["data"]["num_clients"]
        print(
            f"| {label} | {cell(rs)} | {client_std(rs)} | {cell(rs, 'accuracy_logits')} "
            f"| {paper if paper is not None else '—'} | {diff} | {balanced} | {rs[0].summary['rounds']} "
            f"| {up:,.0f} |"
        )


def prototype_floats(runs: dict[str, list[RunResult]]) -> None:
    print(
        "| Method | prototypes per (client, class held) | prototype floats up / client / round | Table II |"
    )
    print("|---|---|---|---|")
    for label, suffix in [
        ("MP-FedCL (K = 2)", "-mpfedcl"),
        ("SP-FedCL", "-spfedcl"),
        ("DP-FedCL", "-dpfedcl"),
    ]:
        rs = runs.get("mnist-dir0.05" + suffix, [])
        if not rs:
            continue
        per = np.mean([r.metrics[-1]["protos_per_client_class"] for r in rs])
        n = rs[0].config["data"]["num_clients"]
        floats = np.mean([r.metrics[-1]["pool_size"] for r in rs]) * 256 / n
        print(f"| {label} | {per:.2f} | {floats:,.0f} | {'5,120' if 'mp' in suffix else '—'} |")


ABLATIONS = [
    ("MP-FedCL default (own-class P(y), batch mean, normalised embeddings, local weights)", "mpfedcl"),
    ("`normalize: false`: raw ReLU embeddings (literal)", "mpfedcl-rawemb"),
    ("`eval_weights: global`: test with the global model", "mpfedcl-globalw"),
    ("`reduction: sum`: Eq. 11's sum over the batch (literal)", "mpfedcl-sum"),
    ("`positives: others`: P(y) = labels other than y (literal)", "mpfedcl-others"),
    ("SP-FedCL with `positives: others` (literal P(y))", "spfedcl-others"),
    ("`weight: 0`: no L_R (FedAvg + prototype inference)", "mpfedcl-nolr"),
]


def ablations(runs: dict[str, list[RunResult]]) -> None:
    print("| Variant | seed 0 | classifier head, seed 0 | 3 seeds (where run) |")
    print("|---|---|---|---|")
    for label, name in ABLATIONS:
        rs = runs.get("mnist-dir0.05-" + name, [])
        seed0 = [r for r in rs if r.config["seed"] == 0]
        if seed0:
            three = cell(rs) if len(rs) > 1 else "—"
            print(f"| {label} | {cell(seed0)} | {cell(seed0, 'accuracy_logits')} | {three} |")


def sweep(
    runs: dict[str, list[RunResult]], title: str, rows: list[tuple[str, str]], methods: list[str]
) -> None:
    print(f"\n{title}")
    print("| | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for label, pattern in rows:
        cells = [cell(runs.get(pattern.format(m=m), [])) for m in methods]
        print(f"| {label} | " + " | ".join(cells) + " |")


def digit_domains(runs: dict[str, list[RunResult]]) -> None:
    methods = ["local", "fedavg", "fedprox", "fedproto", "dpfedcl", "spfedcl", "mpfedcl"]
    print("\nDigit domains, feature skew (one domain per client; per-client rows, mean (std) over seeds):")
    print("| Domain | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    per = {m: runs.get(f"digit-domains-feature-{m}", []) for m in methods}
    for i, dom in enumerate(DOMAINS):
        cells = []
        for m in methods:
            a = np.array([100 * r.summary["final"]["accuracy_clients"][i] for r in per[m]])
            cells.append("—" if a.size == 0 else f"{a.mean():.2f} ({a.std(ddof=1) if a.size > 1 else 0:.2f})")
        print(f"| {dom} | " + " | ".join(cells) + " |")
    print("| **Average** | " + " | ".join(cell(per[m]) for m in methods) + " |")
    print("\nDigit domains, label skew Dir(0.5) in mnist_m:")
    print("| | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    print(
        "| accuracy | " + " | ".join(cell(runs.get(f"digit-domains-dir0.5-{m}", [])) for m in methods) + " |"
    )


def main(root: Path) -> None:
    runs = runs_by_folder(root)
    print("Table VI, MNIST column (Dir(0.05), 5 clients, 2,000 images):")
    table_vi(runs)
    print("\nCommunication (Table II):")
    prototype_floats(runs)
    print("\nAblations (MNIST Dir(0.05); seed 0 unless 3 seeds are shown):")
    ablations(runs)
    k_rows = [(f"K = {k}", "mnist-dir0.05-mpfedcl" + ("" if k == 2 else f"-k{k}")) for k in range(1, 6)]
    sweep(runs, "K sweep (Fig. 5; MNIST Dir(0.05)):", [(lab, pat) for lab, pat in k_rows], ["mpfedcl"])
    sweep(
        runs,
        "Clients sweep (Fig. 9a; MNIST Dir(0.1), seed 0):",
        [(f"N = {n}", f"mnist-dir0.1-n{n}-{{m}}") for n in (5, 10, 20, 40)],
        ["fedavg", "fedproto", "mpfedcl"],
    )
    alphas = [
        ("1.0", "mnist-dir1.0-{m}"),
        ("0.5", "mnist-dir0.5-{m}"),
        ("0.2", "mnist-dir0.2-{m}"),
        ("0.1", "mnist-dir0.1-n5-{m}"),
        ("0.05", "mnist-dir0.05-{m}"),
    ]
    sweep(
        runs,
        "α sweep (Fig. 8 protocol on MNIST, seed 0 except α = 0.05: 3 seeds):",
        [(f"α = {a}", p) for a, p in alphas],
        ["fedavg", "fedproto", "spfedcl", "mpfedcl"],
    )
    digit_domains(runs)
    groups = [
        Group(label, runs["mnist-dir0.05" + s]) for label, s, _ in TABLE_VI if "mnist-dir0.05" + s in runs
    ]
    plot_accuracy(
        groups, IMG / "mpfedcl_mnist.png", "MNIST Dir(0.05), 5 clients: local test accuracy (3 seeds)"
    )
    print(f"\nplot: {IMG / 'mpfedcl_mnist.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
