"""What ``fedskew tune`` searches: each method's knobs (``client.*`` and ``algorithm.*`` fields declared with
:func:`fedskew.search_space.tunable`) mapped onto Optuna's distributions, and the seeded samplers.

Why Optuna (issue 52, item 3): a well-kept HPO library's samplers (TPE, random, grid) rather than a search
of our own. Each trial is asked with ``fixed_distributions``, so its values are all in the journal the moment
it starts: a tune killed mid-trial re-runs that trial with the same values. The sampler is rebuilt for every
ask with a seed derived from ``--sampler-seed`` and the trial's number, so its proposals depend only on the
study's history, never on how often the process was restarted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from fedskew.errors import ConfigError
from fedskew.search_space import SearchSpace, search_spaces
from fedskew.settings import ClientSection

#: a knob: its dotted config key -> its declared space
Knobs = dict[str, SearchSpace]


def declared_knobs(method: str) -> Knobs:
    """``client.lr`` (and any other declared ``client.*`` space), then the method's declared params."""
    from fedskew.algorithms.base import ALGORITHMS

    params = ALGORITHMS.get(method).Params
    client = {f"client.{k}": s for k, s in search_spaces(ClientSection).items()}
    return {**client, **{f"algorithm.{k}": s for k, s in search_spaces(params).items()}}


def select_knobs(
    methods: Sequence[str], wanted: Sequence[str], fixed: Sequence[str], protocols: Mapping[str, str]
) -> dict[str, Knobs]:
    """Per method, the knobs tuned: all it declares that act under its ``eval.protocol`` (``protocols``),
    or those of ``wanted`` (``--knobs``). A wanted knob no method declares, or one inert under every
    method's protocol, a method left with none, and a ``--set`` of a tuned knob (``fixed``: the keys
    ``--set`` writes) are refused in one line."""
    declared = {m: declared_knobs(m) for m in methods}
    known = sorted({k for d in declared.values() for k in d})
    acting = {m: {k: s for k, s in d.items() if s.acts_under(protocols[m])} for m, d in declared.items()}
    for key in wanted:
        if key not in known:
            raise ConfigError(
                f"--knobs '{key}': no method of --methods declares it a tunable knob; declared: "
                f"{', '.join(known)} (fedskew list --params NAME)"
            )
        if not any(key in d for d in acting.values()):
            only = next(d[key].protocols for d in declared.values() if key in d)
            raise ConfigError(
                f"--knobs '{key}': it acts only under eval.protocol {' or '.join(only or ())}, and this "
                f"study evaluates {' and '.join(sorted(set(protocols.values())))}; allowed: drop it, or set "
                "eval.protocol"
            )
    chosen = {m: {k: s for k, s in d.items() if not wanted or k in wanted} for m, d in acting.items()}
    for method, knobs in chosen.items():
        if not knobs:
            raise ConfigError(
                f"--knobs {','.join(wanted)}: {method} declares none of them, so its trials would all be the "
                f"same run; allowed: add one of {', '.join(acting[method])}"
            )
        clash = next((k for k in fixed if k in knobs), None)
        if clash is not None:
            raise ConfigError(
                f"--set {clash}: a knob {method} tunes; allowed: leave it to the tuner, or tune the others "
                "with --knobs"
            )
    return chosen


def override(key: str, value: Any) -> str:
    """``key=value`` with the value as YAML that parses back to exactly ``value`` (``1.0e-05``, not the
    ``1e-05`` that YAML 1.1 reads as a string)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return f"{key}={text.removesuffix('...').strip()}"


# ---------------------------------------------------------------------------- Optuna
def distribution(space: SearchSpace) -> Any:
    """The Optuna distribution of a declared space (log ranges take no step: Optuna refuses both)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if space.choices is not None:
        return CategoricalDistribution(space.choices)
    assert space.low is not None and space.high is not None
    if space.integer:
        step = 1 if space.log else int(space.step or 1)
        return IntDistribution(int(space.low), int(space.high), log=space.log, step=step)
    return FloatDistribution(space.low, space.high, log=space.log, step=None if space.log else space.step)


def _levels(space: SearchSpace, n: int) -> list[Any]:
    """``n`` points of a range, both ends included (log-spaced on a log scale; on its step grid)."""
    if space.choices is not None:
        return list(space.choices)
    low, high = float(space.low or 0.0), float(space.high or 0.0)
    if space.integer:
        step = int(space.step or 1)
        every = list(range(int(low), int(high) + 1, step))
        if len(every) <= n:
            return every
        return sorted({every[round(i * (len(every) - 1) / (n - 1))] for i in range(n)})
    if space.log:
        points = [math.exp(math.log(low) + i * (math.log(high) - math.log(low)) / (n - 1)) for i in range(n)]
    else:
        points = [low + i * (high - low) / (n - 1) for i in range(n)]
    if space.step:
        points = [low + round((p - low) / space.step) * space.step for p in points]
    inner = [float(f"{p:.3g}") for p in points[1:-1]]  # readable inner points; the ends stay exact
    return sorted({low, *inner, high})


def grid(knobs: Knobs, trials: int) -> dict[str, list[Any]]:
    """The coarsest product grid with at least ``trials`` points: every choice, and the same number of
    levels (at least 2) on every range. A grid that cannot reach ``trials`` points is refused."""
    ranges = [k for k, s in knobs.items() if s.choices is None]
    levels = 2
    while True:
        points = {k: _levels(s, levels) for k, s in knobs.items()}
        size = math.prod(len(v) for v in points.values())
        grown = {k: _levels(s, levels + 1) for k, s in knobs.items() if k in ranges}
        if size >= trials or all(len(grown[k]) == len(points[k]) for k in ranges):
            break
        levels += 1
    if size < trials:
        raise ConfigError(
            f"--sampler grid: the grid of {', '.join(knobs)} has {size} points, fewer than --trials "
            f"{trials}; allowed: --trials at most {size}, or --sampler tpe|random"
        )
    return points


def trial_seed(sampler_seed: int, number: int) -> int:
    """The seed of the ask of trial ``number`` (a pure function: restarts do not shift it)."""
    return (sampler_seed * 1_000_003 + number) % 2**32


def _tpe(seed: int, number: int, knobs: Knobs, trials: int) -> Any:
    from optuna.samplers import TPESampler

    return TPESampler(seed=trial_seed(seed, number))


def _random(seed: int, number: int, knobs: Knobs, trials: int) -> Any:
    from optuna.samplers import RandomSampler

    return RandomSampler(seed=trial_seed(seed, number))


def _grid(seed: int, number: int, knobs: Knobs, trials: int) -> Any:
    """Seeded once per study, not per trial: the seed shuffles the grid's order, and trial ``k`` takes the
    ``k``-th point of that order."""
    from optuna.samplers import GridSampler

    return GridSampler(grid(knobs, trials), seed=seed)


#: ``--sampler`` -> factory(--sampler-seed, the trial's number, the knobs, --trials)
SAMPLERS: dict[str, Callable[[int, int, Knobs, int], Any]] = {"tpe": _tpe, "random": _random, "grid": _grid}


def check_sampler(name: str, knobs: dict[str, Knobs], trials: int) -> None:
    """One line for an unknown ``--sampler`` or a grid too small for ``trials``."""
    if name not in SAMPLERS:
        raise ConfigError(f"--sampler '{name}': allowed: {', '.join(SAMPLERS)}")
    if name == "grid":
        for k in knobs.values():
            grid(k, trials)
