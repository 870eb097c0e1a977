"""Where a federation runs (``engine.runtime``): a registry of runtimes, each declaring what its callers
need, so the CLI, the thread policy and the config checks ask the entry instead of comparing names.

A runtime's ``launch`` is a callable or a ``"module:function"`` reference, imported only when the runtime is
used: the entries sit at the bottom layer (the config checks read them) while the code they start lives in
the experiment and Flower layers. ``launch(cfg, out, resume=..., force=..., on_round=...)`` returns the run's
summary; ``on_round`` is passed only to ``in_process`` runtimes (the others report no rounds here).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedskew.registry import Registry
from fedskew.settings import EngineSection
from fedskew.threads import run_processes

__all__ = ["RUNTIMES", "Runtime", "engine_processes", "register_runtime"]


@dataclass(frozen=True)
class Runtime:
    """One way of running a federation; ``doc`` is its line in ``fedskew list``."""

    doc: str
    #: what runs it: ``launch(cfg, out, *, resume, force[, on_round])`` -> summary; or "module:function"
    launch: Callable[..., dict[str, Any]] | str
    #: the clients are trained by this process (and its engine workers) and every round is reported to an
    #: ``on_round`` callback: the CLI shows a live progress bar; ``False``: other processes run the rounds
    in_process: bool
    #: processes the run starts on this machine (the thread policy divides the free cores by it)
    processes: Callable[[EngineSection], int]
    #: the module the runtime needs beyond fedskew's core and the extra installing it, or ``None``
    needs: tuple[str, str] | None = None
    #: ``data.source: nodes`` reads every node's data root on the node itself (no engine-side roots)
    node_local_roots: bool = False
    #: (what to call it, its file in the run folder): where the runtime's own log goes, printed by the CLI
    log: tuple[str, str] | None = None

    def resolve(self) -> Callable[..., dict[str, Any]]:
        """The launch function (imported on first use when given as ``"module:function"``)."""
        if callable(self.launch):
            return self.launch
        module, _, attr = self.launch.partition(":")
        fn: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module), attr)
        return fn

    def start(
        self, cfg: Any, out: Any, *, resume: bool = False, force: bool = False, on_round: Any = None
    ) -> dict[str, Any]:
        """Run ``cfg`` on this runtime and return its summary."""
        extra = {"on_round": on_round} if self.in_process else {}
        return self.resolve()(cfg, out, resume=resume, force=force, **extra)


#: name -> Runtime (``engine.runtime``); plugins add theirs (entry-point group ``fedskew.runtimes``)
RUNTIMES: Registry[Runtime] = Registry("runtime")


def register_runtime(name: str, runtime: Runtime) -> Runtime:
    """Add ``runtime`` under ``name`` (a plugin's call; a taken name is refused with one line)."""
    return RUNTIMES.register(name)(runtime)


def _embedded_processes(engine: EngineSection) -> int:
    return run_processes(engine.workers)


def engine_processes(engine: EngineSection) -> int:
    """Processes a run of ``engine`` starts on this machine, as its runtime's entry declares: the main one and
    its workers (embedded), or the main one and ``engine.nodes`` SuperNodes (Flower runtimes)."""
    return RUNTIMES.get(engine.runtime).processes(engine)


def _flower_processes(engine: EngineSection) -> int:
    return 1 + engine.nodes  # the ServerApp's process and one per SuperNode


register_runtime(
    "embedded",
    Runtime(
        "this process (and its engine.workers processes) trains, aggregates and evaluates",
        "fedskew.experiment.runner:run_experiment",
        in_process=True,
        processes=_embedded_processes,
    ),
)
register_runtime(
    "flower-simulation",
    Runtime(
        "Flower's simulation runtime: engine.nodes virtual SuperNodes in Ray actors (the [flower] extra)",
        "fedskew.flower.launch:launch_simulation",
        in_process=False,
        processes=_flower_processes,
        needs=("flwr", "flower"),
        log=("Flower's own log", "flower.log"),
    ),
)
register_runtime(
    "flower-deployment",
    Runtime(
        "a local Flower SuperLink and engine.nodes SuperNodes on loopback (the [flower] extra)",
        "fedskew.flower.launch:launch_deployment",
        in_process=False,
        processes=_flower_processes,
        needs=("flwr", "flower"),
        node_local_roots=True,
        log=("Flower's own log", "flower.log"),
    ),
)
