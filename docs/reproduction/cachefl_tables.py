"""Tables and the K plot of docs/reproduction/cachefl.md from the run folders of its sweeps.

    python docs/reproduction/cachefl_tables.py RUNS_DIR [DLG_JSON ...]

``RUNS_DIR/main/<stem>/seed<k>/`` (zero-shot, w.o. Training), ``RUNS_DIR/lr/<stem>-lr<lr>-b<B>/seed<k>/``
(the lr × batch candidates of every trained method), ``RUNS_DIR/adamw/…`` (the AdamW + cosine deviation,
same layout), ``RUNS_DIR/posthoc/<run name>/seed<k>.json`` (``fedskew cachefl-posthoc``: head
hyper-parameters re-chosen on validation after training), ``RUNS_DIR/k/<stem>-k<K>/seed<k>/`` (Fig. 7).

Protocol, the same for every trained method: the candidate (lr, batch) with the highest mean final-round
**validation** accuracy of seed 0 is chosen per partition (ties: the smaller lr, then batch 32); the
table reports its final-round **test** accuracy over every seed run (0–4), mean ± sample std. Paired
differences are per seed (same shots, validation digits and synthetic set), with 95% t-intervals.
"""

from __future__ import annotations

import itertools
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
SELECTION_SEEDS = {0}
Cell = dict[int, float]  # seed -> final-round test accuracy (%)


def acc(r: RunResult, key: str = "accuracy") -> float:
    return 100 * float(r.summary["final"][key])


def by_seed(rs: list[RunResult], key: str = "accuracy") -> Cell:
    return {int(r.config["seed"]): acc(r, key) for r in rs}


def cell(c: Cell) -> str:
    v = np.array(list(c.values()))
    if len(v) == 0:
        return "—"
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f} ({len(v)})" if len(v) > 1 else f"{v.mean():.2f} (1)"


def interval(d: np.ndarray) -> str:
    if len(d) < 2:
        return "—"
    half = scipy.stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return f"{d.mean():+.2f} [{d.mean() - half:+.2f}, {d.mean() + half:+.2f}] ({len(d)})"


def paired(a: Cell, b: Cell) -> str:
    """Mean difference a − b over shared seeds and its 95% t-interval, in points."""
    return interval(np.array([a[s] - b[s] for s in sorted(a.keys() & b.keys())]))


def candidates(lr: dict[str, list[RunResult]], stem: str) -> dict[tuple[float, int], list[RunResult]]:
    out = {}
    for name, rs in lr.items():
        m = re.fullmatch(rf"{re.escape(stem)}-lr([0-9.e-]+)-b(\d+)", name)
        if m:
            out[(float(m.group(1)), int(m.group(2)))] = rs
    return out


def val_score(rs: list[RunResult]) -> float:
    vals = [acc(r, "val_accuracy") for r in rs if r.config["seed"] in SELECTION_SEEDS]
    return float(np.mean(vals)) if vals else float("-inf")


def chosen(lr: dict[str, list[RunResult]], stem: str) -> tuple[tuple[float, int], list[RunResult]] | None:
    cands = candidates(lr, stem)
    if not cands:
        return None
    best = max(cands, key=lambda k: (val_score(cands[k]), -k[0], k[1]))
    return best, cands[best]


def posthoc(root: Path, name: str) -> tuple[Cell, list[dict]]:
    files = sorted((root / "posthoc" / name).glob("seed*.json"))
    found = [json.loads(f.read_text()) for f in files]
    return {int(d["seed"]): 100 * d["accuracy"] for d in found}, [d["choice"] for d in found]


METHODS = [  # (label, stem suffix, which runs)
    ("Zero-shot (prototype head)", "-zeroshot", "main"),
    ("w.o. Training (initial cache)", "-notrain", "main"),
    ("CacheFL, paper-literal (lr 1e-3, batch 32)", "", "literal"),
    ("CacheFL, lr/batch chosen on validation", "", "chosen"),
    ("CacheFL, + α/β re-chosen on validation after training", "", "posthoc"),
    ("CacheFL, AdamW + cosine (deviation), chosen", "", "adamw"),
    ("AdapterFL, paper-literal", "-adapterfl", "literal"),
    ("AdapterFL, lr/batch chosen on validation", "-adapterfl", "chosen"),
    ("AdapterFL, + ρ re-chosen on validation after training", "-adapterfl", "posthoc"),
    ("AdapterFL, AdamW + cosine (deviation), chosen", "-adapterfl", "adamw"),
    ("FedAvg from scratch, paper-literal", "-fedavg", "literal"),
    ("FedAvg from scratch, chosen", "-fedavg", "chosen"),
    ("FedProx from scratch, paper-literal", "-fedprox", "literal"),
    ("FedProx from scratch, chosen", "-fedprox", "chosen"),
]


def table_cells(root: Path, runs: dict[str, dict], part: str) -> dict[str, Cell]:
    out: dict[str, Cell] = {}
    for label, suffix, kind in METHODS:
        stem = f"mnist-{part}{suffix}"
        if kind == "main":
            out[label] = by_seed(runs["main"].get(stem, []))
        elif kind == "literal":
            out[label] = by_seed(candidates(runs["lr"], stem).get((0.001, 32), []))
        elif kind in ("chosen", "adamw"):
            pick = chosen(runs["lr" if kind == "chosen" else "adamw"], stem)
            out[label] = by_seed(pick[1]) if pick else {}
        else:
            pick = chosen(runs["lr"], stem)
            out[label] = posthoc(root, pick[1][0].path.parent.name)[0] if pick else {}
    return out


PAIRS = [
    ("CacheFL (chosen) − zero-shot", "CacheFL, lr/batch chosen on validation", "Zero-shot (prototype head)"),
    ("CacheFL (chosen) − w.o. Training", "CacheFL, lr/batch chosen on validation",
     "w.o. Training (initial cache)"),
    ("CacheFL (chosen) − AdapterFL (chosen)", "CacheFL, lr/batch chosen on validation",
     "AdapterFL, lr/batch chosen on validation"),
    ("CacheFL (+α/β) − AdapterFL (+ρ)", "CacheFL, + α/β re-chosen on validation after training",
     "AdapterFL, + ρ re-chosen on validation after training"),
    ("CacheFL (chosen) − FedAvg (chosen)", "CacheFL, lr/batch chosen on validation",
     "FedAvg from scratch, chosen"),
    ("CacheFL (chosen) − FedProx (chosen)", "CacheFL, lr/batch chosen on validation",
     "FedProx from scratch, chosen"),
    ("CacheFL (+α/β) − CacheFL (chosen)", "CacheFL, + α/β re-chosen on validation after training",
     "CacheFL, lr/batch chosen on validation"),
    ("CacheFL (literal) − zero-shot", "CacheFL, paper-literal (lr 1e-3, batch 32)",
     "Zero-shot (prototype head)"),
    ("AdapterFL (literal) − zero-shot", "AdapterFL, paper-literal", "Zero-shot (prototype head)"),
    ("AdapterFL (chosen) − zero-shot", "AdapterFL, lr/batch chosen on validation",
     "Zero-shot (prototype head)"),
    ("w.o. Training − zero-shot", "w.o. Training (initial cache)", "Zero-shot (prototype head)"),
    ("CacheFL AdamW+cosine − CacheFL SGD (both chosen)", "CacheFL, AdamW + cosine (deviation), chosen",
     "CacheFL, lr/batch chosen on validation"),
]  # fmt: skip


def header(first: str) -> str:
    return f"| {first} | " + " | ".join(PARTITIONS) + " |\n|---|" + "---|" * len(PARTITIONS)


def main_table(root: Path, runs: dict[str, dict]) -> dict[str, dict[str, Cell]]:
    table = {p: table_cells(root, runs, p) for p in PARTITIONS}
    print(header("Method"))
    for label, _, _ in METHODS:
        print(f"| {label} | " + " | ".join(cell(table[p][label]) for p in PARTITIONS) + " |")
    print("\nPaired differences (points, mean [95% t-interval] (seeds)):\n")
    print(header("Difference"))
    for name, a, b in PAIRS:
        print(f"| {name} | " + " | ".join(paired(table[p][a], table[p][b]) for p in PARTITIONS) + " |")
    chosen_cf = "CacheFL, lr/batch chosen on validation"
    print("\nPartition effect, CacheFL (chosen), paired by seed:\n")
    for a, b in (("iid", "dir"), ("dir", "pat"), ("iid", "pat")):
        print(f"- {a} − {b}: {paired(table[a][chosen_cf], table[b][chosen_cf])}")
    return table


def selection_table(runs: dict[str, dict], root: Path) -> None:
    print("\nCandidates (validation: seed 0; test: every seed; ✓ chosen):\n")
    print("| Method | Partition | lr | batch | validation acc. | test acc. | chosen |")
    print("|---|---|---|---|---|---|---|")
    for kind, suffixes in (("lr", ["", "-adapterfl", "-fedavg", "-fedprox"]), ("adamw", ["", "-adapterfl"])):
        for suffix in suffixes:
            for p in PARTITIONS:
                stem = f"mnist-{p}{suffix}"
                pick = chosen(runs[kind], stem)
                for (rate, bs), rs in sorted(candidates(runs[kind], stem).items(), key=lambda kv: kv[0]):
                    mark = "**✓**" if pick and pick[0] == (rate, bs) else ""
                    val = {s: v for s, v in by_seed(rs, "val_accuracy").items() if s in SELECTION_SEEDS}
                    name = (stem.removeprefix(f"mnist-{p}").lstrip("-") or "cachefl") + (
                        " (AdamW+cos)" if kind == "adamw" else ""
                    )
                    print(f"| {name} | {p} | {rate:g} | {bs} | {cell(val)} | {cell(by_seed(rs))} | {mark} |")
    print("\nHead hyper-parameters re-chosen after training (per seed, on its validation digits):\n")
    for suffix in ("", "-adapterfl"):
        for p in PARTITIONS:
            pick = chosen(runs["lr"], f"mnist-{p}{suffix}")
            if pick:
                _, choices = posthoc(root, pick[1][0].path.parent.name)
                print(f"- {(suffix.lstrip('-') or 'cachefl')} {p}: {choices}")


def drift_table(runs: dict[str, dict]) -> None:
    print("\nKeys' relative drift ‖W1 − W1⁰‖/‖W1⁰‖ after the last round (CacheFL):\n")
    print(header("Run"))
    for label, pick_of in (
        ("paper-literal", lambda stem: candidates(runs["lr"], stem).get((0.001, 32))),
        ("chosen", lambda stem: (chosen(runs["lr"], stem) or (None, None))[1]),
    ):
        cells = []
        for p in PARTITIONS:
            rs = pick_of(f"mnist-{p}") or []
            d = np.array([r.metrics[-1]["keys_drift"] for r in rs if "keys_drift" in r.metrics[-1]])
            cells.append(f"{d.mean():.4f} ± {d.std(ddof=1):.4f}" if len(d) > 1 else "—")
        print(f"| {label} | " + " | ".join(cells) + " |")


def k_sweep(k: dict[str, list[RunResult]]) -> None:
    series: dict[str, dict[int, Cell]] = {}
    for name, rs in k.items():
        m = re.fullmatch(r"mnist-iid(-notrain)?-k(\d+)", name)
        if m:
            series.setdefault("w.o. Training" if m.group(1) else "CacheFL", {})[int(m.group(2))] = by_seed(rs)
    if not series:
        return
    ks = sorted({kk for s in series.values() for kk in s})
    print("\n| K (synthetic images per class) | " + " | ".join(map(str, ks)) + " |\n|---|" + "---|" * len(ks))
    for name, s in sorted(series.items()):
        print(f"| {name} | " + " | ".join(cell(s.get(kk, {})) for kk in ks) + " |")
    cf = series.get("CacheFL", {})
    print("\nCacheFL gain per doubling of K, and the change of that gain (paired by seed):\n")
    steps = list(itertools.pairwise(ks))
    gains = {b: {s: cf[b][s] - cf[a][s] for s in cf[a].keys() & cf[b].keys()} for a, b in steps}
    for a, b in steps:
        print(f"- K {a} → {b}: {interval(np.array(list(gains[b].values())))}")
    for (a, b), (_, c) in itertools.pairwise(steps):
        print(f"- gain({b}→{c}) − gain({a}→{b}): {paired(gains[c], gains[b])}")
    plot_k(series, ks)


def plot_k(series: dict[str, dict[int, Cell]], ks: list[int]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 3.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, s in sorted(series.items()):
        xs = sorted(s)
        vals = [np.array(list(s[x].values())) for x in xs]
        ax.errorbar(xs, [v.mean() for v in vals], yerr=[v.std(ddof=1) if len(v) > 1 else 0 for v in vals],
                    marker="o", capsize=3, label=name)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(x) for x in ks])
    ax.set_xlabel("K: synthetic (font-rendered) images per class")
    ax.set_ylabel("MNIST test accuracy (%)")
    ax.set_title("CacheFL Fig. 7 offline: iid, final round, ±1 sd over seeds", fontsize=9)
    ax.legend(fontsize=8)
    IMG.mkdir(exist_ok=True)
    fig.savefig(IMG / "cachefl_k.png")


def communication(runs: dict[str, dict]) -> None:
    print("\n| Method | parameters up / client / round | bytes up / round (10 clients) |\n|---|---|---|")
    for label, stem in (("CacheFL (W1)", "mnist-iid"), ("AdapterFL", "mnist-iid-adapterfl"),
                        ("FedAvg (cnn_mnist)", "mnist-iid-fedavg")):  # fmt: skip
        rs = candidates(runs["lr"], stem).get((0.001, 32), [])
        if rs:
            last = rs[0].metrics[-1]
            up = last["bytes_up"] / last["round"]
            print(f"| {label} | {up / 10 / 4:,.0f} | {up:,.0f} |")


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
    runs = {sub: load(root / sub) for sub in ("main", "lr", "adamw", "k")}
    main_table(root, runs)
    selection_table(runs, root)
    drift_table(runs)
    k_sweep(runs["k"])
    communication(runs)
    for path in sys.argv[2:]:  # DLG results of docs/reproduction/cachefl_privacy.py --json
        dlg_table(Path(path))


if __name__ == "__main__":
    main()
