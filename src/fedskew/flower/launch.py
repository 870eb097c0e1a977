"""Run a config on a Flower runtime: ``flower-simulation`` (Flower's simulation runtime, in this process;
its virtual SuperNodes' actors on a local Ray instance, or on an existing Ray cluster named by
``engine.ray_address`` or ``$RAY_ADDRESS``) or ``flower-deployment`` (a SuperLink and ``engine.nodes``
SuperNodes on loopback, torn down at the end)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.config import Config
from fedskew.flower import require_flwr
from fedskew.settings import host_port

if TYPE_CHECKING:
    from fedskew.flower.apps import Job

#: a runtime's launch function (fedskew.runtimes.Runtime.launch)
Launch = Callable[..., dict[str, Any]]


def run_flower(
    cfg: Config, out: str | Path | None, *, resume: bool = False, force: bool = False
) -> dict[str, Any]:
    """Run ``cfg`` on its ``engine.runtime`` (a Flower one: :data:`fedskew.runtimes.RUNTIMES`) and return the
    summary (results files in ``out``; Flower's own log in ``out/flower.log``, :mod:`fedskew.flower.logs`)."""
    from fedskew.runtimes import RUNTIMES

    return RUNTIMES.get(cfg.engine.runtime).start(cfg, out, resume=resume, force=force)


def _in_flower_log(runner: Callable[[Config, str | Path | None, bool, bool], dict[str, Any]]) -> Launch:
    """``runner`` with flwr required first and Flower's log sent to ``out/flower.log`` (not the console)."""

    def launch(cfg: Config, out: str | Path | None, *, resume: bool = False, force: bool = False) -> Any:
        require_flwr()
        from fedskew.flower.logs import FLOWER_LOG, flower_log

        if out is None:
            return runner(cfg, out, resume, force)
        with flower_log(Path(out) / FLOWER_LOG):
            return runner(cfg, out, resume, force)

    launch.__doc__ = runner.__doc__
    return launch


def _deployment(cfg: Config, out: str | Path | None, resume: bool, force: bool) -> dict[str, Any]:
    """A SuperLink and ``engine.nodes`` SuperNodes on loopback (:mod:`fedskew.flower.deploy`)."""
    from fedskew.flower.deploy import run_deployment

    return run_deployment(cfg, out, resume, force)


def run_simulation(cfg: Config, out: str | Path | None, resume: bool, force: bool) -> dict[str, Any]:
    """Flower's simulation runtime: ``engine.nodes`` virtual SuperNodes, one CPU each, in Ray actors."""
    from fedskew.flower.apps import Job

    return simulate([Job(cfg, out, resume, force)])[0]


#: the entries' launch functions (``engine.runtime`` flower-simulation and flower-deployment)
launch_simulation = _in_flower_log(run_simulation)
launch_deployment = _in_flower_log(_deployment)


def simulate(jobs: list[Job]) -> list[dict[str, Any]]:
    """Run ``jobs`` in turn in one Flower simulation (one Ray start-up); their summaries. The jobs share
    the virtual SuperNodes, so they must agree on ``engine.nodes``."""
    import flwr.simulation

    from fedskew.flower.apps import client_app, make_server_app

    nodes = {job.cfg.engine.nodes for job in jobs}
    if len(nodes) != 1:
        raise ConfigError(f"engine.nodes differs between the simulated jobs ({sorted(nodes)})")
    addresses = {job.cfg.engine.ray_address for job in jobs}
    if len(addresses) != 1:
        raise ConfigError(
            f"engine.ray_address differs between the simulated jobs ({sorted(map(str, addresses))})"
        )
    results: list[dict[str, Any]] = []
    flwr.simulation.run_simulation(
        server_app=make_server_app(jobs, results),
        client_app=client_app,
        num_supernodes=nodes.pop(),
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": ray_init_args(addresses.pop()),
        },
    )
    for res in results:
        if "error" in res:
            raise res["error"]
    if len(results) != len(jobs):
        raise FedskewError("the Flower simulation ended before its ServerApp finished")
    return results


def ray_init_args(configured: str | None) -> dict[str, Any]:
    """The ``ray.init`` arguments Flower's Ray backend is given (``backend_config["init_args"]``): the Ray
    cluster ``configured`` (``engine.ray_address``), else ``$RAY_ADDRESS``, checked reachable first (Ray
    itself would retry for a minute and fail inside Flower's runtime thread); with neither, ``"local"``: a
    Ray instance of this run's own, never a cluster that ``ray start`` left running on this machine."""
    args: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "address": "local"}
    env = os.environ.get("RAY_ADDRESS", "").strip()
    source, address = ("engine.ray_address", configured) if configured else ("RAY_ADDRESS", env)
    if address:
        check_reachable(source, address)
        args["address"] = address.strip()
    return args


def check_reachable(source: str, address: str, timeout: float = 5.0) -> None:
    """A one-line :class:`ConfigError` unless ``address`` (``HOST:PORT``, named by ``source``) accepts a TCP
    connection within ``timeout`` seconds."""
    try:
        host, port = host_port(address)
    except ValueError as err:
        raise ConfigError(f"{source}={address!r}: {err}") from None
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(
            f"{source}={address!r}: no Ray cluster reachable there ({reason}); start its head with "
            f"`ray start --head --port {port}`, or unset {source} to run on a local Ray instance"
        ) from None
