"""The checks of a config that need the registries (names exist, options fit the named objects, the
method fits the federation): run by :func:`fedskew.experiment.config.build_config` once the config's plugins
are loaded, before any data is read. A new build-time check of a config belongs here (one-line
:class:`~fedskew.errors.ConfigError` naming the key and the allowed values)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from fedskew.data.partition.core import RESERVED  # partitioner arguments the engine fills in
from fedskew.engine.need_to_know import check_level
from fedskew.errors import ConfigError, did_you_mean
from fedskew.experiment.clock_checks import check_clock
from fedskew.experiment.data_split import check_split
from fedskew.experiment.secagg_checks import check_secagg
from fedskew.registry import check_options
from fedskew.runtimes import RUNTIMES

if TYPE_CHECKING:
    from fedskew.experiment.config import Config

__all__ = ["check_node_source", "parse_client_range", "validate_semantics"]

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
    _check_runtime(cfg.engine.runtime)
    check_split(cfg.data)
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
    check_level(alg.federation_counts, f"algorithm '{cfg.algorithm.name}': federation_counts")
    _check_eval(cfg, alg)
    mean_methods = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).mean_aggregation]
    _check_security(cfg, alg, mean_methods)
    check_clock(cfg, alg, mean_methods)
    check_secagg(cfg, alg, mean_methods)
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
    if not roots and not RUNTIMES.get(cfg.engine.runtime).node_local_roots:
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


def _check_eval(cfg: Config, alg: Any) -> None:
    """The ``eval`` section against the method and the runtime."""
    if cfg.eval.protocol == "global" and alg.requires_personalized_eval:
        raise ConfigError(
            f"config key 'eval.protocol': algorithm '{cfg.algorithm.name}' has no global model; "
            "allowed: personalized"
        )
    if cfg.eval.per_class and cfg.engine.runtime != "embedded":  # the Flower nodes return no per-class sums
        raise ConfigError(
            f"config key 'eval.per_class': accuracy per class is measured by the embedded engine, not "
            f"engine.runtime={cfg.engine.runtime}; allowed: false"
        )


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


def _check_runtime(name: str) -> None:
    """``engine.runtime``: a registered runtime (:data:`fedskew.runtimes.RUNTIMES`; plugins add theirs)."""
    if name not in RUNTIMES:
        allowed = RUNTIMES.names()
        raise ConfigError(
            f"config key 'engine.runtime': unknown runtime {name!r}{did_you_mean(name, allowed)}; "
            f"allowed: {', '.join(allowed)}"
        )


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
