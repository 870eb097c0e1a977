"""The experiment config: YAML validated by pydantic, with ``--set dotted.key=value`` overrides.

Stable public keys (ARCHITECTURE.md): ``seed``, ``rounds``, ``data.dataset``, ``data.root``,
``data.num_clients``, ``data.partition.*``, ``model.name``, ``algorithm.name`` (+ its hyper-parameters),
``client.epochs``, ``client.batch_size``, ``client.lr``, ``client.momentum``, ``client.weight_decay``,
``client.fraction``, ``eval.protocol``, ``eval.every``, ``engine.mode``, ``engine.workers``,
``engine.device``, ``plugins``. Every error is one line naming the key and the allowed values.

Split along its seams: the sections are in :mod:`~fedskew.experiment.config_sections`, the checks that need
the registries in :mod:`~fedskew.experiment.config_checks`, override parsing in
:mod:`~fedskew.experiment.config_parsing`; their public names are re-exported here.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from fedskew.engine.clock_config import ClockSection
from fedskew.errors import ConfigError
from fedskew.experiment.config_checks import check_node_source as check_node_source
from fedskew.experiment.config_checks import parse_client_range as parse_client_range
from fedskew.experiment.config_checks import validate_semantics
from fedskew.experiment.config_marks import located, read_marked
from fedskew.experiment.config_parsing import apply_overrides, validation_error
from fedskew.experiment.config_parsing import set_dotted as set_dotted  # re-exported
from fedskew.experiment.config_sections import (
    MAX_ROUNDS,
    RUNTIME_ONLY,
    WATCH_ONLY,
    AlgorithmConfig,
    CheckpointSection,
    DataConfig,
    FrozenEncoderConfig,
    LogSection,
    MlflowLog,
    ModelConfig,
    NamedOptions,
    VisionLanguageConfig,
    WandbLog,
    results_config,
)
from fedskew.experiment.tune_section import TuningSection, check_tuning_seed
from fedskew.settings import (
    AttackSection,
    ClientSection,
    DefenceSection,
    EngineSection,
    EvalSection,
    PrivacySection,
    Strict,
)

__all__ = [
    "MAX_ROUNDS",
    "RUNTIME_ONLY",
    "WATCH_ONLY",
    "AlgorithmConfig",
    "CheckpointSection",
    "Config",
    "DataConfig",
    "FrozenEncoderConfig",
    "LogSection",
    "MlflowLog",
    "ModelConfig",
    "NamedOptions",
    "VisionLanguageConfig",
    "WandbLog",
    "build_config",
    "check_node_source",
    "dump_config",
    "load_config",
    "parse_client_range",
    "read_saved_config",
    "results_config",
    "set_dotted",
    "validate_semantics",
]


class Config(Strict):
    name: str | None = Field(None, description="free-form run name")
    plugins: list[str] = Field(
        default_factory=list,
        description="modules (my_pkg.methods) or .py files (relative: under the config file's folder) loaded "
        "before the config is checked, registering methods, datasets, models, ... (fedskew.plugins); "
        "recorded resolved",
    )
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="seed: partition, initial model, sampling stream, batches"
    )
    rounds: int = Field(
        20, ge=1, le=MAX_ROUNDS, description="communication rounds (the sampling stream is drawn up front)"
    )
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    client: ClientSection = Field(default_factory=ClientSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    log: LogSection = Field(default_factory=LogSection)
    attack: AttackSection = Field(default_factory=AttackSection)
    defence: DefenceSection = Field(default_factory=DefenceSection)
    privacy: PrivacySection = Field(default_factory=PrivacySection)
    clock: ClockSection | None = Field(
        None, description="speeds, availability, deadlines, async aggregation (docs/clock.md)"
    )
    tuning: TuningSection | None = Field(
        None, description="how the values were chosen (fedskew tune): its seeds are refused as run seeds"
    )

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        if out["clock"] is None:  # a run without the clock records what it always recorded
            del out["clock"]
        if out["data"]["split"] is None:  # likewise without data.split
            del out["data"]["split"]
        if out["tuning"] is None:  # likewise without a tuning record
            del out["tuning"]
        if out["engine"]["secagg"] is None:  # likewise without secure aggregation
            del out["engine"]["secagg"]
        return out


def read_saved_config(path: Path) -> dict[str, Any]:
    """A saved ``config.yaml`` as a mapping, with the defaults of keys added since it was written filled
    in (so a run saved by an older version still resumes); as saved where this version cannot read it."""
    raw = yaml.safe_load(path.read_text()) or {}
    try:
        return Config.model_validate(raw).to_dict()
    except ValidationError:
        return raw


def build_config(
    raw: dict[str, Any] | None = None, overrides: list[str] | None = None, *, base: Path | None = None
) -> Config:
    """Validate a raw mapping (+ ``--set`` overrides) into a :class:`Config`; raises ConfigError. Its
    ``plugins`` are loaded (relative ``.py`` paths resolved against ``base``, the config file's folder, else
    the working directory) before the names it uses are checked against the registries."""
    from fedskew.plugins import load_plugins, resolve_plugins

    data = copy.deepcopy(raw or {})
    if not isinstance(data, dict):
        raise ConfigError("config must be a mapping of sections (seed, rounds, data, model, algorithm, ...)")
    apply_overrides(data, overrides or [])
    _node_clients(data)
    if "plugins" in data:
        data["plugins"] = resolve_plugins(data["plugins"], base)
    resolve_trace(data, base)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise validation_error(err, Config) from None
    load_plugins(cfg.plugins)
    validate_semantics(cfg)
    check_tuning_seed(cfg.seed, cfg.tuning)
    return cfg


def resolve_trace(data: dict[str, Any], base: Path | None) -> None:
    """``clock.trace`` made absolute (relative: under ``base``, the config file's folder), as recorded, with
    the file's SHA-256 beside it: a config that recorded another digest (a resumed run, a sweep's saved
    config) is refused, so a trace edited between a run and its resume cannot change its speeds unseen."""
    clock = data.get("clock")
    if not (isinstance(clock, dict) and isinstance(clock.get("trace"), str)):
        return
    path = Path(clock["trace"]).expanduser()
    path = (path if path.is_absolute() else (base or Path.cwd()) / path).resolve()
    clock["trace"] = str(path)
    if not path.is_file():
        return  # read when the run is built: one line there
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    recorded = clock.get("trace_sha256")
    if recorded is not None and recorded != digest:
        raise ConfigError(
            f"config key 'clock.trace': {path} changed since the run recorded it (sha256 "
            f"{str(recorded)[:12]}..., now {digest[:12]}...); allowed: the recorded file, or a new run"
        )
    clock["trace_sha256"] = digest


def _node_clients(raw: dict[str, Any]) -> None:
    """``data.source: nodes`` without ``data.num_clients``: the federation has engine.nodes x
    data.nodes.clients clients (the defaults: 3 nodes, 1 client each)."""
    data, engine = raw.get("data"), raw.get("engine") or {}
    if isinstance(data, dict) and data.get("source") == "nodes" and "num_clients" not in data:
        per_node = (data.get("nodes") or {}).get("clients", 1)
        if isinstance(per_node, int) and isinstance(engine.get("nodes", 3), int):
            data["num_clients"] = engine.get("nodes", 3) * per_node


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config file, apply overrides and validate it; an error names the file:line:col of its
    key, or the ``--set`` override that set it (config_marks.py)."""
    doc = read_marked(Path(path))
    with located(doc, overrides):
        return build_config(doc.data, overrides, base=Path(path).resolve().parent)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
