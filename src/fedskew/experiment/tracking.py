"""Live trackers: every evaluated round of a run sent to TensorBoard, MLflow and Weights & Biases.

``metrics.jsonl`` stays the source of truth. A tracker only reads what the run already computed (the
round's record, the resolved config, the summary), and each call into it is guarded: the first exception
a tracker raises (a full disk, an unreachable server, a library bug) becomes one warning, and that tracker
is dropped for the rest of the run. So a run's ``metrics.jsonl`` and ``summary.json`` are the same with or
without trackers, whatever they do (``tests/test_tracking.py``).

Each tracker is a registry entry (:data:`TRACKERS`), built from its ``log.<name>`` config section; the
libraries are the ``tracking`` extra and are imported only when a run asks for their tracker. A run is
named ``<group>/seed<k>``: ``group`` is the config's ``name`` (a sweep sets it to the run's folder under
``--out`` without the seed) or else the output folder's name, so a sweep's seeds of one configuration
share a group in each tracker (W&B ``group``, an MLflow tag, a TensorBoard folder).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedskew.errors import ConfigError
from fedskew.experiment.config import Config, LogSection, MlflowLog, WandbLog
from fedskew.experiment.config_diff import flatten as flatten_config
from fedskew.experiment.fairness import client_accuracies, client_fairness
from fedskew.registry import Registry

log = logging.getLogger("fedskew.tracking")


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker needs to open a run: its names, its folder and its resolved config."""

    group: str
    name: str
    out: Path | None
    config: dict[str, Any]
    resumed_at: int  # the round the run continues after (0: a fresh run)


class Tracker(Protocol):
    """One tracker's side of a run: opened once, a call per evaluated round, closed once."""

    def log_round(self, round_: int, scalars: dict[str, float], clients: list[float]) -> None: ...

    def close(self, summary: dict[str, Any] | None) -> None:
        """``summary``: the finished run's ``summary.json``; ``None`` when the run stopped early."""


class TrackerFactory(Protocol):
    #: the module the tracker needs (its extra), checked before the run starts
    requires: str

    def __call__(self, run: TrackedRun, section: Any) -> Tracker: ...


TRACKERS: Registry[TrackerFactory] = Registry("tracker")


def round_scalars(record: dict[str, Any]) -> tuple[dict[str, float], list[float]]:
    """A ``metrics.jsonl`` record as the finite scalars a tracker plots, plus the per-client accuracies
    (clients without test data left out) and the fairness summaries of those (``fairness.py``)."""
    scalars = {
        k: float(v)
        for k, v in record.items()
        if k != "round" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    clients = client_accuracies(record)
    if clients:
        scalars.update(client_fairness(clients))
    return scalars, clients


def run_names(cfg: Config, out: Path | None) -> tuple[str, str]:
    """``(group, name)`` of a run in every tracker."""
    group = cfg.name or (out.name if out is not None else cfg.algorithm.name)
    return group, f"{group}/seed{cfg.seed}"


class Trackers:
    """The trackers of one run, each guarded: a failure is one warning and the tracker is dropped."""

    def __init__(self, section: LogSection, run: TrackedRun) -> None:
        self._live: dict[str, Tracker] = {}
        for name in section.enabled():
            tracker = self._guarded(name, lambda n=name: TRACKERS.get(n)(run, getattr(section, n)))
            if tracker is not None:
                self._live[name] = tracker

    def _guarded(self, name: str, call: Any) -> Any:
        try:
            return call()
        except Exception as err:  # any failure of a tracker: never the run's
            log.warning(
                "tracker '%s' failed (%s: %s); the run goes on without it, metrics.jsonl is complete",
                name,
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
            )
            self._live.pop(name, None)
            return None

    def log_round(self, record: dict[str, Any]) -> None:
        scalars, clients = round_scalars(record)
        for name, tracker in list(self._live.items()):
            self._guarded(name, lambda t=tracker: t.log_round(int(record["round"]), scalars, clients))

    def close(self, summary: dict[str, Any] | None) -> None:
        for name, tracker in list(self._live.items()):
            self._guarded(name, lambda t=tracker: t.close(summary))
        self._live.clear()

    @property
    def names(self) -> list[str]:
        return sorted(self._live)


def check_trackers(section: LogSection) -> None:
    """Refuse, before anything runs, a tracker whose library is not installed (one line, the fix)."""
    for name in section.enabled():
        module = TRACKERS.get(name).requires
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"log.{name}: the '{module}' package is not installed; install the tracking extra "
                "(pip install 'fedskew[tracking]') or remove log." + name
            )


def open_trackers(cfg: Config, out: Path | None, resumed_at: int) -> Trackers:
    group, name = run_names(cfg, out)
    return Trackers(cfg.log, TrackedRun(group, name, out, cfg.to_dict(), resumed_at))


def _final_scalars(summary: dict[str, Any]) -> dict[str, float]:
    final = {
        k: float(v)
        for k, v in summary.get("final", {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    final.update(
        {k: float(summary[k]) for k in ("rounds", "wall_seconds", "bytes_up", "bytes_down") if k in summary}
    )
    return final


# ---------------------------------------------------------------------------- TensorBoard
class TensorBoardTracker:
    """Event files under ``<log.tensorboard>/<group>/seed<k>``: a scalar per metric and round, the
    per-client accuracies as a histogram, the resolved config as text, and the final metrics with the
    config's scalar values in TensorBoard's HParams view."""

    requires = "tensorboard"

    def __init__(self, run: TrackedRun, section: str) -> None:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        self._run = run
        self._writer = SummaryWriter(log_dir=str(Path(section) / run.group / f"seed{run.config['seed']}"))
        if run.resumed_at == 0:
            self._writer.add_text("config", "```\n" + yaml.safe_dump(run.config, sort_keys=False) + "```")

    def log_round(self, round_: int, scalars: dict[str, float], clients: list[float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, round_)
        if clients:
            self._writer.add_histogram("accuracy_clients", _as_array(clients), round_)
        self._writer.flush()

    def close(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            hparams = {k: _hparam(v) for k, v in flatten_config(self._run.config).items()}
            metrics = {f"final/{k}": v for k, v in _final_scalars(summary).items()}
            self._writer.add_hparams(hparams, metrics, run_name=".")
        self._writer.close()


def _as_array(values: list[float]) -> Any:
    import numpy as np

    return np.asarray(values, dtype=np.float64)


def _hparam(value: Any) -> bool | int | float | str:
    return value if isinstance(value, bool | int | float | str) else str(value)


TRACKERS.register("tensorboard")(TensorBoardTracker)


# ---------------------------------------------------------------------------- MLflow
class MlflowTracker:
    """An MLflow run in experiment ``log.mlflow.experiment`` at ``log.mlflow.uri``: the flattened config as
    params, a metric per key and round (step = round), tags ``fedskew.group`` / ``fedskew.out``; its status
    FINISHED, or KILLED when the run stopped early. Through ``MlflowClient`` (no global active run, so
    runs in one process never share state)."""

    requires = "mlflow"

    def __init__(self, run: TrackedRun, section: MlflowLog) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=section.uri)
        experiment = self._experiment_id(section.experiment)
        tags = {"fedskew.group": run.group, "fedskew.resumed_at": str(run.resumed_at)}
        if run.out is not None:
            tags["fedskew.out"] = str(run.out)
        self._run_id = self._client.create_run(experiment, run_name=run.name, tags=tags).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten_config(run.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self._client.log_batch(self._run_id, params=params[i : i + 100])

    def _experiment_id(self, name: str) -> str:
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(name))
        except Exception:  # created meanwhile by a parallel sweep worker
            again = self._client.get_experiment_by_name(name)
            if again is None:
                raise
            return str(again.experiment_id)

    def log_round(self, round_: int, scalars: dict[str, float], clients: list[float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, round_) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def close(self, summary: dict[str, Any] | None) -> None:
        from mlflow.entities import Metric

        if summary is not None:
            now, last = int(time.time() * 1000), int(summary.get("rounds", 0))
            final = [Metric(f"final.{k}", v, now, last) for k, v in _final_scalars(summary).items()]
            self._client.log_batch(self._run_id, metrics=final)
        self._client.set_terminated(self._run_id, "FINISHED" if summary is not None else "KILLED")


TRACKERS.register("mlflow")(MlflowTracker)


# ---------------------------------------------------------------------------- Weights & Biases
class WandbTracker:
    """A W&B run (offline by default: its files under ``log.wandb.dir`` or the run's folder, synced later
    with ``wandb sync``): the resolved config, a history row per round (step = round), the per-client
    accuracies as a histogram, the final metrics in the run's summary. W&B's console capture and system
    statistics are off (the run's own output is left alone)."""

    requires = "wandb"

    def __init__(self, run: TrackedRun, section: WandbLog) -> None:
        import wandb

        folder = section.dir or (str(run.out) if run.out is not None else None)
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        settings = wandb.Settings(console="off", x_disable_stats=True, save_code=False, silent=True)
        self._run = wandb.init(
            project=section.project,
            entity=section.entity,
            mode=section.mode,
            dir=folder,
            name=run.name,
            group=run.group,
            config=run.config,
            settings=settings,
            reinit="create_new",
        )

    def log_round(self, round_: int, scalars: dict[str, float], clients: list[float]) -> None:
        row: dict[str, Any] = dict(scalars)
        if clients:
            row["accuracy_clients"] = self._wandb.Histogram(clients)
        self._run.log(row, step=round_)

    def close(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            self._run.summary.update({f"final/{k}": v for k, v in _final_scalars(summary).items()})
        self._run.finish(exit_code=0 if summary is not None else 1)


TRACKERS.register("wandb")(WandbTracker)
