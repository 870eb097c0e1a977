"""``fedskew tune``: the same number of trials for every method over ``client.lr`` × its declared knobs, with
Optuna's samplers, scored on the validation split only (issue 52, item 3: fair comparisons by construction).

Layout of ``--out DIR``::

    DIR/tune.json                  the study's identity (methods, seeds, sampler, knobs, base config)
    DIR/journal.log                Optuna's journal: one study per method (JournalFileBackend)
    DIR/<method>/trial<k>/seed<s>/ each trial's runs: ordinary run folders, run by the sweep machinery
    DIR/chosen/<method>.yaml       the base config at the best trial's values, with a ``tuning:`` record
    DIR/budget.json                per method: trials, runs, seeds, compute spent, the best trial

Why each rule: the objective is the *final* round's ``val_accuracy`` averaged over the tuning seeds (never
test, never the best round: both would select on what is reported); tuning seeds are recorded in the chosen
configs, whose runs refuse them (experiment/tune_section.py); every method gets exactly ``--trials``
completed trials, resumed after a kill with the interrupted trial's own values (experiment/tune_space.py);
trials run a step at a time, one trial per unfinished method, so their runs share ``--jobs`` processes and
the proposals do not depend on ``--jobs``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.errors import ConfigError, RunFailure
from fedskew.experiment.config import build_config, results_config
from fedskew.experiment.config_diff import flatten
from fedskew.experiment.config_marks import read_marked
from fedskew.experiment.config_parsing import parse_assignment
from fedskew.experiment.runner import SUMMARY_FILE
from fedskew.experiment.sweep import PlannedRun, SweepListener, plan_runs, sanitize
from fedskew.experiment.tune_record import read_trial, write_results
from fedskew.experiment.tune_space import (
    Knobs,
    check_sampler,
    distribution,
    override,
    select_knobs,
)

SPEC_FILE, JOURNAL_FILE = "tune.json", "journal.log"
#: what a changed command is called in the one line that refuses it
_FLAGS = {
    "methods": "--methods",
    "seeds": "--seeds",
    "sampler": "--sampler",
    "sampler_seed": "--sampler-seed",
    "knobs": "--knobs (or the declared search spaces)",
}


@dataclass(frozen=True)
class TuneSpec:
    """One ``fedskew tune`` command: what to tune, on which seeds, with which sampler, into ``out``."""

    config: Path
    methods: tuple[str, ...]
    trials: int
    seeds: tuple[int, ...]
    out: Path
    sampler: str = "tpe"
    sampler_seed: int = 0
    sets: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()


@dataclass
class TunePlan:
    """A checked spec: each method's knobs and base config (resolved, at its default values)."""

    spec: TuneSpec
    knobs: dict[str, Knobs]
    base: dict[str, dict[str, Any]]

    def sets(self, method: str, values: dict[str, Any]) -> list[str]:
        """The ``--set`` overrides of one trial of ``method`` on the base config file."""
        drop = ["tuning=null"] if self.has_tuning else []  # tuning again from a chosen config
        knobs = [override(k, v) for k, v in values.items()]
        return [*drop, *self.spec.sets, f"algorithm.name={method}", *knobs]

    has_tuning: bool = False


@dataclass
class TuneOutcome:
    """How a tune ended: finished (results written), or interrupted with every run resumable."""

    interrupted: bool = False
    results: dict[str, Any] = field(default_factory=dict)


def _check_basics(spec: TuneSpec) -> None:
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.plugins import load_plugins, prepare, resolve_plugins

    prepare()
    raw = read_marked(spec.config).data
    if isinstance(raw, dict) and isinstance(raw.get("plugins"), list):  # a method the config's plugin adds
        load_plugins(resolve_plugins(raw["plugins"], spec.config.resolve().parent))
    if spec.trials < 1:
        raise ConfigError(f"--trials {spec.trials}: allowed: at least 1 (the same number for every method)")
    if not spec.methods or len(set(spec.methods)) != len(spec.methods):
        raise ConfigError(
            f"--methods '{','.join(spec.methods)}': allowed: distinct method names, e.g. fedavg,fedprox"
        )
    if not spec.seeds:
        raise ConfigError("--seeds: allowed: at least one tuning seed, e.g. 100,101")
    if spec.sampler_seed < 0:
        raise ConfigError(f"--sampler-seed {spec.sampler_seed}: allowed: 0 or more")
    for method in spec.methods:
        if method not in ALGORITHMS:
            ALGORITHMS.get(method)  # the registry's one line: unknown, did you mean, valid names


def _base_config(spec: TuneSpec, method: str, sets: Sequence[str]) -> dict[str, Any]:
    """``method``'s resolved config at its default values on the first tuning seed; must have a val split."""
    doc = read_marked(spec.config)
    try:
        cfg = build_config(doc.data, [*sets, f"seed={spec.seeds[0]}"], base=spec.config.resolve().parent)
    except ConfigError as err:
        raise ConfigError(f"tune: {spec.config} with --methods {method}: {err}") from None
    if not (cfg.data.val_fraction > 0 or cfg.data.val_shots is not None):
        raise ConfigError(
            f"tune: {spec.config}: the objective is the validation accuracy, and the config holds out none; "
            "allowed: data.val_fraction > 0 (or data.val_shots with data.shots), in the file or with --set"
        )
    return cfg.to_dict()


def check_spec(spec: TuneSpec) -> TunePlan:
    """Every one-line refusal before anything runs: the options, the methods, the knobs, the sampler, and
    each method's config at its defaults (validation split included)."""
    _check_basics(spec)
    fixed = [".".join(parse_assignment(s)[0]) for s in spec.sets]
    has_tuning = "tuning" in (read_marked(spec.config).data or {})
    plan = TunePlan(spec, {}, {}, has_tuning)
    for method in spec.methods:
        plan.base[method] = _base_config(spec, method, plan.sets(method, {}))
    protocols = {m: str(plan.base[m]["eval"]["protocol"]) for m in spec.methods}
    plan.knobs = select_knobs(spec.methods, spec.knobs, fixed, protocols)
    check_sampler(spec.sampler, plan.knobs, spec.trials)
    return plan


# ---------------------------------------------------------------------------- the study's identity
def base_record(config: dict[str, Any], knobs: Knobs) -> dict[str, Any]:
    """What decides a trial's numbers besides its knobs and seed (compared when a tune is rerun)."""
    flat = flatten(results_config(config))
    out = {k: v for k, v in flat.items() if k not in ("seed", "name") and k not in knobs}
    return json.loads(json.dumps(out, sort_keys=True))


def identity(plan: TunePlan) -> dict[str, Any]:
    s = plan.spec
    return {
        "methods": list(s.methods),
        "seeds": list(s.seeds),
        "sampler": s.sampler,
        "sampler_seed": s.sampler_seed,
        "knobs": {m: {k: sp.as_dict() for k, sp in kn.items()} for m, kn in plan.knobs.items()},
        "base": {m: base_record(plan.base[m], plan.knobs[m]) for m in s.methods},
        "trials": s.trials,
        "config": str(s.config),
    }


def _base_difference(out: Path, old: dict[str, Any], new: dict[str, Any]) -> str:
    for method in new:
        a, b = old.get(method, {}), new[method]
        key = next((k for k in sorted(a.keys() | b.keys()) if a.get(k, ...) != b.get(k, ...)), None)
        if key is not None:
            was, now = (json.dumps(x.get(key)) if key in x else "unset" for x in (a, b))
            return (
                f"tune: '{out}' holds a study of another config ({method}'s {key}: {was} then, {now} now); "
                "allowed: the same config and --set, or another --out"
            )
    return ""


def _text(value: Any) -> str:
    """A recorded option as typed: ``fedavg,fedprox``, ``100,101``, ``tpe``; the knobs as JSON."""
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return json.dumps(value) if isinstance(value, dict) else str(value)


def check_identity(out: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """One line naming the first difference between the command that started ``out`` and this one; more
    ``--trials`` extends the study (except on a grid, whose points depend on the trial count)."""
    for key, flag in _FLAGS.items():
        if saved.get(key) != now[key]:
            was, new = (_text(x) for x in (saved.get(key), now[key]))
            raise ConfigError(
                f"tune: '{out}' holds a study started with {flag} {was} (now {new}); allowed: the same "
                "command, or another --out"
            )
    why = _base_difference(out, saved.get("base", {}), now["base"])
    if why:
        raise ConfigError(why)
    if now["trials"] < saved["trials"] or (now["trials"] > saved["trials"] and now["sampler"] == "grid"):
        allowed = f"{saved['trials']}" + (
            " (a grid's points depend on it)" if now["sampler"] == "grid" else " or more"
        )
        raise ConfigError(
            f"--trials {now['trials']}: the study in '{out}' was started with {saved['trials']}; "
            f"allowed: {allowed}"
        )


def _record_identity(plan: TunePlan) -> None:
    out = plan.spec.out
    path = out / SPEC_FILE
    now = identity(plan)
    if path.is_file():
        check_identity(out, json.loads(path.read_text()), now)
    path.write_text(json.dumps(now, indent=2) + "\n")


# ---------------------------------------------------------------------------- the loop
def _repair(journal: Path) -> None:
    """Drop a last line cut short by a kill mid-write (Optuna would append after it, making both unreadable);
    the entry it held was never acted on: the trial it recorded is asked or told again."""
    if not journal.is_file():
        return
    data = journal.read_bytes()
    if data and not data.endswith(b"\n"):
        journal.write_bytes(data[: data.rfind(b"\n") + 1])


def _studies(plan: TunePlan) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the CLI prints its own lines
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    journal = plan.spec.out / JOURNAL_FILE
    _repair(journal)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    return {
        m: optuna.create_study(study_name=m, storage=storage, direction="maximize", load_if_exists=True)
        for m in plan.spec.methods
    }


def _next_trial(plan: TunePlan, method: str, study: Any) -> tuple[int, dict[str, Any]] | None:
    """The trial ``method`` runs next: an interrupted one (same values), else a new ask; ``None`` when it
    has its ``--trials`` completed trials."""
    from optuna.trial import TrialState

    from fedskew.experiment.tune_space import SAMPLERS

    knobs = plan.knobs[method]
    trials = study.get_trials(deepcopy=False)
    if sum(t.state is TrialState.COMPLETE for t in trials) >= plan.spec.trials:
        return None
    for t in (t for t in trials if t.state is TrialState.RUNNING):
        if set(t.params) == set(knobs):
            return t.number, dict(t.params)
        _tell(study, t.number, None)  # killed between its ask and its values: never ran
    study.sampler = SAMPLERS[plan.spec.sampler](plan.spec.sampler_seed, len(trials), knobs, plan.spec.trials)
    trial = study.ask(fixed_distributions={k: distribution(s) for k, s in knobs.items()})
    return trial.number, {k: trial.params[k] for k in knobs}


def _tell(study: Any, number: int, value: float | None) -> None:
    """Record a trial's objective (``None``: the trial failed). The sampler only proposes: a neutral one
    takes the tell (the grid sampler's own calls ``Study.stop``, allowed only inside ``Study.optimize``)."""
    from optuna.samplers import RandomSampler
    from optuna.trial import TrialState

    study.sampler = RandomSampler()
    if value is None:
        study.tell(number, state=TrialState.FAIL)
    else:
        study.tell(number, value)


def _plan_trial(plan: TunePlan, method: str, number: int, values: dict[str, Any]) -> list[PlannedRun]:
    s = plan.spec
    name = f"{sanitize(method)}/trial{number}"
    return plan_runs([s.config], s.out, list(s.seeds), (), plan.sets(method, values), name).runs


#: the progress of a tune: a trial of ``method`` finished with its values and objective
TrialListener = Callable[[str, int, dict[str, Any], float], None]


def run_tune(
    plan: TunePlan,
    jobs: int = 1,
    threads: int = 1,
    listener: SweepListener | None = None,
    on_trial: TrialListener | None = None,
) -> TuneOutcome:
    """Run ``plan`` to ``--trials`` completed trials per method (continuing what ``out`` holds), then write
    the chosen configs and ``budget.json``. A crashed run stops the tune with :class:`RunFailure` after the
    trials that did finish are recorded; a rerun continues."""
    from fedskew.experiment.results import output_lock
    from fedskew.experiment.sweep_check import check_runs
    from fedskew.experiment.sweep_pool import run_sweep

    out = plan.spec.out
    with output_lock(out):
        _record_identity(plan)
        studies = _studies(plan)
        checked = False
        while True:
            step = {}  # one trial per method that has not got its --trials yet
            for method, study in studies.items():
                nxt = _next_trial(plan, method, study)
                if nxt is not None:
                    number, values = nxt
                    step[(method, number)] = (values, _plan_trial(plan, method, number, values))
            if not step:
                break
            runs = [r for _, trial_runs in step.values() for r in trial_runs]
            if not checked:  # packages and trackers, once, before the first run starts
                check_runs(runs)
                checked = True
            outcome = run_sweep(runs, jobs, threads, listener)
            if outcome.interrupted:
                return TuneOutcome(interrupted=True)
            for (method, number), (values, trial_runs) in step.items():
                if all((r.folder / SUMMARY_FILE).is_file() for r in trial_runs):
                    value = read_trial([r.folder for r in trial_runs])
                    _tell(studies[method], number, value)
                    if on_trial is not None:
                        on_trial(method, number, values, value)
            crashed = [(r, m) for r, m in outcome.failed if not (r.folder / SUMMARY_FILE).is_file()]
            if crashed:
                raise RunFailure(_crash_line(crashed))
        return TuneOutcome(results=write_results(plan, studies))


def _crash_line(crashed: Sequence[tuple[PlannedRun, str]]) -> str:
    """The one line of a step whose runs crashed. A config refusal (a trial's values that this config
    cannot take, e.g. lgfedavg's global_layers under global_part=head) repeats on every rerun, since the
    interrupted trial is re-run with its own values: that line says so instead of "rerun to resume"."""
    folders = ", ".join(str(r.folder) for r, _ in crashed)
    refused = next((m for _, m in crashed if m.startswith("ConfigError")), None)
    if refused is None:
        return f"tune: {len(crashed)} runs failed (see error.log): {folders}; rerun to resume"
    return (
        f"tune: a trial's values are refused by this config ({' '.join(refused.split())}); a rerun would "
        "repeat it; allowed: leave that knob out (--knobs) or change --set, with another --out"
    )
