"""The table and figures of docs/reproduction/system.md from the sweeps of ``system_runs.sh``.

    python docs/reproduction/system_tables.py RUNS [FIGURES]   # RUNS: the sweeps' --out (runs/system)

For every policy (one sweep folder ``RUNS/<policy>/seed<k>``): the global model's test accuracy and the mean
per-class accuracy of the three rarest classes (7, 8, 9) at the virtual-time budget ``T`` (each seed's last
evaluation at or before T; a run that ends before T is an error) and after an equal number of aggregated
client uploads (``UPLOADS``: the first evaluation by which the run has aggregated at least 200, the uploads
of 20 full-wait rounds of m = 10; synchronous runs are evaluated every round and count ``round_uploads``,
the asynchronous ones K per update), as mean ± sample std over seeds, with the seed-paired difference to
full wait and its 95% t-interval. No best-round selection. Also, per seed, the slow clients' share of the
rare classes' training samples (what a policy that leaves slow clients out loses).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.experiment.report import Group, Paired, find_runs, plot_accuracy

BUDGET = 300.0  # virtual seconds
RARE = (7, 8, 9)  # the three rarest classes of the long tail (rho = 10): the slow clients hold them
BASELINE = "full-wait"
UPLOADS = 200  # the aggregated uploads of 20 full-wait rounds of m = 10
#: policy folder -> label
POLICIES = {
    "full-wait": "FedAvg, full wait",
    "deadline": "FedAvg, deadline 10 s",
    "over-selection": "FedAvg, over-selection 1.3",
    "fedbuff": "FedBuff (K = 5, concurrency 10)",
    "fedasync": "FedAsync (α = 0.6, poly a = 0.5, concurrency 10)",
}
#: uploads per server update of the asynchronous rules (their records are evaluated every few updates)
ASYNC_UPLOADS = {"fedbuff": 5, "fedasync": 1}


def groups(root: Path) -> dict[str, Group]:
    out: dict[str, Group] = {}
    for run in find_runs([root]):
        policy = run.path.parent.name
        out.setdefault(policy, Group(POLICIES.get(policy, policy))).runs.append(run)
    return out


def rare(record: dict[str, Any]) -> float:
    return float(np.mean([record["accuracy_classes"][c] for c in RARE]))


def at_time(record_list: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """The last evaluated record with ``virtual_time <= budget`` (a run that never reaches it: its last)."""
    before = [r for r in record_list if r["virtual_time"] <= budget]
    if not before or record_list[-1]["virtual_time"] < budget:
        raise SystemExit(f"a run does not span {budget} s of virtual time: give it more rounds")
    return before[-1]


def cumulative_uploads(policy: str, records: list[dict[str, Any]]) -> list[float]:
    """Aggregated uploads up to each record: K per update for the asynchronous rules (checked on every
    evaluated update: no buffer closed short), the running sum of ``round_uploads`` for the synchronous ones
    (evaluated every round, checked)."""
    if policy in ASYNC_UPLOADS:
        k = ASYNC_UPLOADS[policy]
        if any(r["round_uploads"] != k for r in records):
            raise SystemExit(f"{policy}: a buffer closed short; count its uploads update by update")
        return [float(r["round"] * k) for r in records]
    if [r["round"] for r in records] != list(range(1, len(records) + 1)):
        raise SystemExit(f"{policy}: evaluate every round to count its uploads")
    return list(np.cumsum([r["round_uploads"] for r in records], dtype=float))


def at_uploads(policy: str, records: list[dict[str, Any]], count: int = UPLOADS) -> dict[str, Any]:
    """The first evaluated record by which ``count`` uploads were aggregated."""
    totals = cumulative_uploads(policy, records)
    return next(r for r, n in zip(records, totals, strict=True) if n >= count)


def uploads_by(policy: str, records: list[dict[str, Any]], budget: float) -> float:
    """Client uploads aggregated by virtual time ``budget``."""
    last = at_time(records, budget)
    return cumulative_uploads(policy, records)[records.index(last)]


def per_seed(group: Group, pick: Any, value: Any) -> dict[int, float]:
    return {int(r.config["seed"]): value(pick(r.metrics)) for r in group.runs}


def cell(values: dict[int, float], base: dict[int, float] | None) -> str:
    arr = 100 * np.array(list(values.values()))
    text = f"{arr.mean():.2f} ± {arr.std(ddof=1):.2f}"
    if base is None:
        return text
    diffs = {s: 100 * (values[s] - base[s]) for s in values if s in base}
    paired = Paired(Group(""), diffs, 0)
    lo, hi = paired.interval
    return f"{text} ({paired.mean:+.2f} [{lo:+.2f}, {hi:+.2f}])"


def table(by_policy: dict[str, Group]) -> str:
    rows = [
        "| policy | seeds | acc. at T = 300 s | rare classes at T | uploads by T | acc. at equal uploads "
        "| rare classes at equal uploads | virtual s at equal uploads | staleness (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    columns = {}
    for policy in POLICIES:
        g = by_policy[policy]
        uploads = {int(r.config["seed"]): uploads_by(policy, r.metrics, BUDGET) for r in g.runs}
        columns[policy] = {
            "uploads": {s: v / 100 for s, v in uploads.items()},
            "time_acc": per_seed(g, lambda m: at_time(m, BUDGET), lambda r: r["accuracy"]),
            "time_rare": per_seed(g, lambda m: at_time(m, BUDGET), rare),
            "up_acc": per_seed(g, lambda m, p=policy: at_uploads(p, m), lambda r: r["accuracy"]),
            "up_rare": per_seed(g, lambda m, p=policy: at_uploads(p, m), rare),
            "up_time": per_seed(g, lambda m, p=policy: at_uploads(p, m), lambda r: r["virtual_time"] / 100),
        }
    base = columns[BASELINE]
    for policy, label in POLICIES.items():
        c, g = columns[policy], by_policy[policy]
        ref = None if policy == BASELINE else base
        stale = [r.metrics[-1].get("staleness_mean") for r in g.runs]
        stale_text = "—" if stale[0] is None else f"{np.mean([m for r in g.runs for m in staleness(r)]):.2f}"
        cells = [cell(c[k], ref and base[k]) for k in ("time_acc", "time_rare")]
        cells.append(cell(c["uploads"], None).replace(".00", ""))
        cells += [cell(c[k], ref and base[k]) for k in ("up_acc", "up_rare")]
        cells.append(cell(c["up_time"], None))
        rows.append(f"| {label} | {len(g.runs)} | {' | '.join(cells)} | {stale_text} |")
    return "\n".join(rows)


def staleness(run: Any) -> list[float]:
    return [float(r["staleness_mean"]) for r in run.metrics if r.get("staleness_mean") is not None]


def slow_share(group: Group) -> str:
    """Per seed: the slow clients (mostly rare-class data) and their share of the rare classes' samples,
    from the run's own recorded config (its partition; needs ``$FEDSKEW_DATA``)."""
    from fedskew.engine.clock import mostly_in
    from fedskew.experiment.config import build_config
    from fedskew.experiment.runner import build_data

    rows = ["| seed | slow clients | their share of classes 7-9's training samples |", "|---|---|---|"]
    for run in sorted(group.runs, key=lambda r: int(r.config["seed"])):
        cfg = build_config(run.config)
        counts = build_data(cfg).class_counts().numpy()
        slow = mostly_in(counts.tolist(), cfg.clock.slow_classes if cfg.clock else [])
        share = counts[slow][:, list(RARE)].sum() / counts[:, list(RARE)].sum()
        rows.append(f"| {cfg.seed} | {np.flatnonzero(slow).tolist()} | {100 * share:.0f}% |")
    return "\n".join(rows)


def figures(by_policy: dict[str, Group], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = [by_policy[p] for p in POLICIES]
    plot_accuracy(
        ordered, folder / "system_time.png", "MNIST long tail, slow rare-class clients", x="virtual_time"
    )
    plot_accuracy(ordered[:3], folder / "system_rounds.png", "synchronous policies against rounds")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy, g in zip(POLICIES, ordered, strict=True):
        grid = np.linspace(0, BUDGET, 61)
        curves = []
        for run in g.runs:
            t = np.array([r["virtual_time"] for r in run.metrics])
            v = np.array([rare(r) for r in run.metrics])
            idx = np.searchsorted(t, grid, side="right") - 1
            curves.append(np.where(idx >= 0, v[np.clip(idx, 0, None)], np.nan))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # before a run's first evaluation: no value yet
            ax.plot(grid, 100 * np.nanmean(curves, 0), label=POLICIES[policy], lw=1.6)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("accuracy on classes 7-9 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "system_rare.png", dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    root = Path(argv[0]) if argv else Path("runs/system")
    folder = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / "img"
    folder.mkdir(parents=True, exist_ok=True)
    by_policy = groups(root)
    missing = [p for p in POLICIES if p not in by_policy]
    if missing:
        raise SystemExit(f"no runs for {', '.join(missing)} under {root}")
    print(table(by_policy))
    print()
    print(slow_share(by_policy[BASELINE]))
    figures(by_policy, folder)


if __name__ == "__main__":
    main(sys.argv[1:])
