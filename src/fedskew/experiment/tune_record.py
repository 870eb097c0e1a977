"""What ``fedskew tune`` reads and writes about its trials: the objective of a trial's runs, and at the end
the chosen configs (``chosen/<method>.yaml``) and the budget record (``budget.json``).

Why the objective reads ``summary["final"]["val_accuracy"]``: the final round on the validation split is
what a reporting run's model is (never the best round, never test, both of which select on what is then
reported). A run whose final validation accuracy is non-finite, or whose summary says ``failed`` (it
diverged: the engine rejects non-finite uploads, so a diverged run usually ends at its *initial* model's
finite, chance-level accuracy and only its status tells), scores 0, worse than any model that learned, so the
trial still counts towards the equal budget and the sampler learns to avoid its values. A run that scored no
validation sample at all (``data.val_fraction`` too small for its clients) is refused: every trial would
score 0 and the "best" would be the first.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.config_diff import flatten
from fedskew.experiment.config_marks import read_marked
from fedskew.experiment.failure import failed
from fedskew.experiment.runner import SUMMARY_FILE
from fedskew.experiment.sweep import sanitize

if TYPE_CHECKING:
    from fedskew.experiment.tune import TunePlan

CHOSEN_DIR, BUDGET_FILE = "chosen", "budget.json"
OBJECTIVE = "final val_accuracy, mean over the tuning seeds"


def _summary(folder: Path) -> dict[str, Any]:
    data = json.loads((folder / SUMMARY_FILE).read_text())
    return data if isinstance(data, dict) else {}


def run_value(summary: dict[str, Any]) -> float | None:
    """A run's final validation accuracy; ``None`` when missing or non-finite or the run says ``failed``
    (it diverged)."""
    value = (summary.get("final") or {}).get("val_accuracy")
    if not isinstance(value, int | float) or isinstance(value, bool) or failed(summary):
        return None
    return float(value) if math.isfinite(value) else None


def read_trial(folders: list[Path]) -> float:
    """The objective of a trial: its runs' final ``val_accuracy``, averaged (a diverged run scores 0); a run
    that scored no validation sample is refused in one line (see the module docstring)."""
    summaries = [_summary(f) for f in folders]
    for folder, s in zip(folders, summaries, strict=True):
        if "val_accuracy" not in (s.get("final") or {}):
            raise ConfigError(
                f"tune: {folder} scored no validation sample (data.val_fraction x each client's samples "
                "rounds to 0); allowed: a larger data.val_fraction (or data.val_shots), with another --out"
            )
    values = [run_value(s) for s in summaries]
    return sum(v or 0.0 for v in values) / len(values)


def trial_folders(plan: TunePlan, method: str, number: int) -> list[Path]:
    folder = plan.spec.out / sanitize(method) / f"trial{number}"
    return [folder / f"seed{s}" for s in plan.spec.seeds]


def _spent(plan: TunePlan, method: str, numbers: list[int]) -> dict[str, Any]:
    """Runs, diverged runs, wall seconds and compute (summed ``summary["compute"]`` entries, where runs
    record them) of ``method``'s completed trials."""
    runs, diverged, wall, compute, any_compute = 0, 0, 0.0, dict[str, float](), False
    for number in numbers:
        for folder in trial_folders(plan, method, number):
            s = _summary(folder)
            runs += 1
            diverged += run_value(s) is None or failed(s)
            wall += float(s.get("wall_seconds") or 0.0)
            if isinstance(s.get("compute"), dict):
                any_compute = True
                for k, v in flatten(s["compute"]).items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        compute[k] = compute.get(k, 0) + v
    return {
        "runs": runs,
        "diverged_runs": diverged,
        "wall_seconds": round(wall, 3),
        "compute": compute if any_compute else None,
    }


def _chosen_seed(config_seed: int, seeds: tuple[int, ...]) -> int:
    """The chosen config's seed: its base config's, unless that is a tuning seed (then the least other)."""
    if config_seed not in seeds:
        return config_seed
    return min(set(range(len(seeds) + 1)) - set(seeds))


def write_chosen(plan: TunePlan, method: str, best: Any, trials: int) -> Path:
    """``chosen/<method>.yaml``: the base config resolved at the best trial's values, with a ``tuning``
    record of the seeds (which its runs then refuse) and the study. Resolved, so relative paths in the base
    config (plugins, a clock trace) still point where they did."""
    s = plan.spec
    doc = read_marked(s.config)
    sets = plan.sets(method, dict(best.params))
    base = s.config.resolve().parent
    seed = _chosen_seed(build_config(doc.data, sets, base=base).seed, s.seeds)
    cfg = build_config(doc.data, [*sets, f"seed={seed}"], base=base).to_dict()
    cfg.pop("name", None)
    cfg["tuning"] = {
        "seeds": list(s.seeds),
        "trials": trials,
        "study": str(s.out.resolve()),
        "objective": OBJECTIVE,
        "value": float(best.value),
        "values": dict(best.params),
    }
    build_config(cfg, base=base)  # what sweep will read back
    given = "".join(f" --set {o}" for o in s.sets)
    head = (
        f"# fedskew tune: {s.config}{given} with the values of {method}'s best of {trials} trials "
        f"(trial {best.number}; final val accuracy {100 * best.value:.2f}%, mean over seeds "
        f"{', '.join(map(str, s.seeds))})\n# report on other seeds, e.g.: fedskew sweep "
        f"{s.out / CHOSEN_DIR}/*.yaml --seeds 0-4 --out RESULTS\n"
    )
    path = s.out / CHOSEN_DIR / f"{sanitize(method)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_results(plan: TunePlan, studies: dict[str, Any]) -> dict[str, Any]:
    """Write every method's chosen config and ``budget.json``; returns the budget record."""
    from optuna.trial import TrialState

    methods: dict[str, Any] = {}
    for method, study in studies.items():
        trials = study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state is TrialState.COMPLETE]
        best = study.best_trial
        knobs = plan.knobs[method]
        methods[method] = {
            "trials": len(done),
            "failed_trials": sum(t.state is TrialState.FAIL for t in trials),
            "seeds": list(plan.spec.seeds),
            **_spent(plan, method, [t.number for t in done]),
            "best": {
                "trial": best.number,
                "value": best.value,
                "values": dict(best.params),
                "at_boundary": [k for k, v in best.params.items() if knobs[k].at_boundary(v)],
            },
            "spaces": {k: space.text() for k, space in knobs.items()},
            "chosen": str(write_chosen(plan, method, best, len(done))),
        }
    record = {
        "trials_per_method": plan.spec.trials,
        "seeds": list(plan.spec.seeds),
        "objective": OBJECTIVE,
        "sampler": plan.spec.sampler,
        "sampler_seed": plan.spec.sampler_seed,
        "methods": methods,
    }
    (plan.spec.out / BUDGET_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record
