"""Name -> object registries: dispatch without if/elif ladders.

Registry names are public API (configs and the CLI use them).
"""

from __future__ import annotations

import contextlib
import inspect
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

from fedskew.errors import ConfigError, did_you_mean

T = TypeVar("T")

#: one entry per plugin being loaded now (innermost last): its label and what it registered, as
#: ``(registry, name, object)`` (fedskew.plugins records them to make a second load of a plugin a no-op)
_LOADING: list[tuple[str, list[tuple[Registry[Any], str, Any]]]] = []


@contextlib.contextmanager
def loading(source: str) -> Iterator[list[tuple[Registry[Any], str, Any]]]:
    """Inside the block, registrations are attributed to ``source`` (a plugin's one-line label, named in a
    collision error) and collected in the yielded list."""
    added: list[tuple[Registry[Any], str, Any]] = []
    _LOADING.append((source, added))
    try:
        yield added
    finally:
        _LOADING.pop()


def _source_of(obj: object) -> str:
    """Where a registration comes from: the plugin being loaded, else the object's module."""
    if _LOADING:
        return _LOADING[-1][0]
    module = str(getattr(obj, "__module__", "?"))
    return "fedskew (built-in)" if module.split(".")[0] == "fedskew" else f"module '{module}'"


class Registry(Generic[T]):
    """A named collection of factories (classes or functions) with one-line docs and, per name, where it
    was registered from (a built-in, a plugin: fedskew.plugins)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._sources: dict[str, str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``. A name taken already (by a built-in, another plugin)
        is refused with one :class:`ConfigError` naming both sources: a plugin never shadows a built-in."""

        def deco(obj: T) -> T:
            self.add(name, obj, _source_of(obj))
            if _LOADING:
                _LOADING[-1][1].append((self, name, obj))
            return obj

        return deco

    def add(self, name: str, obj: T, source: str) -> None:
        """Register ``obj`` under ``name``, attributed to ``source``; re-adding the very same object under
        its name is a no-op (a plugin loaded again)."""
        if name in self._items:
            if self._items[name] is obj:
                return
            raise ConfigError(
                f"{self.kind} '{name}' from {source} collides with the {self.kind} '{name}' from "
                f"{self.source(name)}; rename one of them (registry names are unique)"
            )
        self._items[name] = obj
        self._sources[name] = source

    def discard(self, name: str, obj: T) -> None:
        """Remove ``name`` if ``obj`` is what it names (a plugin that failed half-way is undone)."""
        if self._items.get(name) is obj:
            del self._items[name]
            self._sources.pop(name, None)

    def source(self, name: str) -> str:
        """Where ``name`` was registered from (``fedskew (built-in)``, a plugin's label, a module)."""
        return self._sources.get(name, "fedskew (built-in)")

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name (a list or mapping in a config)
            valid = ", ".join(sorted(self._items))
            raise ConfigError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, self._items)}; valid: {valid}"
            ) from None

    @contextlib.contextmanager
    def replaced(self, name: str, obj: T) -> Iterator[None]:
        """Serve ``obj`` under ``name`` inside the ``with`` block (tests, plugins that wrap a built-in)."""
        before = self._items.get(name)
        self._items[name] = obj
        try:
            yield
        finally:
            if before is None:
                del self._items[name]
            else:
                self._items[name] = before

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Whatever is registered inside the ``with`` block is forgotten on exit (tests running examples)."""
        before, sources = dict(self._items), dict(self._sources)
        try:
            yield
        finally:
            self._items.clear()
            self._items.update(before)
            self._sources.clear()
            self._sources.update(sources)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)

    def summary(self, name: str) -> str:
        """First line of the registered object's ``doc`` string (a declared entry: runtimes) or docstring."""
        obj = self._items[name]
        declared = getattr(obj, "doc", None)
        doc = declared if isinstance(declared, str) else inspect.getdoc(obj) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""

    def items(self) -> list[tuple[str, str]]:
        """``[(name, one-line doc), ...]`` sorted by name."""
        return [(n, self.summary(n)) for n in self.names()]


def option_names(
    fn: Callable[..., object], skip: int = 0, reserved: frozenset[str] = frozenset()
) -> list[str]:
    """The keyword options ``fn`` accepts (its signature after the first ``skip`` parameters, minus
    ``reserved`` names the caller fills in itself); follows ``functools.wraps`` to the real signature."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    return [
        p.name
        for p in params
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in reserved
    ]


def check_options(
    fn: Callable[..., object],
    options: Mapping[str, object],
    subject: str,
    skip: int = 0,
    reserved: frozenset[str] = frozenset(),
) -> None:
    """Reject options ``fn`` does not accept in one line: ``subject`` (a template with ``{key}``, e.g.
    ``"config key 'model.{key}': unknown option"``), a did-you-mean and the allowed names. A ``**kwargs``
    signature accepts anything. The one option validator of configs, model factories and dataset loaders."""
    if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
        return
    allowed = option_names(fn, skip, reserved)
    for key in options:
        if key not in allowed:
            names = ", ".join(allowed) or "(none)"
            raise ConfigError(f"{subject.format(key=key)}{did_you_mean(key, allowed)}; allowed: {names}")
    check_option_types(fn, options, subject)


def check_option_types(fn: Callable[..., object], options: Mapping[str, object], subject: str) -> None:
    """Reject option values that do not fit ``fn``'s annotations (a string where a number is expected, a
    value out of an annotated range, ...) in one line; options without a usable annotation pass."""
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # an annotation that cannot be resolved: the function checks its own inputs
        return
    for key, value in options.items():
        if key not in hints:
            continue
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(hints[key])
        except Exception:  # an annotation pydantic has no schema for (arrays, callables)
            continue
        head, _, _ = subject.format(key=key).partition(": ")
        where = head if f"{key}'" in head else f"{head}: option '{key}'"
        try:
            out = adapter.validate_python(value)
        except ValidationError as err:
            msg = err.errors()[0]["msg"]
            raise ConfigError(f"{where}: {msg} (got {value!r})") from None
        if isinstance(value, str) and not isinstance(out, str):
            raise ConfigError(f"{where}: expected {type(out).__name__}, not a string (got {value!r})")
