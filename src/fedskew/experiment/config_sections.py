"""The sections of the experiment config (:mod:`fedskew.experiment.config`) that live in the experiment
layer, and which keys decide a run's numbers (:func:`results_config`); the engine's own sections are in
:mod:`fedskew.settings`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from fedskew.experiment.data_split import SplitSection
from fedskew.settings import NodeDataSection, Strict


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
    split: SplitSection | None = Field(
        None, description="{merged: true, train_share: 0.75}: test sets cut from each client's own samples"
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
#: compared with a planned one (resume, sweeps) and when runs are grouped for a report; ``tuning`` only
#: records how the values were chosen (experiment/tune_section.py)
WATCH_ONLY = ("name", "log", "tuning")
#: keys that say how a run uses the machine, not what it computes: left out alike (docs/decisions.md)
RUNTIME_ONLY = {"engine": ("threads", "insecure")}


def results_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config mapping without its :data:`WATCH_ONLY` sections and :data:`RUNTIME_ONLY` keys (what decides a
    run's numbers)."""
    out = {k: v for k, v in config.items() if k not in WATCH_ONLY}
    for section, keys in RUNTIME_ONLY.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    return out
