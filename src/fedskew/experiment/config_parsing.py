"""A raw config's text handling: ``--set`` overrides (:func:`apply_overrides`, :func:`set_dotted`) and
pydantic's validation errors as one line naming the key and what is allowed (:func:`format_validation_error`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import yaml
from pydantic import BaseModel, ValidationError

from fedskew.errors import ConfigError, did_you_mean

log = logging.getLogger("fedskew.config")

#: sections whose other keys are options of the object their ``name`` picks (a partition scheme's, a
#: model's, an algorithm's, a backbone's or generator's): path -> (the section's own keys, kept when the
#: name changes; the name a section without ``name`` has). ``attack`` and ``defence`` are not here: their
#: keys are one flat schema valid under every name, so no key of theirs is refused after a switch.
NAMED_SECTIONS: dict[tuple[str, ...], tuple[frozenset[str], str | None]] = {
    ("data", "partition"): (frozenset({"name"}), None),  # a partition without a name is refused
    ("model",): (frozenset({"name", "per_client"}), "mlp_mpfedcl"),
    ("algorithm",): (frozenset({"name"}), "fedavg"),  # AlgorithmConfig holds nothing but the name
    ("data", "vision_language", "backbone"): (frozenset({"name"}), None),
    ("data", "vision_language", "generator"): (frozenset({"name"}), None),
}


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


def validation_error(err: ValidationError, model: type[BaseModel]) -> ConfigError:
    """:func:`format_validation_error` as a :class:`ConfigError` that carries its dotted key."""
    key = ".".join(str(p) for p in err.errors()[0]["loc"]) or None
    return ConfigError(format_validation_error(err, model), key=key)


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


def parse_assignment(assignment: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (``["a", "b", "c"]``, the value parsed as YAML: numbers, lists, ...)."""
    if "=" not in assignment:
        raise ConfigError(f"--set '{assignment}': expected key=value, e.g. client.lr=0.05")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set '{assignment}': empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def set_dotted(cfg: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (numbers, lists, ...)."""
    parts, value = parse_assignment(assignment)
    node = cfg
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(
                f"--set '{'.'.join(parts)}': '{part}' holds {nxt!r}, not a section; expected a mapping of "
                "keys there"
            )
        node = nxt
    node[parts[-1]] = value


def apply_overrides(cfg: dict[str, Any], overrides: Sequence[str], notes: bool = True) -> None:
    """Apply ``--set`` overrides in order, in place. Setting a :data:`NAMED_SECTIONS` section's ``name`` to
    another name first drops the old object's options from the section (the new object would refuse them,
    or give the same key another meaning), except those the same list sets; ``notes``: log one line naming
    the dropped keys. Why: ``--set data.partition.name=iid`` on a Dirichlet config means "this partition
    instead", not "iid with Dirichlet's alpha"."""
    parsed = [(a, *parse_assignment(a)) for a in overrides]
    written = {".".join(parts) for _, parts, _ in parsed}
    switches = {tuple(parts[:-1]): (a, v) for a, parts, v in parsed if parts[-1] == "name"}
    for path, (assignment, name) in switches.items():
        if path in NAMED_SECTIONS:
            _switch(cfg, path, name, written, assignment if notes else None)
    for assignment, _, _ in parsed:
        set_dotted(cfg, assignment)


def _switch(
    cfg: dict[str, Any], path: tuple[str, ...], name: Any, written: set[str], note: str | None
) -> None:
    section: Any = cfg
    for part in path:
        section = section.get(part) if isinstance(section, dict) else None
    keep, default = NAMED_SECTIONS[path]
    if not isinstance(section, dict) or section.get("name", default) in (None, name):
        return
    old, dotted = section.get("name", default), ".".join(path)
    gone = [k for k in section if k not in keep]
    for k in gone:
        del section[k]
    dropped = [f"{dotted}.{k}" for k in gone if f"{dotted}.{k}" not in written]
    if note is not None and dropped:
        log.warning(
            "--set %s: dropped %s (options of %s '%s'); set them in the same --set list to keep them",
            note, ", ".join(dropped), path[-1], old,
        )  # fmt: skip
