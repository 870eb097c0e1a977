"""Flat, dotted differences between two config mappings: what ``--resume`` names when a config changed, and
what provenance records as a run's difference from the defaults.

Why flat: a changed key is read and retyped as ``--set a.b.c=v``, so the diff speaks the same dotted keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["describe_diff", "flat_diff", "flatten"]


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty mappings stay values (an empty section is a
    value a user can set, so it is compared as one)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def flat_diff(
    old: Mapping[str, Any], new: Mapping[str, Any], missing: Any = None
) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old value, new value)}`` for every key whose value differs between two nested
    mappings, in sorted key order; a key present on one side only has ``missing`` on the other.

    General on purpose: ``flat_diff(defaults, config)`` is a config's difference from the defaults,
    ``flat_diff(saved, planned)`` what a resume would change."""
    a, b = flatten(old), flatten(new)
    marker = object()
    diff: dict[str, tuple[Any, Any]] = {}
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key, marker), b.get(key, marker)
        if x is marker or y is marker or not _same(x, y):
            diff[key] = (missing if x is marker else x, missing if y is marker else y)
    return diff


def _same(x: Any, y: Any) -> bool:
    """Equal values; ``1`` and ``1.0`` are one value (YAML and pydantic coerce them alike), ``True`` and
    ``1`` are not (a switch is not a count)."""
    return x == y and isinstance(x, bool) == isinstance(y, bool)


def describe_diff(diff: Mapping[str, tuple[Any, Any]], limit: int = 8) -> str:
    """``key: old -> new; ...`` on one line (at most ``limit`` keys, then how many more)."""
    parts = [f"{key}: {old!r} -> {new!r}" for key, (old, new) in list(diff.items())[:limit]]
    more = len(diff) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
