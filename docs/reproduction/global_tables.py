"""The tables of docs/reproduction/global.md from the sweeps' result folders (commands in that file).

    python docs/reproduction/global_tables.py RUNS      # RUNS: the --out root of the sweeps (runs/)

Model selection uses validation only: for each method, the grid point (one sweep folder
``<table>/<grid>/seed<k>``) with the highest final-round validation accuracy, averaged over seeds, is
chosen; its final-round **test** accuracy is reported (mean ± sample std over seeds) with the seed-paired
difference to the baseline method's chosen point and the 95% t-interval of that difference. Tables without a
grid (the NIID-Bench settings, run at the benchmark's fixed hyper-parameters) have one point per method.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedskew.experiment.report import Group, Paired, RunResult, find_runs, values_by_seed

#: (heading, folder under RUNS, baseline method)
TABLES = [
    (
        "FedBN's feature shift: one client per digit domain (personalized evaluation)",
        "fedbn-digits",
        "fedavg",
    ),
    ("Fashion-MNIST, Dirichlet(0.1), 20 clients", "global-dir0.1", "fedavg"),
    ("Fashion-MNIST, long tail ρ = 10 then Dirichlet(0.5), 20 clients", "global-longtail", "fedavg"),
]
NIID_SETTINGS = ["c1", "c2", "dir0.5", "iid", "quantity", "noise0.1"]
NIID_LABELS = {
    "c1": "#C=1",
    "c2": "#C=2",
    "dir0.5": "Dir(0.5)",
    "iid": "IID",
    "quantity": "quantity Dir(0.5)",
    "noise0.1": "noise σ=0.1",
}
#: (column, sweep folder under <setting>/): SCAFFOLD twice, with K = local steps (the paper) and with
#: K = FedNova's effective steps under momentum (``algorithm.control_steps=effective``)
NIID_COLUMNS = [
    ("FedAvg", "algorithm.name=fedavg"),
    ("FedProx", "algorithm.name=fedprox"),
    ("SCAFFOLD", "algorithm.name=scaffold"),
    ("SCAFFOLD (eff. K)", "scaffold-effective"),
    ("FedNova", "algorithm.name=fednova"),
]


def points(root: Path) -> dict[str, list[Group]]:
    """``{method: [grid point, ...]}`` under ``root``: each grid point is one folder of seed runs."""
    by_folder: dict[Path, Group] = {}
    for run in find_runs([root]):
        by_folder.setdefault(run.path.parent, Group(run.path.parent.name)).runs.append(run)
    out: dict[str, list[Group]] = {}
    for group in sorted(by_folder.values(), key=lambda g: g.label):
        out.setdefault(group.algorithm, []).append(group)
    return out


def mean_of(group: Group, key: str) -> float:
    return float(np.mean(list(values_by_seed(group, key).values())))


def chosen(candidates: Sequence[Group]) -> Group:
    """The grid point with the best mean final validation accuracy (test accuracy never looked at)."""
    if len(candidates) == 1:
        return candidates[0]
    return max(candidates, key=lambda g: mean_of(g, "val_accuracy"))


def cell(group: Group, key: str = "accuracy") -> str:
    vals = 100 * np.array(list(values_by_seed(group, key).values()))
    return f"{vals.mean():.2f} ± {vals.std(ddof=1):.2f}" if len(vals) > 1 else f"{vals.mean():.2f}"


def paired(group: Group, baseline: Group, key: str = "accuracy") -> Paired:
    """``group`` − ``baseline`` on the seeds both ran (final-round ``key``), seed by seed."""
    base, vals = values_by_seed(baseline, key), values_by_seed(group, key)
    seeds = sorted(base.keys() & vals.keys())
    return Paired(group, {s: vals[s] - base[s] for s in seeds}, 0)


def paired_text(p: Paired) -> str:
    """Mean difference in points with its 95% t-interval; `` *`` where the interval excludes 0."""
    lo, hi = p.interval
    return f"{100 * p.mean:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]{' *' if p.excludes_zero else ''}"


def paired_cell(group: Group, baseline: Group) -> str:
    return "—" if group is baseline else paired_text(paired(group, baseline))


def selection_table(root: Path, baseline: str) -> str:
    by_method = points(root)
    picks = {m: chosen(gs) for m, gs in by_method.items()}
    base = picks[baseline]
    rows = [
        "| method | grid points | chosen on validation | seeds | val acc. (%) | test acc. (%) "
        f"| − {baseline} (pp, 95% CI) |",
        "|---|---|---|---|---|---|---|",
    ]
    order = [baseline, *sorted(m for m in picks if m != baseline)]
    for m in order:
        g = picks[m]
        rows.append(
            f"| {m} | {len(by_method[m])} | {g.label} | {len(g.runs)} | {cell(g, 'val_accuracy')} "
            f"| {cell(g)} | {paired_cell(g, base)} |"
        )
    return "\n".join(rows)


def niid_table(root: Path, dataset: str) -> str:
    names = [c for c, _ in NIID_COLUMNS]
    head = "| setting | " + " | ".join(names) + " | " + " | ".join(f"{c} − FedAvg (pp)" for c in names[1:])
    rows = [head + " |", "|---" * (2 * len(names)) + "|"]
    for setting in NIID_SETTINGS:
        folder = root / f"niid-{dataset}" / setting
        if not folder.is_dir():
            continue
        groups: dict[str, Group] = {}
        for column, sub in NIID_COLUMNS:
            if any((folder / sub).glob("seed*/summary.json")):
                groups[column] = Group(sub, find_runs([folder / sub]))
        cells = [cell(groups[c]) if c in groups else "—" for c in names]
        base = groups.get("FedAvg")
        diffs = [paired_cell(groups[c], base) if c in groups and base else "—" for c in names[1:]]
        rows.append(f"| {NIID_LABELS[setting]} | " + " | ".join(cells + diffs) + " |")
    return "\n".join(rows)


def per_client_table(root: Path) -> str:
    """Per-domain test accuracy (mean over seeds) of each method's chosen point (personalized protocol)."""
    picks = {m: chosen(gs) for m, gs in points(root).items()}
    first: RunResult = next(iter(picks.values())).runs[0]
    domains = first.config["data"]["options"]["domains"]
    rows = ["| method | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
    for m, g in sorted(picks.items()):
        accs = np.array([r.metrics[-1]["accuracy_clients"] for r in g.runs], dtype=float)
        rows.append(f"| {m} | " + " | ".join(f"{100 * a:.1f}" for a in accs.mean(0)) + " |")
    return "\n".join(rows)


def main(root: Path) -> None:
    for heading, folder, baseline in TABLES:
        if (root / folder).is_dir():
            print(f"### {heading}\n\n{selection_table(root / folder, baseline)}\n")
            if folder == "fedbn-digits":
                print(f"Against FedBN:\n\n{selection_table(root / folder, 'fedbn')}\n")
                print(
                    f"Per domain (test accuracy, %, mean over seeds):\n\n{per_client_table(root / folder)}\n"
                )
    for dataset in ("fmnist", "mnist"):
        if (root / f"niid-{dataset}").is_dir():
            print(
                f"### NIID-Bench settings, {dataset} (reduced CPU schedule)\n\n{niid_table(root, dataset)}\n"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs"))
