"""Declared search spaces of tunable hyper-parameters (issue 52: fair comparisons by construction).

A hyper-parameter that its paper (or the field) tunes declares where to search in its pydantic ``Field``,
through :func:`tunable`: a numeric range (``low``/``high``, ``log`` for a log-uniform scale, ``step`` for
an integer grid) or a set of ``choices``. ``fedskew list --params NAME`` shows it and ``fedskew tune``
searches lr × every declared knob with the same number of trials for every method. The space lives with the
field, so a method's author (or a plugin's) declares it once, beside the default and its source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from fedskew.errors import ConfigError

#: the key of a field's ``json_schema_extra`` that holds its search space
SEARCH_KEY = "search"

Choice = bool | int | float | str | None
#: the evaluation protocols a knob's ``protocols`` may name (``eval.protocol``'s values)
PROTOCOLS = ("global", "personalized")
#: a tuned value within this share of its range's width from an end counts as "at the boundary"
BOUNDARY_TOLERANCE = 0.02


@dataclass(frozen=True)
class SearchSpace:
    """Where a tuner looks for one hyper-parameter: ``choices``, or the range [low, high] (``log``: sampled
    uniformly in log scale; ``integer``: whole numbers, on a grid of ``step``). ``protocols``: the evaluation
    protocols (``eval.protocol``) under which the knob changes what is evaluated, None for every protocol; a
    knob that acts only on personal models (a fine-tuning length, Ditto's λ) is inert when the global model
    is scored, and a tuner that searched it there would spend trials on noise."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    step: float | None = None
    choices: tuple[Choice, ...] | None = None
    protocols: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.protocols is not None and (not self.protocols or not set(self.protocols) <= set(PROTOCOLS)):
            raise ValueError(
                f"a search space's protocols is None (every protocol) or some of {', '.join(PROTOCOLS)}, "
                f"got {self.protocols}"
            )
        if self.choices is not None:
            if self.low is not None or self.high is not None or not self.choices:
                raise ValueError("a search space is either non-empty choices or a range, not both")
            return
        if self.low is None or self.high is None or not self.low < self.high:
            raise ValueError(f"a search range needs low < high, got [{self.low}, {self.high}]")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-scale search range needs low > 0, got {self.low}")
        if self.step is not None:
            self._check_step(self.low, self.high, self.step)

    def _check_step(self, low: float, high: float, step: float) -> None:
        """A step grid: positive, not on a log scale (Optuna takes none there), whole for an integer range,
        and dividing the range so that ``high`` is a grid point."""
        if not step > 0 or self.log or (self.integer and step != int(step)):
            raise ValueError(f"a search step must be positive, linear and whole on integers, got {step}")
        cells = (high - low) / step
        if abs(cells - round(cells)) > 1e-9 * max(1.0, cells):
            raise ValueError(f"a search step {step:g} must divide the range [{low:g}, {high:g}]")

    def acts_under(self, protocol: str) -> bool:
        """Whether the knob changes what is evaluated under ``eval.protocol`` = ``protocol``."""
        return self.protocols is None or protocol in self.protocols

    def on_grid(self, value: float) -> bool:
        """Whether ``value`` is a point of the range's step grid (always, without a step)."""
        if self.step is None or self.low is None:
            return True
        cells = (value - self.low) / self.step
        return abs(cells - round(cells)) <= 1e-9 * max(1.0, abs(cells))

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this space (a range's bounds included)."""
        if self.choices is not None:
            return value in self.choices
        assert self.low is not None and self.high is not None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        return self.low <= value <= self.high and self.on_grid(value)

    def position(self, value: float) -> float:
        """Where ``value`` lies in the range: 0 at ``low``, 1 at ``high`` (on the log scale when ``log``)."""
        assert self.low is not None and self.high is not None
        if self.log:
            return (math.log(value) - math.log(self.low)) / (math.log(self.high) - math.log(self.low))
        return (value - self.low) / (self.high - self.low)

    def at_boundary(self, value: Any, tolerance: float = BOUNDARY_TOLERANCE) -> bool:
        """Whether ``value`` sits at an end of a range, within ``tolerance`` of its width (on the sampling
        scale: a continuous sampler never hits the end exactly); the "collapses onto a baseline" flag's test.
        A choice is never on a boundary."""
        if self.choices is not None or not self.contains(value):
            return False
        pos = self.position(float(value))
        return pos <= tolerance or pos >= 1 - tolerance

    def text(self) -> str:
        """One short line: ``{a, b, c}``, ``[1e-4, 1] log`` or ``[1, 8] int``."""
        if self.choices is not None:
            return "{" + ", ".join(str(c) for c in self.choices) + "}"
        kind = " log" if self.log else ""
        kind += " int" if self.integer else ""
        kind += f" step {self.step:g}" if self.step is not None else ""
        return f"[{self.low:g}, {self.high:g}]{kind}"

    def as_dict(self) -> dict[str, Any]:
        acts = {} if self.protocols is None else {"protocols": list(self.protocols)}
        if self.choices is not None:
            return {"choices": list(self.choices), **acts}
        out: dict[str, Any] = {"log": self.log, "integer": self.integer, "low": self.low, "high": self.high}
        if self.step is not None:
            out["step"] = self.step
        return out | acts


def tunable(
    default: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    log: bool = False,
    integer: bool = False,
    step: float | None = None,
    choices: Sequence[Choice] | None = None,
    protocols: Sequence[str] | None = None,
    **field: Any,
) -> Any:
    """A pydantic ``Field(default, **field)`` that declares its search space (see :class:`SearchSpace`);
    the default must lie in it."""
    space = SearchSpace(
        low,
        high,
        log,
        integer,
        step,
        None if choices is None else tuple(choices),
        None if protocols is None else tuple(protocols),
    )
    if default is not None and not space.contains(default):
        raise ValueError(f"default {default!r} is outside its search space {space.text()}")
    extra = dict(field.pop("json_schema_extra", None) or {})
    extra[SEARCH_KEY] = space.as_dict()
    return Field(default, json_schema_extra=extra, **field)


def space_of(extra: Any) -> SearchSpace | None:
    """The search space a field's ``json_schema_extra`` declares, if any."""
    if not isinstance(extra, dict) or SEARCH_KEY not in extra:
        return None
    d = dict(extra[SEARCH_KEY])
    choices, protocols = d.pop("choices", None), d.pop("protocols", None)
    acts = None if protocols is None else tuple(protocols)
    if choices is not None:
        return SearchSpace(choices=tuple(choices), protocols=acts)
    return SearchSpace(**d, protocols=acts)


def search_spaces(model: type[BaseModel]) -> dict[str, SearchSpace]:
    """Every declared search space of ``model``'s fields, by field name, in declaration order."""
    out: dict[str, SearchSpace] = {}
    for name, info in model.model_fields.items():
        space = space_of(info.json_schema_extra)
        if space is not None:
            out[name] = space
    return out


def check_value(key: str, space: SearchSpace, value: Any) -> None:
    """A one-line :class:`ConfigError` when ``value`` is not in ``space``."""
    if not space.contains(value):
        raise ConfigError(f"{key}={value!r} is outside its search space {space.text()}")
