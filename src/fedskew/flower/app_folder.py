"""A standalone Flower app for one experiment (``fedskew flower-app``): the folder a Flower user submits
with ``flwr run FOLDER CONNECTION``.

``pyproject.toml`` names fedskew's generic apps as its components (``fedskew.flower.apps:server_app`` and
``client_app``), depends on the ``fedskew[flower]`` this folder was written with, and holds the experiment's
resolved config, as YAML text, in its run config (``[tool.flwr.app.config] config``): the ServerApp needs no
file on the SuperLink host, and the run config still takes a path there instead
(``--run-config "config='/srv/cfg.yaml'"``). ``README.md`` says how to run it. No fedskew source is copied:
fedskew is installed on the SuperLink host and on every SuperNode (see docs/deployment.md).
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from fedskew.errors import ConfigError
from fedskew.experiment.config import Config, build_config, dump_config

#: the ``flwr run`` components every fedskew app names
SERVER_APP, CLIENT_APP = "fedskew.flower.apps:server_app", "fedskew.flower.apps:client_app"
FILES = ("pyproject.toml", "README.md")


def requirements() -> list[str]:
    """``fedskew[flower]`` pinned to the installed version (the experiment's numbers depend on fedskew's
    code, so every host runs the same), and the Flower requirement of that extra (Flower reads its version
    bounds from the app's dependencies)."""
    try:
        version, requires = metadata.version("fedskew"), metadata.requires("fedskew") or []
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return ["fedskew[flower]"]
    extra = [r.split(";")[0].strip() for r in requires if re.search(r"extra\s*==\s*.flower.", r)]
    return [f"fedskew[flower]=={version}", *extra]


def toml_string(text: str) -> str:
    """``text`` as a TOML string: a multi-line literal string where it can be one (read as written), else
    a basic string with ``\\uXXXX`` escapes."""
    plain = not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text)
    if plain and "\n" in text and "'''" not in text and not text.endswith("'"):
        return f"'''\n{text}'''"
    return '"' + re.sub(r'["\\\x00-\x1f\x7f]', lambda m: f"\\u{ord(m.group()):04x}", text) + '"'


def project_name(cfg: Config, fallback: str) -> str:
    """``fedskew-<config name>`` in lower case, letters, digits and dashes (the FAB's file name has it)."""
    slug = re.sub(r"[^a-z0-9]+", "-", (cfg.name or fallback).lower()).strip("-")
    return f"fedskew-{slug or 'experiment'}"


def pyproject(cfg: Config, name: str, results: str) -> str:
    """The app's ``pyproject.toml``: ``cfg`` in its run config, ``results`` the default output folder."""
    text = dump_config(cfg)
    deps = ", ".join(toml_string(r) for r in requirements())
    lines = [
        "# A Flower app running one fedskew experiment (written by `fedskew flower-app`; see README.md).",
        "[project]",
        f"name = {toml_string(name)}",
        'version = "1.0.0"',
        f"description = {toml_string(f'fedskew: {cfg.algorithm.name} on {cfg.data.dataset}')}",
        f"dependencies = [{deps}]",
        "",
        "[tool.flwr.app]",
        'publisher = "fedskew"',
        "",
        "[tool.flwr.app.components]",
        f"serverapp = {toml_string(SERVER_APP)}",
        f"clientapp = {toml_string(CLIENT_APP)}",
        "",
        "# the run config: `config` is the experiment's resolved fedskew config (YAML text, or the path of a",
        "# YAML file on the SuperLink host); `out` is the folder the ServerApp writes the results to, on the",
        "# SuperLink host; `resume=true` continues from out/checkpoint.pt; `force=true` overwrites out;",
        "# `node-ids` binds node index i to the Flower node id its registered key got ('0:ID0,1:ID1,...')",
        "[tool.flwr.app.config]",
        f"out = {toml_string(results)}",
        "resume = false",
        "force = false",
        'node-ids = ""',
        f"config = {toml_string(text)}",
    ]
    return "\n".join(lines) + "\n"


README = """# {name}

A [Flower](https://flower.ai) app that runs one fedskew experiment: {algorithm} on {dataset}, {clients}
clients, {rounds} round(s), on **{nodes} SuperNodes** (client `c` lives on node `c % {nodes}`). Written by
`fedskew flower-app`; the experiment's resolved config is the `config` value of `[tool.flwr.app.config]`
in `pyproject.toml`. This folder holds no code.

1. Install fedskew with its Flower extra on the SuperLink host and on every SuperNode:
   `pip install '{requirement}'`.
2. Start a SuperLink and {nodes} SuperNodes; SuperNode `i` (0 to {last}) is started with
   `--node-config "partition-id=i num-partitions={nodes}"` (optionally also `data-root='/data/fedskew'`,
   its data folder, and `state-dir='/var/lib/fedskew'`, where it keeps its clients' states).
3. Submit the run from this folder; `CONNECTION` names a SuperLink connection of your Flower config
   (`$FLWR_HOME/config.toml`, default `~/.flwr/config.toml`):

   ```bash
   flwr run . CONNECTION
   flwr ls CONNECTION
   ```

   With SuperNode authentication (recommended: docs/deployment.md), bind each node index to the node id
   `flwr supernode register` printed for that node's key, so that no other node can serve its clients:
   `flwr run . CONNECTION --run-config "node-ids='0:ID0,1:ID1,...'"`.

   The ServerApp writes `config.yaml`, `metrics.jsonl`, `summary.json` and its checkpoint to `{results}`
   on the SuperLink host (a relative path is relative to the ServerApp's working directory there).
   Elsewhere: `flwr run . CONNECTION --run-config "out='/srv/runs/{stem}'"`. After a ServerApp crash,
   `flwr stop RUN_ID CONNECTION`, then `flwr run . CONNECTION --run-config "resume=true"`.

See fedskew's docs/deployment.md for TLS, SuperNode authentication and faults.
"""


def write_app(folder: Path, cfg: Config, results: str, stem: str, force: bool = False) -> list[Path]:
    """Write the app for ``cfg`` into ``folder`` (``engine.runtime`` set to ``flower-deployment``);
    ``results``: the ServerApp's output folder; ``stem``: the name when the config has none. Refuses to
    overwrite the app files of an existing folder unless ``force``. Returns the files written."""
    raw = cfg.to_dict()
    cfg = build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-deployment"}})
    clash = [f for f in FILES if (folder / f).exists()]
    if clash and not force:
        raise ConfigError(f"flower-app: {folder / clash[0]} exists; choose a new folder or pass --force")
    name = project_name(cfg, stem)
    texts = {
        "pyproject.toml": pyproject(cfg, name, results),
        "README.md": README.format(
            name=name,
            algorithm=cfg.algorithm.name,
            dataset=cfg.data.dataset,
            rounds=cfg.rounds,
            clients=cfg.data.num_clients,
            nodes=cfg.engine.nodes,
            last=cfg.engine.nodes - 1,
            requirement=requirements()[0],
            stem=re.sub(r"^fedskew-", "", name),
            results=results,
        ),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in texts.items():
        (folder / file).write_text(text, encoding="utf-8")
    return [folder / f for f in FILES]
