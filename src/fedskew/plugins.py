"""Methods, datasets, models, executors and runtimes from outside the package.

Two ways in, both registering through the same decorators as fedskew's own code
(``@ALGORITHMS.register("name")`` ...):

* **a researcher's folder**: the config's ``plugins:`` key lists modules (``my_pkg.methods``, imported from
  ``sys.path``) or ``.py`` files (``my_method.py``; a relative path is under the config file's folder). The
  config records them resolved, so ``--resume``, sweep workers and Flower nodes load the same file;
* **an installed package**: an entry point in the group of the registry it adds to (:data:`GROUPS`), named
  by the registry name it registers, whose object is the *module* to import (its decorators register)::

      [project.entry-points."fedskew.algorithms"]
      fedavg_slr = "my_package.method"

  Every installed entry point is loaded before the first config is checked (a broken one is an error:
  what is installed is meant to run), and fedskew checks that importing it registered its name.

Wherever a config is built (``fedskew run``, sweeps and their worker processes, the Flower ServerApp and
ClientApp), :func:`fedskew.experiment.config.build_config` loads its plugins before checking the names it
uses. A name a built-in (or another plugin) has is refused with one line naming both sources; loading the
same plugin again in a process is a no-op; a plugin that fails to import is one line naming it and the error
(the CLI: exit 2). docs/decisions.md, "plugins", says why modules rather than callables.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from fedskew.errors import ConfigError
from fedskew.registry import Registry, loading

__all__ = ["GROUPS", "load_entry_points", "load_plugin", "load_plugins", "prepare", "resolve_plugins"]

#: entry-point group -> the registry it adds to, as "module:attribute" (imported when plugins load; adding
#: a registry to the plugin surface is one line here)
GROUPS: dict[str, str] = {
    "fedskew.algorithms": "fedskew.algorithms.base:ALGORITHMS",
    "fedskew.datasets": "fedskew.data.base:DATASETS",
    "fedskew.partitioners": "fedskew.data.base:PARTITIONERS",
    "fedskew.models": "fedskew.models.base:MODELS",
    "fedskew.executors": "fedskew.engine.executors:EXECUTORS",
    "fedskew.runtimes": "fedskew.runtimes:RUNTIMES",
    "fedskew.backbones": "fedskew.models.backbones:BACKBONES",
    "fedskew.generators": "fedskew.data.generators:GENERATORS",
    "fedskew.attacks": "fedskew.algorithms.security.rules:ATTACKS",
    "fedskew.defences": "fedskew.algorithms.security.rules:DEFENCES",
}
#: the packages whose import registers the built-ins: imported before any plugin, so that a plugin taking a
#: built-in's name is the one refused
BUILTIN_PACKAGES = ("fedskew.algorithms", "fedskew.data", "fedskew.models", "fedskew.engine.modes")
#: a module name as ``plugins:`` accepts it
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

#: what each loaded plugin registered, by key (a .py file's resolved path, a module's name)
_LOADED: dict[str, list[tuple[Registry[Any], str, Any]]] = {}
_state: dict[str, Any] = {"builtins": False, "entry_points": False, "failure": None}


def registry_of(group: str) -> Registry[Any]:
    """The registry an entry-point ``group`` adds to (:data:`GROUPS`)."""
    module, _, attr = GROUPS[group].partition(":")
    registry: Registry[Any] = getattr(importlib.import_module(module), attr)
    return registry


def prepare() -> None:
    """Register the built-ins, then every installed entry point (each once per process)."""
    if not _state["builtins"]:
        for package in BUILTIN_PACKAGES:
            importlib.import_module(package)
        for group in GROUPS:
            registry_of(group)
        _state["builtins"] = True
    load_entry_points()


def load_entry_points() -> None:
    """Import every installed entry point of :data:`GROUPS` (once per process) and check that each
    registered the name it is listed under."""
    if _state["failure"] is not None:  # a broken entry point fails every later call too (not a partial set)
        raise ConfigError(_state["failure"])
    if _state["entry_points"]:
        return
    try:
        _load_entry_points()
    except ConfigError as err:
        _state["failure"] = str(err)
        raise
    _state["entry_points"] = True


def _load_entry_points() -> None:
    for group in GROUPS:
        registry = registry_of(group)
        for ep in importlib.metadata.entry_points(group=group):
            dist = getattr(ep.dist, "name", None) or "?"
            label = f"entry point '{ep.name} = {ep.value}' ({group}, package {dist})"
            _load(ep.module, label, ep.load)
            if ep.name not in registry:
                raise ConfigError(
                    f"{label}: importing it registered no {registry.kind} '{ep.name}'; an entry point's "
                    f"name must be the name its module registers (registered: {', '.join(registry.names())})"
                )


def resolve_plugins(value: Any, base: Path | None) -> Any:
    """The ``plugins`` entries with ``.py`` paths made absolute (relative: under ``base``, else the working
    directory); a single string is a one-entry list. Anything else is returned for validation to refuse."""
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list):
        return value
    folder = base if base is not None else Path.cwd()
    out: list[Any] = []
    for entry in entries:
        if isinstance(entry, str) and entry.endswith(".py"):
            path = Path(entry).expanduser()
            entry = str((path if path.is_absolute() else folder / path).resolve())
        out.append(entry)
    return out


def load_plugins(specs: Sequence[str]) -> None:
    """:func:`prepare`, then load every entry of a config's ``plugins`` (:func:`load_plugin`)."""
    prepare()
    for spec in specs:
        load_plugin(spec)


def load_plugin(spec: str) -> None:
    """Load one ``plugins`` entry: a ``.py`` file (an absolute path: :func:`resolve_plugins`) or a module
    name. Loading it again is a no-op, and re-registers what it registered if a test's
    ``Registry.restored()`` forgot it."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(
                f"config key 'plugins': no file '{spec}'; allowed: a .py file (relative: under the config "
                "file's folder) or a module name"
            )
        _load(str(path.resolve()), f"plugin '{spec}'", lambda: _import_file(path.resolve()))
        return
    if not _MODULE.match(spec):
        raise ConfigError(
            f"config key 'plugins': {spec!r} is neither a .py file nor a module name; allowed: my_method.py, "
            "path/to/my_method.py or my_package.my_module"
        )
    _load(spec, f"plugin '{spec}'", lambda: importlib.import_module(spec))


def _load(key: str, label: str, do: Any) -> None:
    """Run ``do`` (an import) with its registrations attributed to ``label``; once per ``key``."""
    if key in _LOADED:
        _reinstate(_LOADED[key], label)
        return
    with loading(label) as added:
        try:
            do()
        except ConfigError:  # a collision (one line naming both sources) or the plugin's own config check
            _forget(added)
            raise
        except Exception as err:
            _forget(added)
            first = " ".join(str(err).split()) or "(no message)"
            raise ConfigError(f"{label} failed to load: {type(err).__name__}: {first}") from None
    _LOADED[key] = added


def _reinstate(added: Iterable[tuple[Registry[Any], str, Any]], label: str) -> None:
    for registry, name, obj in added:
        registry.add(name, obj, label)


def _forget(added: Iterable[tuple[Registry[Any], str, Any]]) -> None:
    """Undo a failed plugin's registrations (a corrected plugin can be loaded again in the process)."""
    for registry, name, obj in added:
        registry.discard(name, obj)


def module_name(path: Path) -> str:
    """The ``sys.modules`` name of a ``.py`` plugin: its stem plus a digest of its path, the same in every
    process (two files named alike stay apart; classes pickle by it)."""
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    return f"fedskew_plugin_{stem}_{digest}"


def _import_file(path: Path) -> ModuleType:
    name = module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load '{path}' as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up while it runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
