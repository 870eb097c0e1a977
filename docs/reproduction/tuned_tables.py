"""Tables of a comparison run under the issue-52 protocol: ``fedskew tune``, then ``fedskew sweep`` of the
chosen configs on reporting seeds disjoint from the tuning seeds.

    python docs/reproduction/tuned_tables.py TUNE_DIR[,TUNE_DIR...] REPORT_DIR [BASELINE ...]

``TUNE_DIR``: the ``--out`` of ``fedskew tune`` (its ``budget.json``), or several, comma-separated, whose
methods are listed in that order (the same trials, seeds and sampler in each: methods tuned in groups);
``REPORT_DIR``: the ``--out`` of the sweeps over their ``chosen/*.yaml`` with ``--name '{algorithm.name}'``.
Per method: the tuned values (``*``: at an end of its search range, within 2% of its width on the sampling
scale), the best trial's final validation accuracy on the tuning seeds, the final-round test accuracy on the
reporting seeds (mean ± sample std), the seed-paired differences to each baseline with 95% t-intervals (``*``:
excludes 0), the spread of the clients' accuracies and the worst 10% of clients' (the fairness Ditto claims),
the compute of one reporting run (client steps, evaluation fine-tuning steps, and all steps: those two and a
method's declared extra work, such as pFedMe's inner steps or Ditto's personal model; mean over seeds) and
the tuning budget's compute. "collapses" flags a method whose interval against a baseline contains 0 while a
tuned knob sits at a range's end (the issue-52 "collapses onto a baseline" flag).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from global_tables import mean_of, paired, paired_text

from fedskew.experiment.report import Group, runs_by_folder, values_by_seed


def _value(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def tuned_text(best: dict) -> str:
    marks = set(best.get("at_boundary", []))
    parts = [f"{k.split('.')[-1]}={_value(v)}{'*' if k in marks else ''}" for k, v in best["values"].items()]
    return ", ".join(parts)


def mean_compute(group: Group, key: str) -> float:
    return float(np.mean([float((r.summary.get("compute") or {}).get(key, 0)) for r in group.runs]))


def tuned_methods(tunes: list[Path]) -> dict[str, dict]:
    """Every method's ``budget.json`` entry over the tune folders; they must share trials, seeds, sampler."""
    out: dict[str, dict] = {}
    studies = set()
    for tune in tunes:
        spec = json.loads((tune / "tune.json").read_text())
        studies.add(json.dumps([spec["trials"], spec["seeds"], spec["sampler"], spec["sampler_seed"]]))
        out.update(json.loads((tune / "budget.json").read_text())["methods"])
    if len(studies) > 1:
        raise SystemExit(f"the tune folders differ in trials, seeds or sampler: {sorted(studies)}")
    return out


def fairness_text(group: Group) -> str:
    """The fairness Ditto claims ("the uniformity of performance across devices", its abstract) as the std of
    the clients' test accuracies, and the mean of the worst 10% of clients (``accuracy_worst10``); each the
    mean over seeds of the final round's value."""
    if any("accuracy_worst10" not in r.summary["final"] for r in group.runs):
        return "—"  # the global protocol scores one test set, not each client's
    spread, worst = (100 * mean_of(group, k) for k in ("accuracy_std", "accuracy_worst10"))
    return f"{spread:.2f} / {worst:.2f}"


def table(tunes: list[Path], report: Path, baselines: list[str]) -> str:
    by_method = {m: Group(m, runs) for m, runs in runs_by_folder(report).items()}
    head = ["method", "trials", "tuned values", "val acc. (tuning, %)", "test acc. (%)"]
    head += [f"− {b} (pp, 95% CI)" for b in baselines if b in by_method]
    head += ["client σ / worst 10% (pp / %)", "client steps / run", "eval fine-tune steps / run"]
    head += ["all steps / run", "tuning steps", "collapses"]
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for m, info in tuned_methods(tunes).items():
        if m not in by_method:
            continue
        g, best = by_method[m], info["best"]
        acc = 100 * np.array(list(values_by_seed(g).values()))
        cells = [m, str(info["trials"]), tuned_text(best), f"{100 * best['value']:.2f}"]
        failed = sum(r.summary.get("status") == "failed" for r in g.runs)  # diverged: kept, final-round
        note = f", {failed} failed" if failed else ""
        cells.append(f"{acc.mean():.2f} ± {acc.std(ddof=1):.2f} (n={len(acc)}{note})")
        collapse = []
        for b in baselines:
            if b not in by_method:
                continue
            if b == m:
                cells.append("—")
                continue
            p = paired(g, by_method[b])
            cells.append(paired_text(p))
            if not p.excludes_zero and best.get("at_boundary"):
                collapse.append(b)
        steps = (info.get("compute") or {}).get("total_steps")
        cells += [
            fairness_text(g),
            f"{mean_compute(g, 'client_steps'):,.0f}",
            f"{mean_compute(g, 'eval_finetune_steps'):,.0f}",
            f"{mean_compute(g, 'total_steps'):,.0f}",
            "—" if steps is None else f"{steps:,.0f}",
            ", ".join(f"onto {b}" for b in collapse) or "no",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    tunes = [Path(t) for t in sys.argv[1].split(",")]
    print(table(tunes, Path(sys.argv[2]), sys.argv[3:] or ["fedavg", "local"]))
