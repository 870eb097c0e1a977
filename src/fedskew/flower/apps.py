"""The generic Flower apps: ``client_app`` and ``server_app`` run every registered algorithm unchanged.

``flwr run`` finds them through the app's ``pyproject.toml`` (``fedskew.flower.apps:client_app`` and
``fedskew.flower.apps:server_app``, see :mod:`fedskew.flower.launch`). The ``ServerApp`` reads its run
config: ``config`` (the path of a resolved fedskew YAML config, several separated by ``;``, or the YAML text
of one: :func:`run_config_jobs`), ``out`` (output folder), ``resume`` and ``force`` (booleans) and
``node-ids`` (the node indexes' authenticated Flower node ids: :mod:`fedskew.flower.identity`). The
simulation runtime builds its own ``ServerApp`` around an in-memory config with :func:`make_server_app`.

Importing this module imports flwr's app types only: Flower's deployment runtime starts a fresh
``flwr-clientapp`` process for every message, which imports this module first; the ServerApp's and the
handlers' own imports (torch, the engine) come with the first message that needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedskew.errors import FedskewError

if TYPE_CHECKING:
    from fedskew.experiment.config import Config


def _secure_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's ``secaggplus_mod`` around the messages of a secure round (``engine.secagg``), nothing around
    the others (:func:`fedskew.flower.secure.secure_mod`)."""
    from fedskew.flower.secure import secure_mod

    return secure_mod(msg, context, call_next)


client_app = ClientApp(mods=[_secure_mod])


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    from fedskew.flower.node import handle_train
    from fedskew.flower.secure import handle_secure_train, is_secure

    handle = handle_secure_train if is_secure(msg.content) else handle_train
    return Message(handle(msg.content, context), reply_to=msg)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    from fedskew.flower.node import handle_evaluate

    return Message(handle_evaluate(msg.content, context), reply_to=msg)


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    from fedskew.flower.node import handle_query

    return Message(handle_query(msg.content, context), reply_to=msg)


@dataclass(frozen=True)
class Job:
    """One experiment a ServerApp runs: the config, the output folder and the resume / force flags."""

    cfg: Config
    out: str | Path | None = None
    resume: bool = False
    force: bool = False
    #: node index -> the Flower node id authenticated for it (:mod:`fedskew.flower.identity`; empty: first
    #: claim)
    node_ids: Mapping[int, int] = field(default_factory=dict)


def make_server_app(jobs: list[Job], results: list[dict[str, Any]]) -> ServerApp:
    """A ``ServerApp`` running ``jobs`` in turn; their summaries are appended to ``results``, and an
    exception raised by one is appended too and ends the app (Flower's runtime would only log it)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for job in jobs:
            try:
                results.append(_serve(grid, job))
            except BaseException as err:
                results.append({"error": err})
                raise

    return app


def _serve(grid: Grid, job: Job) -> dict[str, Any]:
    from fedskew.flower.server import serve

    return serve(grid, job.cfg, job.out, job.resume, job.force, job.node_ids)


server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    """``flwr run``'s entry. Run config: ``config`` names the experiments, ``out`` their output folders (on
    the SuperLink host), ``resume``, ``force`` and ``node-ids`` apply to each (:func:`run_config_jobs`)."""
    for job in run_config_jobs(context.run_config):
        _serve(grid, job)


def run_config_jobs(rc: dict[str, Any]) -> list[Job]:
    """The experiments of a run config, run in turn on the same nodes (a sweep shares the start-up).

    ``config`` is either the YAML text of one resolved config (a value holding a line break: what
    ``fedskew flower-app`` writes, so that no file is needed on the SuperLink host) with ``out`` its output
    folder, or the paths of YAML config files on the SuperLink host separated by ``;`` with as many
    ``out`` folders, separated the same way. ``node-ids`` (``"index:node_id,..."``, optional) binds each node
    index to the Flower node id its registered key authenticates
    (:func:`~fedskew.flower.identity.parse_node_ids`)."""
    from fedskew.flower.identity import NODE_IDS_KEY, parse_node_ids

    config, out = str(rc["config"]), str(rc["out"])
    resume, force = bool(rc.get("resume", False)), bool(rc.get("force", False))
    bound = parse_node_ids(str(rc.get(NODE_IDS_KEY, "")))
    if "\n" in config:
        return [Job(config_from_text(config), out, resume, force, bound)]
    configs, outs = config.split(";"), out.split(";")
    if len(configs) != len(outs):
        raise FedskewError(f"run config: {len(configs)} configs but {len(outs)} output folders")
    from fedskew.experiment.config import load_config

    return [Job(load_config(path), o, resume, force, bound) for path, o in zip(configs, outs, strict=True)]


def config_from_text(text: str) -> Config:
    """A config from its YAML text (one-line :class:`ConfigError` on invalid YAML or values)."""
    import yaml

    from fedskew.errors import ConfigError
    from fedskew.experiment.config import build_config

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"run config 'config': invalid YAML ({str(err).splitlines()[0]})") from None
    return build_config(raw)
