"""The experiment config: YAML validated by pydantic, with ``--set dotted.key=value`` overrides.

Stable public keys (ARCHITECTURE.md): ``seed``, ``rounds``, ``data.dataset``, ``data.root``,
``data.num_clients``, ``data.partition.*``, ``model.name``, ``algorithm.name`` (+ its hyper-parameters),
``client.epochs``, ``client.batch_size``, ``client.lr``, ``client.momentum``, ``client.weight_decay``,
``client.fraction``, ``eval.protocol``, ``eval.every``, ``engine.mode``, ``engine.workers``,
``engine.device``. Every error is one line naming the key and the allowed values.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from fedskew.data.partition.core import RESERVED  # partitioner arguments the engine fills in
from fedskew.errors import ConfigError, did_you_mean
from fedskew.experiment.config_marks import located, read_marked
from fedskew.experiment.config_parsing import apply_overrides, validation_error
from fedskew.experiment.config_parsing import set_dotted as set_dotted  # re-exported
from fedskew.registry import check_options
from fedskew.settings import (
    AttackSection,
    ClientSection,
    DefenceSection,
    EngineSection,
    EvalSection,
    NodeDataSection,
    PrivacySection,
    Strict,
)


class FrozenEncoderConfig(Strict):
    """A pre-trained encoder applied once to every image; only the model on top is trained."""

    name: str = Field("resnet18", description="encoder model registry name")
    weights: str = Field(..., description="state_dict file; relative paths are under the data root")
    options: dict[str, Any] = Field(default_factory=dict, description="encoder model options, e.g. stem")
    batch_size: int = Field(256, ge=1, description="encoding batch size")


class NamedOptions(Strict):
    """A registry name and its options."""

    name: str = Field(..., description="registry name")
    options: dict[str, Any] = Field(default_factory=dict, description="options of the named object")


class VisionLanguageConfig(Strict):
    """A frozen backbone's features of the images, a generator's synthetic cache set and class embeddings
    (CacheFL and its baselines; docs/algorithms.md)."""

    backbone: NamedOptions = Field(..., description="backbone registry name + options (`fedskew list`)")
    generator: NamedOptions = Field(..., description="text-to-image generator registry name + options")
    shots: int = Field(16, ge=1, description="K: synthetic images per class in the cache")
    pool: int | None = Field(None, ge=1, description="images drawn per class; the cache keeps the first K")
    template: str = Field("a photo of a {}.", description="class prompt template of the text encoder")
    templates: str | list[str] | None = Field(
        None, description="instead of template: ensemble | coop:<dataset> | a list (feature mean)"
    )
    augment_views: int = Field(0, ge=0, description="V > 0: cache keys = mean of V augmented views")
    text_head: str = Field("auto", description="auto | encoder | prototypes (generated-prototype head)")
    seed: int | Literal["run"] = Field(
        0, description="generator seed: one synthetic set per dataset, or 'run': the run's seed (variance)"
    )
    image_size: int | None = Field(None, ge=8, description="generator resolution; default the backbone's")
    cache: bool = Field(True, description="keep features on disk under $FEDSKEW_CACHE (never the data root)")

    @field_validator("templates")
    @classmethod
    def _one_prompt_source(cls, value: Any, info: ValidationInfo) -> Any:
        from fedskew.models.clip_templates import DEFAULT_TEMPLATE, resolve_templates

        resolve_templates(info.data.get("template", DEFAULT_TEMPLATE), value)
        return value


class DataConfig(Strict):
    dataset: str = Field("digits", description="dataset registry name (`fedskew list`)")
    source: Literal["partition", "nodes"] = Field(
        "partition",
        description="partition: one dataset split over the clients by data.partition; nodes: every node "
        "reads its own data root (data.nodes), as data.nodes.clients clients",
    )
    nodes: NodeDataSection = Field(default_factory=NodeDataSection, description="node-local data")
    root: str | None = Field(None, description="data root; default $FEDSKEW_DATA, else ~/.cache/fedskew")
    options: dict[str, Any] = Field(default_factory=dict, description="dataset loader options")
    num_clients: int = Field(10, ge=1, description="number of clients")
    partition: dict[str, Any] = Field(
        default_factory=lambda: {"name": "iid"}, description="partition scheme: name + its parameters"
    )
    test: dict[str, Any] = Field(
        default_factory=dict, description="per-client test split options (personalized protocol)"
    )
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of each client's training data held out for validation"
    )
    frozen_encoder: FrozenEncoderConfig | None = Field(
        None, description="replace images by a frozen pre-trained encoder's features (MP-FedCL, Table II)"
    )
    vision_language: VisionLanguageConfig | None = Field(
        None, description="replace images by a frozen backbone's features + cache and text assets (CacheFL)"
    )
    train_limit: int | None = Field(
        None, ge=1, description="partition only the first n training samples (MP-FedCL's 2,000 MNIST images)"
    )
    feature_noise: float = Field(
        0.0, ge=0.0, description="NIID-Bench's noise feature skew: client i's inputs + N(0, (σ·i/(N−1))²)"
    )
    shots: int | None = Field(
        None, ge=1, description="partition only K seeded training samples per class (CacheFL's 16 shots)"
    )
    val_shots: int | None = Field(
        None,
        ge=1,
        description="with shots: V more samples per class as validation, dealt like each client's mix",
    )


class ModelConfig(BaseModel):
    """``name`` plus the factory's options; ``per_client`` maps client ranges ("0-6", "7") to options."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("mlp_mpfedcl", description="model registry name")
    per_client: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description='heterogeneous models: {"0-6": {conv2_channels: 18}, ...}'
    )

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class AlgorithmConfig(BaseModel):
    """``name`` plus the algorithm's hyper-parameters (validated by its ``Params``)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("fedavg", description="algorithm registry name")

    def hyper(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


#: the most rounds a config may ask for: every round's sampled clients are drawn before the first round
MAX_ROUNDS = 1_000_000


class CheckpointSection(Strict):
    every: int = Field(5, ge=0, description="write a checkpoint every k rounds (0: only at the end)")


class MlflowLog(Strict):
    uri: str = Field(..., description="MLflow tracking URI, e.g. sqlite:///mlflow.db or http://host:5000")
    experiment: str = Field("fedskew", description="MLflow experiment the run is logged under")


class WandbLog(Strict):
    project: str = Field("fedskew", description="W&B project")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline (default: files only, no network), online or disabled"
    )
    dir: str | None = Field(None, description="where W&B writes its run folder (default: the run's folder)")
    entity: str | None = Field(None, description="W&B entity (team or user), online mode")


class LogSection(Strict):
    """Live trackers beside ``metrics.jsonl`` (which stays the source of truth); none by default. A tracker
    that fails never stops or changes the run (docs/decisions.md, "trackers")."""

    tensorboard: str | None = Field(None, description="TensorBoard log folder; a run writes <dir>/<run name>")
    mlflow: MlflowLog | None = Field(None, description="MLflow: {uri, experiment}; a URI string is the uri")
    wandb: WandbLog | None = Field(None, description="Weights & Biases: {project, mode, dir, entity}")

    @field_validator("mlflow", mode="before")
    @classmethod
    def _uri_shorthand(cls, value: Any) -> Any:
        return {"uri": value} if isinstance(value, str) else value

    def enabled(self) -> list[str]:
        """The trackers this section turns on, by registry name."""
        return [name for name in ("tensorboard", "mlflow", "wandb") if getattr(self, name) is not None]


#: config sections that change how a run is watched, not what it computes: left out when a saved config is
#: compared with a planned one (resume, sweeps) and when runs are grouped for a report
WATCH_ONLY = ("name", "log")
#: keys that say how a run uses the machine, not what it computes: left out alike (docs/decisions.md)
RUNTIME_ONLY = {"engine": ("threads",)}


def results_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config mapping without its :data:`WATCH_ONLY` sections and :data:`RUNTIME_ONLY` keys (what decides a
    run's numbers)."""
    out = {k: v for k, v in config.items() if k not in WATCH_ONLY}
    for section, keys in RUNTIME_ONLY.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    return out


class Config(Strict):
    name: str | None = Field(None, description="free-form run name")
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

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------- parsing and errors
#: the subject of an unknown-option error under a config section
_UNKNOWN = "config key '{where}.{{key}}': unknown option"


def validate_semantics(cfg: Config) -> None:
    """Checks that need the registries: names exist and options fit the named objects."""
    from fedskew import algorithms as _algorithms  # noqa: F401  (registers)
    from fedskew import data as _data  # noqa: F401
    from fedskew import models as _models  # noqa: F401
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.data.base import DATASETS, PARTITIONERS
    from fedskew.models.base import MODELS

    DATASETS.get(cfg.data.dataset)
    _check_mode(cfg.engine.mode)
    part = dict(cfg.data.partition)
    if "name" not in part:
        raise ConfigError(
            f"config key 'data.partition.name' is required; valid: {', '.join(PARTITIONERS.names())}"
        )
    scheme = PARTITIONERS.get(part.pop("name"))
    check_options(scheme, part, _UNKNOWN.format(where="data.partition"), 3, RESERVED)
    check_options(DATASETS.get(cfg.data.dataset), cfg.data.options, _UNKNOWN.format(where="data.options"), 1)
    vl = cfg.data.vision_language
    if vl is not None:
        from fedskew.data.generators import GENERATORS
        from fedskew.models.backbones import BACKBONES

        where = "data.vision_language.{}.options"
        check_options(
            BACKBONES.get(vl.backbone.name),
            vl.backbone.options,
            _UNKNOWN.format(where=where.format("backbone")),
            1,
        )
        check_options(
            GENERATORS.get(vl.generator.name),
            vl.generator.options,
            _UNKNOWN.format(where=where.format("generator")),
            4,
        )
    if ALGORITHMS.get(cfg.algorithm.name).vision_language and vl is None:
        raise ConfigError(
            f"algorithm '{cfg.algorithm.name}' runs on backbone features: config key 'data.vision_language' "
            "is required (backbone, generator, shots, template)"
        )
    model_fn = MODELS.get(cfg.model.name)
    check_options(model_fn, cfg.model.options(), _UNKNOWN.format(where="model"), 2)
    for rng, opts in cfg.model.per_client.items():
        parse_client_range(rng)
        check_options(model_fn, opts, _UNKNOWN.format(where=f"model.per_client.{rng}"), 2)
    alg = ALGORITHMS.get(cfg.algorithm.name)
    _check_hyper_parameters(alg, cfg)
    if cfg.eval.protocol == "global" and alg.requires_personalized_eval:
        raise ConfigError(
            f"config key 'eval.protocol': algorithm '{cfg.algorithm.name}' has no global model; "
            "allowed: personalized"
        )
    _check_security(cfg, alg, [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).mean_aggregation])
    if cfg.data.source == "nodes":
        check_node_source(cfg)


#: what node-local data cannot combine with (each needs the whole dataset, or a central test set)
_UNSUPPORTED = {
    "data.frozen_encoder": lambda cfg: cfg.data.frozen_encoder is not None,
    "data.vision_language": lambda cfg: cfg.data.vision_language is not None,
    "data.feature_noise": lambda cfg: cfg.data.feature_noise > 0,
    "attack.name=backdoor (its success rate needs a central test set)": lambda cfg: (
        cfg.attack.name == "backdoor"
    ),
}


def check_node_source(cfg: Config) -> None:
    """One-line :class:`ConfigError` for a ``data.source: nodes`` config that cannot run."""
    nodes, per_node = cfg.engine.nodes, cfg.data.nodes.clients
    if cfg.data.num_clients != nodes * per_node:
        raise ConfigError(
            f"config key 'data.num_clients': data.source=nodes has engine.nodes x data.nodes.clients = "
            f"{nodes * per_node} clients, got {cfg.data.num_clients}; leave data.num_clients out"
        )
    roots = cfg.data.nodes.roots
    if roots and len(roots) != nodes:
        raise ConfigError(
            f"config key 'data.nodes.roots': {len(roots)} data roots for engine.nodes={nodes}; allowed: one "
            "per node"
        )
    if not roots and cfg.engine.runtime != "flower-deployment":
        raise ConfigError(
            f"config key 'data.nodes.roots' is required on engine.runtime={cfg.engine.runtime} (one data "
            "root per node); only deployed SuperNodes read their own (node config data-root)"
        )
    if cfg.data.nodes.server_root is not None and cfg.eval.protocol == "personalized":
        from fedskew.algorithms.base import ALGORITHMS

        if ALGORITHMS.get(cfg.algorithm.name).requires_personalized_eval:
            raise ConfigError(
                f"config key 'data.nodes.server_root': algorithm '{cfg.algorithm.name}' has no global model "
                "to score centrally; allowed: null"
            )
    for key, used in _UNSUPPORTED.items():
        if used(cfg):
            raise ConfigError(f"data.source=nodes does not support {key}; allowed with data.source=partition")


def _check_security(cfg: Config, alg: Any, eligible: list[str]) -> None:
    """The threat model and protections against the federation and the method (one-line errors)."""
    from fedskew.algorithms.security.config import check_algorithm, check_private_run, security_plan
    from fedskew.engine.sampling import clients_per_round

    sections = (cfg.attack, cfg.defence, cfg.privacy)
    heterogeneous = bool(cfg.model.per_client)
    check_algorithm(cfg.algorithm.name, alg.mean_aggregation, heterogeneous, eligible, sections)
    check_private_run(
        cfg.privacy, cfg.algorithm.name, alg.reads_client_scalars, cfg.eval.protocol, cfg.data.source
    )
    n = cfg.data.num_clients
    m = clients_per_round(n, cfg.client.fraction)
    security_plan(*sections, num_clients=n, per_round=m, rounds=cfg.rounds, seed=cfg.seed)


def _check_hyper_parameters(alg: Any, cfg: Config) -> None:
    """The algorithm's hyper-parameters against its ``Params`` model, in one line."""
    try:
        alg.Params(**cfg.algorithm.hyper())
    except ValidationError as err:
        e = err.errors()[0]
        key = ".".join(str(p) for p in e["loc"])
        allowed = list(alg.Params.model_fields)
        if e["type"] == "extra_forbidden":
            raise ConfigError(
                f"config key 'algorithm.{key}': unknown hyper-parameter of '{cfg.algorithm.name}'"
                f"{did_you_mean(key, allowed)}; allowed: {', '.join(allowed) or '(none)'}"
            ) from None
        raise ConfigError(f"config key 'algorithm.{key}': {e['msg']} (got {e.get('input')!r})") from None


def _check_mode(mode: str) -> None:
    """``engine.mode``: ``auto`` or a registered executor (a new executor registers itself)."""
    from fedskew.engine.modes import modes

    allowed = modes()
    if mode not in allowed:
        raise ConfigError(
            f"config key 'engine.mode': unknown executor {mode!r}{did_you_mean(mode, allowed)}; "
            f"allowed: {', '.join(allowed)}"
        )


def parse_client_range(spec: str) -> range:
    """``"3"`` -> range(3, 4); ``"0-6"`` -> range(0, 7)."""
    try:
        if "-" in spec:
            a, b = spec.split("-", 1)
            return range(int(a), int(b) + 1)
        return range(int(spec), int(spec) + 1)
    except ValueError:
        raise ConfigError(
            f"config key 'model.per_client.{spec}': expected a client id or range like 0-6"
        ) from None


def read_saved_config(path: Path) -> dict[str, Any]:
    """A saved ``config.yaml`` as a mapping, with the defaults of keys added since it was written filled
    in (so a run saved by an older version still resumes); as saved where this version cannot read it."""
    raw = yaml.safe_load(path.read_text()) or {}
    try:
        return Config.model_validate(raw).to_dict()
    except ValidationError:
        return raw


def build_config(raw: dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    """Validate a raw mapping (+ ``--set`` overrides) into a :class:`Config`; raises ConfigError."""
    data = copy.deepcopy(raw or {})
    if not isinstance(data, dict):
        raise ConfigError("config must be a mapping of sections (seed, rounds, data, model, algorithm, ...)")
    apply_overrides(data, overrides or [])
    _node_clients(data)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise validation_error(err, Config) from None
    validate_semantics(cfg)
    return cfg


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
        return build_config(doc.data, overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
