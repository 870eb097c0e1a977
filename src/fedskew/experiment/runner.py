"""Run a config to completion, honouring the results contract (:mod:`fedskew.experiment.results`).

``resume=True`` continues from the checkpoint to the same metrics as an uninterrupted run: per-client
randomness is derived from ``(seed, round, client)``, not from a stream, and the checkpoint holds every
committed state. The run loop does not know which runtime it drives: it is handed an *assembler* that
builds the :class:`~fedskew.engine.loop.Simulation` (by default the embedded runtime,
:func:`fedskew.experiment.build.build_simulation`; the Flower ServerApp passes its own,
:func:`fedskew.flower.server.serve`).

The names tests, benchmarks and the CLI import from here (building, results files) are re-exported.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedskew import threads
from fedskew.data.federated import FederatedData
from fedskew.engine.device import deterministic_algorithms
from fedskew.engine.loop import Simulation
from fedskew.engine.states import STATES_DIR
from fedskew.errors import ConfigError, RunFailure
from fedskew.experiment import provenance
from fedskew.experiment.build import (
    build_data,
    build_simulation,
    model_builders,
    model_options,
    recorded_config,
    with_resolved_device,
)
from fedskew.experiment.config import Config, dump_config
from fedskew.experiment.data_warnings import warn_small_clients
from fedskew.experiment.results import (
    CHECKPOINT_FILE,
    CHECKPOINT_PREV,
    CONFIG_FILE,
    DIGEST_KEY,
    LOCK_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    append_line,
    jsonable,
    load_checkpoint,
    make_summary,
    output_lock,
    prepare_output,
    restore,
    save_checkpoint,
    tree_digest,
    write_atomic,
    write_metrics,
    write_text,
)
from fedskew.experiment.tracking import check_trackers, open_trackers

__all__ = [
    "CHECKPOINT_FILE", "CHECKPOINT_PREV", "CONFIG_FILE", "DIGEST_KEY", "LOCK_FILE", "METRICS_FILE",
    "SUMMARY_FILE", "Assembler", "build_data", "build_simulation", "load_checkpoint", "model_builders",
    "model_options", "output_lock", "recorded_config", "run_experiment", "tree_digest",
    "with_resolved_device", "write_atomic",
]  # fmt: skip

RoundCallback = Callable[[Simulation, dict[str, Any] | None], None]
#: ``assemble(cfg, states_dir)``: the simulation of a run; ``states_dir`` is where its client-state store
#: spills (``<out>/client-states``; ``None`` without an output folder)
Assembler = Callable[[Config, Path | None], Simulation]


def embedded(data: FederatedData | None = None) -> Assembler:
    """The embedded runtime's assembler, over ``data`` (``None``: the config's)."""

    def assemble(cfg: Config, states_dir: Path | None) -> Simulation:
        return build_simulation(cfg, data, states_dir)

    return assemble


def run_experiment(
    cfg: Config,
    out: str | Path | None = None,
    *,
    resume: bool = False,
    force: bool = False,
    on_round: RoundCallback | None = None,
    data: FederatedData | None = None,
    assemble: Assembler | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` to completion (writing the results files when ``out`` is given) and return the summary.

    ``assemble`` builds the simulation once the output folder is ready; by default the embedded runtime
    over ``data`` (``None``: built from the config)."""
    if assemble is None:
        if cfg.engine.runtime != "embedded":  # refused before the output folder is touched
            raise ConfigError(
                f"engine.runtime={cfg.engine.runtime} runs through fedskew.flower.run_flower (`fedskew run` "
                "does this); allowed here: embedded"
            )
        assemble = embedded(data)
    check_trackers(cfg.log)
    given, cfg = cfg, recorded_config(cfg)
    out_dir = Path(out) if out is not None else None
    with (
        output_lock(out_dir) if out_dir is not None else contextlib.nullcontext(),
        deterministic_algorithms(cfg.engine.deterministic),
    ):
        ckpt = prepare_output(out_dir, cfg, resume, force) if out_dir is not None else None
        if ckpt is not None:
            _keep_threads(cfg, ckpt)
        sim = assemble(cfg, out_dir / STATES_DIR if out_dir is not None else None)
        warn_small_clients(cfg, sim.algorithm.ctx.client_sizes.tolist())  # once per run, every runtime
        prov = provenance.for_run(given, cfg.engine.device, ckpt)  # after assembly: the threads it set
        return _run(cfg, sim, out_dir, ckpt, on_round, prov)


def _keep_threads(cfg: Config, ckpt: dict[str, Any]) -> None:
    """A resume under ``engine.threads: auto`` (and no ``OMP_NUM_THREADS``) trains with the threads the
    run started with (:func:`fedskew.experiment.provenance.recorded_threads`): exact resume."""
    earlier = provenance.recorded_threads(ckpt.get("provenance"))
    if cfg.engine.threads == threads.AUTO and threads.env_threads() is None and earlier is not None:
        threads.apply_threads(earlier, "resumed")


def _run(
    cfg: Config,
    sim: Simulation,
    out_dir: Path | None,
    ckpt: dict[str, Any] | None,
    on_round: RoundCallback | None,
    prov: dict[str, Any] | None = None,
) -> dict[str, Any]:
    elapsed0 = 0.0
    if ckpt is not None:
        restore(sim, ckpt)  # crafted content: one line, never a traceback
        elapsed0 = float(ckpt.get("wall_seconds", 0.0))
    if out_dir is not None:
        write_text(out_dir / CONFIG_FILE, dump_config(cfg))
        write_metrics(out_dir, sim.history)
    trackers = open_trackers(cfg, out_dir, resumed_at=sim.round)  # after the results files: never before
    t0 = time.perf_counter()
    every = cfg.checkpoint.every
    try:
        while sim.round < cfg.rounds:
            outcome = sim.run_round()
            if out_dir is not None:
                if outcome.record is not None:
                    line = json.dumps({k: jsonable(v) for k, v in outcome.record.items()}) + "\n"
                    append_line(out_dir / METRICS_FILE, line)
                if every and sim.round % every == 0 and sim.round < cfg.rounds:
                    save_checkpoint(sim, out_dir, elapsed0 + time.perf_counter() - t0, prov)
            if outcome.record is not None:
                trackers.log_round(outcome.record)
            if on_round is not None:
                on_round(sim, outcome.record)
    except BaseException:
        # The simulation commits whole rounds only, so its state is consistent: keep the progress.
        if out_dir is not None and sim.round > 0:
            with contextlib.suppress(RunFailure):  # disk full: the last checkpoint written stays the one
                save_checkpoint(sim, out_dir, elapsed0 + time.perf_counter() - t0, prov)
        trackers.close(None)  # stopped early: each tracker closes its run as not finished
        raise
    finally:
        sim.close()
    wall = elapsed0 + time.perf_counter() - t0
    final = make_summary(cfg, sim, wall, prov)
    if out_dir is not None:
        save_checkpoint(sim, out_dir, wall, prov)
        write_text(out_dir / SUMMARY_FILE, json.dumps(final, indent=2) + "\n")
    trackers.close(final)
    return final
