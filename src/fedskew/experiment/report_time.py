"""Accuracy against virtual time (issue 55): the ``virtual_time`` x axis of ``fedskew report --x`` and the
accuracy each run had reached within a virtual-time budget, for runs on the virtual clock (``clock:``; their
evaluated ``metrics.jsonl`` records hold ``virtual_time``, the virtual seconds at the round's end).

Runs of one group end at different virtual times (their clients' speeds and availability are drawn per
seed), so their curves share no grid. A curve here is a step function: at time ``t`` a run's value is that
of its last evaluation at or before ``t`` (the model the server then held; nothing is invented between two
evaluations). The figure draws each seed's steps thinly and their mean on the union of the runs' evaluation
times from the latest first evaluation to the earliest last one, where every run has a value; no run is
extended past its own end. The axes to choose from are :data:`fedskew.experiment.report.X_AXES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedskew.errors import FedskewError
from fedskew.experiment.runner import METRICS_FILE

if TYPE_CHECKING:  # report.py draws with this module's axis: no import back at run time
    from fedskew.experiment.report import Group, RunResult

__all__ = [
    "TIME_AXIS",
    "TIME_KEY",
    "XAxis",
    "accuracy_at_time",
    "mean_time_curve",
    "require_key",
    "time_series",
]

#: the metrics key of the virtual clock's time (engine/loop.py)
TIME_KEY = "virtual_time"


@dataclass(frozen=True)
class XAxis:
    """One choice of ``--x``: the axis title, the figure's caption, how a group's curves are drawn
    (``draw(ax, group, key, scale, label)``) and the metrics key every run must log for it (``None``:
    none)."""

    label: str
    caption: str
    draw: Callable[[Any, Group, str, float, str], None]
    needs: str | None = None


def require_key(option: str, key: str | None, groups: list[Group], hint: str = "") -> None:
    """One line naming the first result folder none of whose records logs ``key`` (``option``: what asked
    for it, e.g. ``--x virtual_time``; ``hint``: what the line ends with)."""
    for r in (r for g in groups for r in g.runs):
        if key is not None and not any(m.get(key) is not None for m in r.metrics):
            why = " (a run without a clock: section)" if key == TIME_KEY else ""
            raise FedskewError(f"{option}: '{r.path}' logs no {key} in its {METRICS_FILE}{why}{hint}")


def time_series(run: RunResult, key: str = "accuracy") -> tuple[np.ndarray, np.ndarray]:
    """The run's evaluated records holding ``virtual_time`` and ``key``, in time order (a tie: file order,
    the later round last): their times and values (a non-finite value, logged as ``null``: NaN)."""
    rows = [(float(m[TIME_KEY]), m[key]) for m in run.metrics if m.get(TIME_KEY) is not None and key in m]
    rows.sort(key=lambda row: row[0])  # stable: equal times keep their rounds' order
    times = np.array([t for t, _ in rows], dtype=float)
    values = np.array([np.nan if v is None else float(v) for _, v in rows], dtype=float)
    return times, values


def step_at(times: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The value of the last record at or before each of ``at`` (NaN before the first record)."""
    if times.size == 0:
        return np.full(at.shape, np.nan)
    idx = np.searchsorted(times, at, side="right") - 1
    return np.where(idx >= 0, values[np.clip(idx, 0, None)], np.nan)


def mean_time_curve(group: Group, key: str = "accuracy") -> tuple[np.ndarray, np.ndarray]:
    """The group's mean step curve: the runs' evaluation times between the latest first one and the earliest
    last one (empty where the runs do not overlap), and the mean over the runs of their values there."""
    series = [time_series(r, key) for r in group.runs]
    if any(t.size == 0 for t, _ in series):
        return np.zeros(0), np.zeros(0)
    start, end = max(t[0] for t, _ in series), min(t[-1] for t, _ in series)
    grid = np.unique(np.concatenate([t for t, _ in series]))
    grid = grid[(grid >= start) & (grid <= end)]
    return grid, np.mean([step_at(t, v, grid) for t, v in series], axis=0)


def draw_time(ax: Any, group: Group, key: str, scale: float, label: str) -> None:
    """Each seed's step curve thinly, and their mean (thick) up to the shortest run's end, in one colour."""
    grid, mean = mean_time_curve(group, key)
    thin = bool(grid.size) and len(group.runs) > 1  # with a mean drawn, the seeds are its context
    color = None
    if thin:
        (line,) = ax.plot(grid, scale * mean, drawstyle="steps-post", lw=1.6, label=f"{label}, mean")
        color, label = line.get_color(), ""
    style = {"lw": 0.8, "alpha": 0.4, "ms": 3} if thin else {"lw": 1.6, "ms": 4}
    for r in group.runs:  # a dot per evaluation: a run's last one is a point, not a step
        times, values = time_series(r, key)
        (line,) = ax.plot(
            times,
            scale * values,
            drawstyle="steps-post",
            marker=".",
            color=color,
            label=label or None,
            **style,
        )
        color, label = line.get_color(), ""


#: ``--x virtual_time``
TIME_AXIS = XAxis(
    "virtual time (s)",
    "vs virtual time: each seed's steps thin, their mean (thick) up to the shortest run's end",
    draw_time,
    TIME_KEY,
)


def accuracy_at_time(group: Group, budget: float, key: str = "accuracy") -> dict[int, float | None]:
    """``{seed: value}``: each run's ``key`` at its last evaluation at or before virtual time ``budget``
    (``None``: the run had not been evaluated by then; NaN: that evaluation's value was not finite), what a
    reproduction page pairs over seeds (:func:`fedskew.experiment.reporting.paired_at_time`)."""
    if not math.isfinite(budget) or budget < 0:
        raise FedskewError(f"virtual-time budget {budget}: expected a finite number of seconds >= 0")
    require_key(f"accuracy at virtual time {budget:g}", TIME_KEY, [group])
    out: dict[int, float | None] = {}
    for r in group.runs:
        seed = int(r.config["seed"])
        if seed in out:
            raise FedskewError(
                f"group '{group.label}' has two runs of seed {seed} (one is '{r.path}'); report one"
            )
        times, values = time_series(r, key)
        reached = times.size > 0 and budget >= times[0]
        out[seed] = float(step_at(times, values, np.array([budget]))[0]) if reached else None
    return out
