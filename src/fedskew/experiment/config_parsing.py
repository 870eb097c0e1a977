"""A raw config's text handling: ``--set`` overrides (:func:`set_dotted`) and pydantic's validation errors as
one line naming the key and what is allowed (:func:`format_validation_error`)."""

from __future__ import annotations

from typing import Any, cast

import yaml
from pydantic import BaseModel, ValidationError

from fedskew.errors import ConfigError, did_you_mean


def _allowed_keys(model: type[BaseModel], path: tuple[str | int, ...]) -> list[str]:
    cur: Any = model
    for part in path[:-1]:
        field = cur.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        cur = ann
    return list(cur.model_fields)


def _description(model: type[BaseModel], path: tuple[str | int, ...]) -> str:
    cur: Any = model
    for part in path:
        field = (
            cast("type[BaseModel]", cur).model_fields.get(part)  # a model class where the path continues
            if isinstance(part, str) and isinstance(cur, type)
            else None
        )
        if field is None:
            return ""
        cur = field.annotation
        if part == path[-1]:
            return field.description or ""
        args = [a for a in getattr(cur, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
        cur = args[0] if args else cur
    return ""


def format_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    """The first error of ``err`` as one line: the dotted key, what was wrong, and the allowed keys or values
    (from the field descriptions of ``model``)."""
    e = err.errors()[0]
    loc = tuple(e["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    if e["type"] == "missing":
        what = _description(model, loc)
        return f"config key '{key}' is required{'; expected: ' + what if what else ''}"
    if e["type"] == "extra_forbidden":
        allowed = _allowed_keys(model, loc)
        hint = did_you_mean(str(loc[-1]), allowed)
        return f"config key '{key}': unknown key{hint}; allowed: {', '.join(allowed)}"
    msg = e["msg"]
    if e["type"] == "literal_error":
        msg = msg.replace("Input should be", "allowed:")
    return f"config key '{key}': {msg} (got {e.get('input')!r})"


def set_dotted(cfg: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (numbers, lists, ...)."""
    if "=" not in assignment:
        raise ConfigError(f"--set '{assignment}': expected key=value, e.g. client.lr=0.05")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set '{assignment}': empty key segment")
    node = cfg
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(
                f"--set '{key}': '{part}' holds {nxt!r}, not a section; expected a mapping of keys there"
            )
        node = nxt
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        node[parts[-1]] = raw
