"""Run a config on a Flower runtime: ``flower-simulation`` (Flower's simulation runtime, in this process)
or ``flower-deployment`` (a SuperLink and ``engine.nodes`` SuperNodes on loopback, torn down at the end)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.config import Config
from fedskew.flower import require_flwr

if TYPE_CHECKING:
    from fedskew.flower.apps import Job


def run_flower(
    cfg: Config, out: str | Path | None, *, resume: bool = False, force: bool = False
) -> dict[str, Any]:
    """Run ``cfg`` on its ``engine.runtime`` and return the summary (results files in ``out``)."""
    require_flwr()
    if cfg.engine.runtime == "flower-simulation":
        return run_simulation(cfg, out, resume, force)
    from fedskew.flower.deploy import run_deployment

    return run_deployment(cfg, out, resume, force)


def run_simulation(cfg: Config, out: str | Path | None, resume: bool, force: bool) -> dict[str, Any]:
    """Flower's simulation runtime: ``engine.nodes`` virtual SuperNodes, one CPU each, in Ray actors."""
    from fedskew.flower.apps import Job

    return simulate([Job(cfg, out, resume, force)])[0]


def simulate(jobs: list[Job]) -> list[dict[str, Any]]:
    """Run ``jobs`` in turn in one Flower simulation (one Ray start-up); their summaries. The jobs share
    the virtual SuperNodes, so they must agree on ``engine.nodes``."""
    import flwr.simulation

    from fedskew.flower.apps import client_app, make_server_app

    nodes = {job.cfg.engine.nodes for job in jobs}
    if len(nodes) != 1:
        raise ConfigError(f"engine.nodes differs between the simulated jobs ({sorted(nodes)})")
    results: list[dict[str, Any]] = []
    flwr.simulation.run_simulation(
        server_app=make_server_app(jobs, results),
        client_app=client_app,
        num_supernodes=nodes.pop(),
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"include_dashboard": False, "log_to_driver": True},
        },
    )
    for res in results:
        if "error" in res:
            raise res["error"]
    if len(results) != len(jobs):
        raise FedskewError("the Flower simulation ended before its ServerApp finished")
    return results
