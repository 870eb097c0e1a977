"""Name -> object registries: dispatch without if/elif ladders.

Registry names are public API (configs and the CLI use them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from fedskew.errors import ConfigError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of factories (classes or functions) with one-line docs."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items))
            raise ConfigError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, self._items)}; valid: {valid}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)

    def summary(self, name: str) -> str:
        """First line of the docstring of the registered object."""
        doc = inspect.getdoc(self._items[name]) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""

    def items(self) -> list[tuple[str, str]]:
        """``[(name, one-line doc), ...]`` sorted by name."""
        return [(n, self.summary(n)) for n in self.names()]
