"""Tables and the K plot of docs/reproduction/cachefl.md from the run folders of its sweeps.

    python docs/reproduction/cachefl_tables.py RUNS_DIR [DLG_JSON]

``RUNS_DIR/main/<config stem>/seed<k>/`` (every method of Table 1),
``RUNS_DIR/lr/<stem>-lr<lr>-b<B>/seed<k>/`` (CacheFL's learning-rate / batch-size candidates),
``RUNS_DIR/k/<stem>-k<K>/seed<k>/`` (Fig. 7). A cell is
the mean ± std over seeds of the **final-round** test accuracy; the lr is chosen per partition by the mean
final-round accuracy on the clients' validation digits (never test). Paired differences are per seed, with
95% t-intervals.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import scipy.stats

from fedskew.errors import FedskewError
from fedskew.experiment.report import RunResult, runs_by_folder

IMG = Path(__file__).parent / "img"
PARTITIONS = ["iid", "dir", "pat"]
METHODS = [  # (row label, stem suffix)
    ("Zero-shot (prototype head)", "-zeroshot"),
    ("w.o. Training (initial cache)", "-notrain"),
    ("CacheFL, lr 1e-3 (paper-literal)", ""),
    ("CacheFL, lr chosen on validation", None),
    ("AdapterFL", "-adapterfl"),
    ("FedAvg from scratch", "-fedavg"),
    ("FedProx from scratch", "-fedprox"),
]


def acc(r: RunResult, key: str = "accuracy") -> float:
    return 100 * float(r.summary["final"][key])


def cell(rs: list[RunResult], key: str = "accuracy") -> str:
    if not rs:
        return "—"
    v = np.array([acc(r, key) for r in rs])
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f} ({len(v)})" if len(v) > 1 else f"{v.mean():.2f} (1)"


def paired(a: list[RunResult], b: list[RunResult]) -> str:
    """mean difference a − b over shared seeds and its 95% t-interval, in points."""
    va, vb = ({r.config["seed"]: acc(r) for r in rs} for rs in (a, b))
    d = np.array([va[s] - vb[s] for s in sorted(va.keys() & vb.keys())])
    if len(d) < 2:
        return "—"
    half = scipy.stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return f"{d.mean():+.2f} [{d.mean() - half:+.2f}, {d.mean() + half:+.2f}]"


def lr_candidates(lr: dict[str, list[RunResult]], part: str) -> dict[tuple[float, int], list[RunResult]]:
    out = {}
    for name, rs in lr.items():
        m = re.fullmatch(rf"mnist-{part}-lr([0-9.e-]+)-b(\d+)", name)
        if m:
            out[(float(m.group(1)), int(m.group(2)))] = rs
    return out


def chosen(lr: dict[str, list[RunResult]], part: str) -> tuple[tuple[float, int], list[RunResult]] | None:
    cands = lr_candidates(lr, part)
    if not cands:
        return None
    # ties: the smaller lr, then the paper's batch 32
    best = max(cands, key=lambda k: (np.mean([acc(r, "val_accuracy") for r in cands[k]]), -k[0], k[1]))
    return best, cands[best]


def rows_of(main: dict, lr: dict, part: str) -> dict[str, list[RunResult]]:
    out = {}
    for label, suffix in METHODS:
        if suffix is None:
            pick = chosen(lr, part)
            out[label] = pick[1] if pick else []
        else:
            out[label] = main.get(f"mnist-{part}{suffix}", [])
    return out


def main_table(main: dict, lr: dict) -> None:
    print("| Method | " + " | ".join(PARTITIONS) + " |\n|---|" + "---|" * len(PARTITIONS))
    table = {p: rows_of(main, lr, p) for p in PARTITIONS}
    for label, _ in METHODS:
        print(f"| {label} | " + " | ".join(cell(table[p][label]) for p in PARTITIONS) + " |")
    print("\nPaired differences (points, mean [95% t-interval] over seeds):\n")
    pairs = [
        ("CacheFL (lr chosen) − zero-shot", "CacheFL, lr chosen on validation", "Zero-shot (prototype head)"),
        (
            "CacheFL (lr chosen) − w.o. Training",
            "CacheFL, lr chosen on validation",
            "w.o. Training (initial cache)",
        ),
        ("CacheFL (lr chosen) − FedAvg", "CacheFL, lr chosen on validation", "FedAvg from scratch"),
        ("CacheFL (lr chosen) − AdapterFL", "CacheFL, lr chosen on validation", "AdapterFL"),
        ("CacheFL (lr 1e-3) − zero-shot", "CacheFL, lr 1e-3 (paper-literal)", "Zero-shot (prototype head)"),
        ("CacheFL (lr 1e-3) − FedAvg", "CacheFL, lr 1e-3 (paper-literal)", "FedAvg from scratch"),
    ]
    print("| Difference | " + " | ".join(PARTITIONS) + " |\n|---|" + "---|" * len(PARTITIONS))
    for name, a, b in pairs:
        print(f"| {name} | " + " | ".join(paired(table[p][a], table[p][b]) for p in PARTITIONS) + " |")


def lr_table(lr: dict) -> None:
    print("\n| Partition | lr | batch | validation acc. | test acc. | chosen |\n|---|---|---|---|---|---|")
    for p in PARTITIONS:
        pick = chosen(lr, p)
        for (rate, bs), rs in sorted(lr_candidates(lr, p).items(), key=lambda kv: (-kv[0][1], kv[0][0])):
            mark = "**✓**" if pick and pick[0] == (rate, bs) else ""
            print(f"| {p} | {rate:g} | {bs} | {cell(rs, 'val_accuracy')} | {cell(rs)} | {mark} |")


def k_sweep(k: dict) -> None:
    series: dict[str, dict[int, list[RunResult]]] = {}
    for name, rs in k.items():
        m = re.fullmatch(r"mnist-iid(-notrain)?-k(\d+)", name)
        if m:
            series.setdefault("w.o. Training" if m.group(1) else "CacheFL", {})[int(m.group(2))] = rs
    if not series:
        return
    ks = sorted({kk for s in series.values() for kk in s})
    print("\n| K (synthetic images per class) | " + " | ".join(map(str, ks)) + " |\n|---|" + "---|" * len(ks))
    for name, s in sorted(series.items()):
        print(f"| {name} | " + " | ".join(cell(s.get(kk, [])) for kk in ks) + " |")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 3.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, s in sorted(series.items()):
        xs = sorted(s)
        vals = [np.array([acc(r) for r in s[x]]) for x in xs]
        ax.errorbar(
            xs,
            [v.mean() for v in vals],
            yerr=[v.std(ddof=1) if len(v) > 1 else 0 for v in vals],
            marker="o",
            capsize=3,
            label=name,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(x) for x in ks])
    ax.set_xlabel("K: synthetic (font-rendered) images per class")
    ax.set_ylabel("MNIST test accuracy (%)")
    ax.set_title("CacheFL Fig. 7 offline: iid, final round", fontsize=9)
    ax.legend(fontsize=8)
    IMG.mkdir(exist_ok=True)
    fig.savefig(IMG / "cachefl_k.png")


def per_round_bytes(root: Path, stem: str) -> tuple[float, float] | None:
    """Bytes up and down per round, from the last logged round of seed 0 (finished or not)."""
    path = root / "main" / stem / "seed0" / "metrics.jsonl"
    if not path.is_file() or not path.read_text().strip():
        return None
    last = json.loads(path.read_text().strip().splitlines()[-1])
    return last["bytes_up"] / last["round"], last["bytes_down"] / last["round"]


def communication(root: Path) -> None:
    print(
        "\n| Method | parameters up / client / round | bytes up / round (10 clients) | bytes down / round |"
        "\n|---|---|---|---|"
    )
    per_round = {}
    for label, stem in (
        ("CacheFL (W1)", "mnist-iid"),
        ("AdapterFL", "mnist-iid-adapterfl"),
        ("FedAvg (cnn_mnist)", "mnist-iid-fedavg"),
    ):
        got = per_round_bytes(root, stem)
        if got is None:
            continue
        up, down = got
        per_round[label] = up
        print(f"| {label} | {up / 10 / 4:,.0f} | {up:,.0f} | {down:,.0f} |")
    if "CacheFL (W1)" in per_round and "FedAvg (cnn_mnist)" in per_round:
        ratio = per_round["CacheFL (W1)"] / per_round["FedAvg (cnn_mnist)"]
        print(f"\nCacheFL / FedAvg bytes up per round: {ratio:.4f}")


def dlg_table(path: Path) -> None:
    d = json.loads(path.read_text())
    names = {
        "dlg_lenet": "FedAvg, sigmoid LeNet (DLG's network)",
        "cnn_mnist": "FedAvg, cnn_mnist (the FedAvg config's)",
        "cachefl": "CacheFL, W1 through frozen EfficientNet-Lite0",
    }
    print(f"\nDLG, {d['iterations']} L-BFGS iterations, {d['images']} MNIST test digits, one per attack:\n")
    print(
        "| Gradient observed | parameters | PSNR by iteration (mean, dB) | final PSNR (dB) | labels |"
        "\n|---|---|---|---|---|"
    )
    for key, label in names.items():
        if key in d:
            r = d[key]
            its = ", ".join(f"{k}: {v:.1f}" for k, v in r["psnr_by_iteration"].items())
            print(
                f"| {label} | {r['observed_params']:,} | {its} | {r['psnr_mean']:.2f} ± {r['psnr_std']:.2f} "
                f"| {r['labels_recovered']}/{d['images']} |"
            )


def load(folder: Path) -> dict[str, list[RunResult]]:
    try:
        return runs_by_folder(folder)
    except FedskewError:  # no finished run there (yet)
        return {}


def main() -> None:
    root = Path(sys.argv[1])
    runs, lr, k = (load(root / sub) for sub in ("main", "lr", "k"))
    main_table(runs, lr)
    lr_table(lr)
    k_sweep(k)
    communication(root)
    if len(sys.argv) > 2:
        dlg_table(Path(sys.argv[2]))


if __name__ == "__main__":
    main()
