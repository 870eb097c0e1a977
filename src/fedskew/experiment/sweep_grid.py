"""A sweep's grid axes: keys scoped to the objects that have them, and grid points a run cannot take.

A grid key ``<section>.<name>.<key>`` whose ``<name>`` is a registered object of a named section
(``algorithm.fedprox.mu``, ``model.cnn.width``, ``data.partition.dirichlet.alpha``) is *scoped*: it sets
``<section>.<key>`` in the runs whose section names that object and is left out of every other run (which
then runs once, not once per value). An unscoped key that a run's object does not have
(``--grid algorithm.mu=...`` across fedavg and fedprox) makes that grid point *skipped*: not planned, one
line naming it and why; a key that no run can take is refused, as a typo would be. Why: a method comparison
with a method-specific knob is the common sweep, and failing the methods without the knob (or running
them once per value) is wrong either way.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from fedskew.errors import ConfigError, did_you_mean
from fedskew.experiment.config_marks import error_key
from fedskew.experiment.config_parsing import NAMED_SECTIONS, apply_overrides

#: named sections a grid key may be scoped to, and the registry kind that lists their names
SCOPES = {("algorithm",): "algorithms", ("model",): "models", ("data", "partition"): "partitions"}
_UNKNOWN = re.compile(r"config key '[^']+': unknown (?:option|hyper-parameter|key)\b")


@dataclass(frozen=True)
class Axis:
    """One ``--grid`` key: as typed, its values, the config key it sets and the object it is scoped to."""

    key: str
    values: tuple[str, ...]
    target: str
    section: tuple[str, ...] | None = None
    scope: str | None = None

    def applies(self, preview: dict[str, Any]) -> bool:
        """Whether a run whose raw config (overrides applied) is ``preview`` takes this axis."""
        return self.section is None or section_name(preview, self.section) == self.scope


def registered(kind: str) -> list[str]:
    """The registered names of a scope's registry (importing the packages registers them)."""
    from fedskew import algorithms as _algorithms  # noqa: F401  (registers)
    from fedskew import data as _data  # noqa: F401
    from fedskew import models as _models  # noqa: F401
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.data.base import PARTITIONERS
    from fedskew.models.base import MODELS

    return {"algorithms": ALGORITHMS, "models": MODELS, "partitions": PARTITIONERS}[kind].names()


def scope_axis(key: str, values: list[str]) -> Axis:
    """The :class:`Axis` of a grid key; a scope that is a near miss of a registered name is refused."""
    parts = key.split(".")
    for section, kind in SCOPES.items():
        n = len(section)
        if tuple(parts[:n]) != section or len(parts) < n + 2:
            continue
        names = registered(kind)
        if parts[n] in names:
            target = ".".join((*section, *parts[n + 1 :]))
            return Axis(key, tuple(values), target, section, parts[n])
        hint = did_you_mean(parts[n], names)
        if hint:
            raise ConfigError(
                f"--grid '{key}': '{parts[n]}' is not a registered {kind[:-1]}{hint}; a scoped key reads "
                f"{'.'.join(section)}.<name>.<key>"
            )
    return Axis(key, tuple(values), key)


def section_name(raw: dict[str, Any], section: tuple[str, ...]) -> Any:
    """The name a raw config's named section has (its default when the section omits it)."""
    node: Any = raw
    for part in section:
        node = node.get(part) if isinstance(node, dict) else None
    default = NAMED_SECTIONS[section][1]
    return node.get("name", default) if isinstance(node, dict) else default


def preview(data: Any, overrides: list[str]) -> dict[str, Any]:
    """A raw config with overrides applied (quietly: the run's own build logs its notes)."""
    raw = copy.deepcopy(data) if isinstance(data, dict) else {}
    apply_overrides(raw, overrides, notes=False)
    return raw


def skip_reason(err: ConfigError, point: list[tuple[Axis, str]]) -> tuple[str, str] | None:
    """Why a grid point is skipped rather than failed, and the grid key to blame: a key of an object's
    options that the grid point sets and the run's object does not have (``None``: a real error, which
    fails the sweep)."""
    key = error_key(err)
    if key is None or _UNKNOWN.search(str(err)) is None:
        return None
    for axis, _ in point:
        named = next((s for s in NAMED_SECTIONS if axis.target.startswith(".".join(s) + ".")), None)
        if named is not None and (key == axis.target or key.startswith(axis.target + ".")):
            hint = ""
            if axis.section is None and named in SCOPES:
                rest = axis.target[len(".".join(named)) + 1 :]
                hint = f"; to give it only to runs that have it: --grid {'.'.join(named)}.<name>.{rest}=..."
            return f"{err}{hint}", axis.key
    return None


def check_axes_used(axes: list[Axis], used: set[str], skips: dict[str, str]) -> None:
    """Refuse a grid key that no planned run took: a scope no run has, or a key every run skipped."""
    for axis in axes:
        if axis.key in used:
            continue
        if axis.section is None or axis.key in skips:
            why = skips.get(axis.key) or next(iter(skips.values()), "every run of it was skipped")
            raise ConfigError(f"--grid '{axis.key}': no run of the sweep can take it: {why}")
        where = f"{'.'.join(axis.section or ())}.name={axis.scope}"
        raise ConfigError(f"--grid '{axis.key}': no run of the sweep has {where}; a typo?")
