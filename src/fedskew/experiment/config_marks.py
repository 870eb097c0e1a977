"""Where a config key is written: ``file:line:column`` on the errors of a config file.

A YAML file is composed into PyYAML's node tree (every key and item carries the mark of where it starts)
and constructed from that same tree, so the data and the marks come from one parse. The marks are kept by
dotted key (``client.lr``, ``model.per_client.0-6.width``, ``data.nodes.roots.1``), the spelling pydantic's
error locations and fedskew's one-line errors use, so any :class:`ConfigError` raised while the config is
validated can be pointed at its line: the error's key (``ConfigError.key``, else the ``config key 'a.b'``
or leading ``a.b=`` of its message, else the registry whose name was unknown), or the nearest enclosing
section written in the file when the key itself is not (a required key left out). A key set by ``--set``
names that override instead. Why: an error that names the key but not the place costs a search through
the file, and in a merged or anchored YAML file the key may be written somewhere unexpected.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedskew.errors import ConfigError

#: keys recorded per file at most: marks only serve error messages, and an alias bomb (a few lines of
#: nested aliases standing for billions of keys) must not make reading them hang
MAX_MARKS = 100_000
_MERGE = "tag:yaml.org,2002:merge"
_CONFIG_KEY = re.compile(r"config key '([^']+)'")
_LEADING_KEY = re.compile(r"^([A-Za-z_][\w-]*(?:\.[\w-]+)*)(?:=|: )")
_UNKNOWN_NAME = re.compile(r"^unknown (.+?) '")
_Entry = tuple[str, yaml.Node, yaml.Node]  # a mapping entry: key, the node marking it, value
#: the key behind each registry's "unknown <kind> 'x'" error (fedskew.registry.Registry.get)
REGISTRY_KEYS = {
    "algorithm": "algorithm.name",
    "model": "model.name",
    "dataset": "data.dataset",
    "partition scheme": "data.partition.name",
    "backbone": "data.vision_language.backbone.name",
    "generator": "data.vision_language.generator.name",
    "executor": "engine.mode",
}


@dataclass(frozen=True)
class MarkedConfig:
    """A config file's mapping and where each of its keys is written (1-based line and column)."""

    path: Path
    data: Any
    marks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def place(self, key: str | None) -> str:
        """``file:line:col`` of ``key``, or of its nearest enclosing section in the file; ``file`` alone
        when none of it is written there."""
        while key:
            if key in self.marks:
                line, col = self.marks[key]
                return f"{self.path}:{line}:{col}"
            key = key.rpartition(".")[0]
        return str(self.path)


def read_marked(path: Path) -> MarkedConfig:
    """Read and parse a YAML config file with the marks of its keys; a YAML error names file:line:col."""
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        text = path.read_text(encoding="utf-8")  # universal newlines: Windows line ends count as one
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file '{path}': not UTF-8 ({err.reason}); expected a YAML mapping"
        ) from None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters first: a control character raises here
    except yaml.YAMLError as err:
        raise ConfigError(
            f"config file '{path}': invalid YAML ({str(err).splitlines()[0]}); expected a YAML mapping of "
            "printable text"
        ) from None
    marks: dict[str, tuple[int, int]] = {}
    try:
        node = loader.get_single_node()
        if node is not None:  # before construction, which flattens merge keys into the nodes
            _record(node, "", marks, path, set())
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = err.problem or err.context or "unreadable"
        raise ConfigError(f"{where}: invalid YAML ({what})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML ({str(err).splitlines()[0]})") from None
    finally:
        loader.dispose()
    return MarkedConfig(path, data, marks)


def _entries(node: yaml.MappingNode, path: Path, inside: frozenset[int] = frozenset()) -> list[_Entry]:
    """A mapping's entries after YAML merge keys (``<<: *base``), as (key, the node whose mark names it,
    value): explicit keys win over merged ones, an earlier merged mapping over a later one, and a merged
    key is marked at its ``<<`` line (where it entered this mapping). A key written twice is refused (YAML
    requires unique keys; PyYAML would silently keep the last one)."""
    explicit: dict[str, _Entry] = {}
    merged: list[tuple[yaml.Node, yaml.Node]] = []
    for key, value in node.value:
        if key.tag == _MERGE:
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            merged += [(key, source) for source in sources]
        elif isinstance(key, yaml.ScalarNode):  # a complex key is not addressable by a dotted key
            if key.value in explicit:
                m, first = key.start_mark, explicit[key.value][1].start_mark.line + 1
                raise ConfigError(
                    f"{path}:{m.line + 1}:{m.column + 1}: key '{key.value}' given twice in one mapping "
                    f"(first at line {first}); YAML keys must be unique"
                )
            explicit[key.value] = (str(key.value), key, value)
    out: dict[str, _Entry] = {}
    for at, source in reversed(merged):
        if isinstance(source, yaml.MappingNode) and id(source) not in inside:
            nested = _entries(source, path, inside | {id(node)})
            out.update({name: (name, at, value) for name, _, value in nested})
    out.update(explicit)
    return list(out.values())


def _record(
    node: yaml.Node, prefix: str, marks: dict[str, tuple[int, int]], path: Path, on: set[int]
) -> None:
    """Record the mark of every key and item under ``node`` (``on``: the nodes on the current path, so a
    recursive alias ends the walk)."""
    if id(node) in on or len(marks) >= MAX_MARKS:
        return
    if isinstance(node, yaml.MappingNode):
        children = _entries(node, path)
    elif isinstance(node, yaml.SequenceNode):
        children = [(str(i), v, v) for i, v in enumerate(node.value)]
    else:
        return
    on.add(id(node))
    for name, at, value in children:
        if len(marks) >= MAX_MARKS:
            break
        key = f"{prefix}.{name}" if prefix else name
        marks.setdefault(key, (at.start_mark.line + 1, at.start_mark.column + 1))
        _record(value, key, marks, path, on)
    on.discard(id(node))


def error_key(err: ConfigError) -> str | None:
    """The dotted config key an error is about: its ``key``, else the one its message names."""
    if err.key:
        return err.key
    text = str(err)
    for pattern in (_CONFIG_KEY, _LEADING_KEY):
        m = pattern.search(text)
        if m is not None:
            return m[1]
    m = _UNKNOWN_NAME.match(text)
    return REGISTRY_KEYS.get(m[1]) if m is not None else None


def override_for(key: str, overrides: Sequence[str]) -> str | None:
    """The last ``--set`` assignment that wrote ``key`` (or a section holding it)."""
    for assignment in reversed(overrides):
        target = assignment.partition("=")[0].strip()
        if key == target or key.startswith(target + "."):
            return assignment
    return None


def locate(err: ConfigError, doc: MarkedConfig | None, overrides: Sequence[str]) -> ConfigError:
    """``err`` prefixed with where its key was set: ``--set k=v`` or ``file:line:col`` (``file`` alone when
    the key is not written in it); unchanged when it already names its place or there is none to name."""
    text = str(err)
    if text.startswith("--set ") or (doc is not None and text.startswith(f"{doc.path}:")):
        return err
    key = error_key(err)
    where = override_for(key, overrides) if key else None
    if where is not None:
        where = f"--set {where}"
    elif doc is not None:
        where = doc.place(key)
    if where is None:
        return err
    return ConfigError(f"{where}: {text}", key=key)


@contextlib.contextmanager
def located(doc: MarkedConfig | None, overrides: Sequence[str] | None) -> Iterator[None]:
    """Re-raise a :class:`ConfigError` of the block with :func:`locate`'s place."""
    try:
        yield
    except ConfigError as err:
        raise locate(err, doc, overrides or ()) from None
