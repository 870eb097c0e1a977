"""From a validated config to the parts of a run: the federated data, the models, the embedded simulation.

Everything here is a pure function of the config (and the machine's device for ``engine.device: auto``),
so every process of a run (the embedded engine, a Flower ServerApp, each Flower node) builds the same
partition, the same initial model and the same algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from torch import nn

from fedskew.algorithms.base import ALGORITHMS, Algorithm
from fedskew.algorithms.security.config import SecurityPlan, security_plan
from fedskew.algorithms.security.secured import secured
from fedskew.data.base import DATASETS, resolve_root
from fedskew.data.federated import FederatedData, build_federated
from fedskew.data.merged import build_merged
from fedskew.data.noise import with_feature_noise
from fedskew.engine.assembly import ClientMeta, ModelSpec, client_data, construct_algorithm, initial_server
from fedskew.engine.asynchronous import AsynchronousSimulation
from fedskew.engine.clock import ClientSpeeds, VirtualClock, read_trace
from fedskew.engine.compute import adapted_clients
from fedskew.engine.device import resolve_device
from fedskew.engine.evaluation import EVAL_BATCH, EVAL_BATCH_OTHER, EvalData, Evaluator, RoundEvaluator
from fedskew.engine.loop import RoundPlan, Simulation
from fedskew.engine.modes import EmbeddedExecutor, memory_format
from fedskew.engine.probes import BackdoorProbe
from fedskew.engine.runtime import ClientData, ClientRuntime, ModelCache
from fedskew.engine.sampling import client_schedule, clients_per_round
from fedskew.engine.states import SpillingStates
from fedskew.engine.table_store import TableStore
from fedskew.errors import ConfigError
from fedskew.experiment.checks_method import check_declared_mean, check_model_layouts
from fedskew.experiment.config import Config, VisionLanguageConfig, parse_client_range
from fedskew.models.base import MODELS
from fedskew.models.frozen import frozen_features
from fedskew.models.vision_language import VisionLanguageSpec, vision_language_data
from fedskew.runtimes import RUNTIMES


def with_resolved_device(cfg: Config) -> Config:
    """``cfg`` with ``engine.device: auto`` replaced by the device this machine runs it on (what
    ``config.yaml`` records); an explicit device is checked. Also refuses worker processes on a GPU: they
    are forked, and a CUDA context cannot be forked."""
    device = resolve_device(cfg.engine.device)
    if cfg.engine.workers > 1 and device.type != "cpu":
        raise ConfigError(
            f"config key 'engine.workers': {cfg.engine.workers} needs engine.device=cpu (worker processes "
            f"are forked, and a {device.type} context cannot be forked); on {device} train many clients at "
            "once with engine.mode=vectorized; allowed here: 1"
        )
    if cfg.engine.device != "auto":
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"device": str(device)})})


def recorded_config(cfg: Config) -> Config:
    """The config a run records in ``config.yaml`` and compares on resume: for the embedded runtime with
    its device resolved; Flower's processes each resolve ``auto`` on their own machine."""
    return with_resolved_device(cfg) if RUNTIMES.get(cfg.engine.runtime).in_process else cfg


def build_data(cfg: Config) -> FederatedData:
    """Load the dataset and partition it (a pure function of the config's data section and seed); with
    ``data.source: nodes``, every node's own data root as its clients (:mod:`fedskew.experiment.silos`)."""
    if cfg.data.source == "nodes":
        from fedskew.experiment.silos import build_node_data

        return build_node_data(cfg)
    loader = DATASETS.get(cfg.data.dataset)
    root = resolve_root(cfg.data.root)
    dataset = loader(root, **cfg.data.options)
    enc = cfg.data.frozen_encoder
    if enc is not None:
        weights = Path(enc.weights) if Path(enc.weights).is_absolute() else Path(root) / enc.weights
        device = str(resolve_device(cfg.engine.device))  # the encoder runs where the clients train
        dataset = frozen_features(dataset, enc.name, weights, enc.options, enc.batch_size, device)
    split, d = cfg.data.split, cfg.data
    if split is not None and split.merged:  # PFLlib: test sets cut from the clients' own samples
        share = split.train_share
        fed = build_merged(
            dataset, d.num_clients, d.partition, cfg.seed, train_share=share, val_fraction=d.val_fraction
        )
    else:
        fed = build_federated(
            dataset,
            d.num_clients,
            d.partition,
            cfg.seed,
            test=d.test or None,
            val_fraction=d.val_fraction,
            train_limit=d.train_limit,
            shots=d.shots,
            val_shots=d.val_shots,
        )
    fed = with_feature_noise(fed, cfg.data.feature_noise)
    vl = cfg.data.vision_language
    if vl is not None:
        fed = vision_language_data(fed, vision_language_spec(vl, cfg.seed), root)
    return fed


def vision_language_spec(vl: VisionLanguageConfig, run_seed: int) -> VisionLanguageSpec:
    """The pipeline's spec from the validated ``data.vision_language`` section (``seed: run``: the generator
    draws a new synthetic set per run seed, so intervals over seeds include the generator's variance)."""
    fields = vl.model_dump(exclude={"backbone", "generator"})
    if fields["seed"] == "run":
        fields["seed"] = run_seed
    return VisionLanguageSpec(
        backbone=vl.backbone.name,
        backbone_options=dict(vl.backbone.options),
        generator=vl.generator.name,
        generator_options=dict(vl.generator.options),
        **fields,
    )


def model_options(cfg: Config) -> Callable[[int | None], dict[str, Any]]:
    """``options_for(cid)``: the model options of one client (``per_client`` ranges override)."""
    base = cfg.model.options()
    table: dict[int, dict[str, Any]] = {}
    for spec, opts in cfg.model.per_client.items():
        for cid in parse_client_range(spec):
            if cid >= cfg.data.num_clients:
                raise ConfigError(
                    f"config key 'model.per_client.{spec}': client {cid} >= data.num_clients; allowed: "
                    f"client ids 0-{cfg.data.num_clients - 1}"
                )
            table[cid] = {**base, **opts}

    def options_for(cid: int | None) -> dict[str, Any]:
        return table.get(cid, base) if cid is not None else base

    return options_for


def model_builders(
    cfg: Config, meta: ClientMeta
) -> tuple[Callable[[int | None], nn.Module], Callable[[int | None], Hashable]]:
    """``(build_model, arch_key)`` of a run: client ``cid``'s model (``None``: the global one) and a key
    equal for clients of the same architecture. They keep the data's shapes, not the data."""
    in_shape, num_classes = meta.in_shape, meta.num_classes
    factory = MODELS.get(cfg.model.name)
    options_for = model_options(cfg)

    def build_model(cid: int | None) -> nn.Module:
        return factory(in_shape, num_classes, **options_for(cid))

    def arch_key(cid: int | None) -> Hashable:
        return repr(sorted(options_for(cid).items()))

    return build_model, arch_key


def build_algorithm(cfg: Config, data: FederatedData) -> tuple[Algorithm, ModelCache]:
    """The run's algorithm and model cache on this machine's device (for ``engine.device``), from the
    config and the data's metadata (:func:`fedskew.engine.assembly.construct_algorithm`)."""
    return algorithm_of(cfg, ClientMeta.of(data))


def algorithm_of(cfg: Config, meta: ClientMeta) -> tuple[Algorithm, ModelCache]:
    """:func:`build_algorithm` from the clients' counts and shapes alone (a server or node that does not
    hold the federation's data: ``data.source: nodes``)."""
    device = resolve_device(cfg.engine.device)
    build_model, arch_key = model_builders(cfg, meta)
    fmt = memory_format(cfg.engine.memory_format, device, cfg.engine.mode)
    check_declared_mean(ALGORITHMS.get(cfg.algorithm.name))  # the method's own declaration, before security
    alg_cls = secured(ALGORITHMS.get(cfg.algorithm.name), security_of(cfg, meta.num_classes))
    check_model_layouts(alg_cls, meta.num_clients, build_model, arch_key)
    spec = ModelSpec(build_model, arch_key, device, fmt, cfg.seed)
    params = alg_cls.Params(**cfg.algorithm.hyper())
    return construct_algorithm(alg_cls, params, meta, spec, cfg.client, cfg.rounds, cfg.seed)


def security_of(cfg: Config, num_classes: int) -> SecurityPlan:
    """The run's threat model and protections (``attack``, ``defence``, ``privacy``), resolved."""
    if cfg.attack.name == "backdoor" and cfg.attack.target >= num_classes:
        raise ConfigError(f"attack.target={cfg.attack.target}: the data has classes 0-{num_classes - 1}")
    n = cfg.data.num_clients
    m = clients_per_round(n, cfg.client.fraction)
    return security_plan(
        cfg.attack, cfg.defence, cfg.privacy, num_clients=n, per_round=m, rounds=cfg.rounds, seed=cfg.seed
    )


def evaluator(
    cfg: Config,
    algorithm: Algorithm,
    models: ModelCache,
    data: FederatedData,
    clients: ClientData | None = None,
) -> Evaluator:
    """The evaluator of ``eval.protocol`` over ``data``'s held-out sets, on the models' device (``clients``:
    the clients' training data, for evaluation-time adaptation)."""
    device = models.device
    batch = cfg.eval.batch_size or EVAL_BATCH.get(device.type, EVAL_BATCH_OTHER)
    eval_data = EvalData.of(data, device)
    e = cfg.engine
    return Evaluator(
        algorithm, models, eval_data, cfg.eval.protocol, batch, cfg.seed, e.precision, clients,
        per_class=cfg.eval.per_class,
    )  # fmt: skip


def probed(cfg: Config, round_evaluator: RoundEvaluator, ev: Evaluator) -> RoundEvaluator:
    """What the round transaction is handed: the runtime's evaluator, with a backdoor attack's success
    rate measured beside (:class:`~fedskew.engine.probes.BackdoorProbe`, on ``ev``'s global test set)."""
    if cfg.attack.name == "backdoor":
        return BackdoorProbe(round_evaluator, ev, cfg.attack.target, cfg.attack.trigger_size)
    return round_evaluator


def central(
    cfg: Config, inner: RoundEvaluator, algorithm: Algorithm, models: ModelCache, data: FederatedData
) -> RoundEvaluator:
    """``inner``, plus the server's own test set scored centrally where node-local data names one
    (:func:`fedskew.experiment.silos.with_central`)."""
    if cfg.data.source != "nodes":
        return inner
    from fedskew.experiment.silos import with_central

    ds = data.dataset
    return with_central(cfg, inner, algorithm, models, ds.class_names, ds.in_shape)


def round_plan(cfg: Config, num_clients: int, adapted: tuple[int, ...] = ()) -> RoundPlan:
    """The run's pre-drawn sampling stream, evaluation cadence and failure policy; ``adapted``: the clients
    an evaluation adapts (:func:`fedskew.engine.compute.adapted_clients`, counted in the run's compute)."""
    return RoundPlan(
        schedule=client_schedule(num_clients, cfg.client.fraction, cfg.rounds, cfg.seed, cfg.privacy),
        num_clients=num_clients,
        every=cfg.eval.every,
        seed=cfg.seed,
        on_client_error=cfg.engine.on_client_error,
        device=resolve_device(cfg.engine.device),
        fold_uploads=cfg.engine.fold_uploads,
        eval_adapted=adapted,
    )


def eval_adapted(cfg: Config, algorithm: Algorithm, data: FederatedData) -> tuple[int, ...]:
    """The clients the embedded evaluator adapts at each evaluation (their test and validation sizes)."""
    tests = [int(t.numel()) for t in data.test_idx]
    return adapted_clients(algorithm, cfg.eval.protocol, tests, [int(v.numel()) for v in data.val_idx or []])


def build_simulation(
    cfg: Config, data: FederatedData | None = None, states_dir: Path | None = None
) -> Simulation:
    """The embedded runtime of a validated config: clients trained in this machine's processes from a
    :class:`~fedskew.engine.runtime.ClientRuntime`, evaluated here, their states kept in a
    :class:`~fedskew.engine.states.SpillingStates` store spilling to ``states_dir`` (``None``: a temporary
    folder under ``$FEDSKEW_CACHE``)."""
    if cfg.engine.runtime != "embedded":
        raise ConfigError(
            f"engine.runtime={cfg.engine.runtime} runs through fedskew.flower.run_flower (`fedskew run` does "
            "this); allowed here: embedded"
        )
    cfg = with_resolved_device(cfg)
    data = data if data is not None else build_data(cfg)
    algorithm, models = build_algorithm(cfg, data)
    e = cfg.engine
    rt = ClientRuntime(
        algorithm, client_data(data, models.device), models, cfg.client, cfg.seed, cfg.rounds, models.device,
        e.on_client_error, e.precision,
    )  # fmt: skip
    scorer = evaluator(cfg, algorithm, models, data, rt.data)  # rt.data: evaluation-time adaptation
    server = initial_server(algorithm, models, cfg.seed)
    states = SpillingStates(rt.initial_state, int(e.state_memory_mb * 2**20), states_dir)
    simulation = SIMULATIONS["sync" if cfg.clock is None else cfg.clock.aggregation]
    return simulation(
        algorithm,
        server,
        round_plan(cfg, data.num_clients, eval_adapted(cfg, algorithm, data)),
        executor=EmbeddedExecutor(rt, e),
        evaluator=central(cfg, probed(cfg, scorer, scorer), algorithm, models, data),
        states=states,
        tables=TableStore(int(e.state_memory_mb * 2**20), states_dir, models.device),
        clock=virtual_clock(cfg, data),
    )


#: ``clock.aggregation`` -> the round transaction that runs it (synchronous rounds, or server updates)
SIMULATIONS: dict[str, type[Simulation]] = {
    "sync": Simulation,
    "fedasync": AsynchronousSimulation,
    "fedbuff": AsynchronousSimulation,
}


def virtual_clock(cfg: Config, data: FederatedData) -> VirtualClock | None:
    """The run's virtual clock (``None`` without a ``clock:`` section): speeds drawn per seed or read from
    the trace, slowed for the ``slow_classes`` clients (fedskew.engine.clock)."""
    if cfg.clock is None:
        return None
    trace = read_trace(cfg.clock.trace, data.num_clients) if cfg.clock.trace else None
    counts = data.class_counts()
    outside = [c for c in cfg.clock.slow_classes if c >= counts.shape[1]]
    if outside:
        raise ConfigError(
            f"config key 'clock.slow_classes': class {outside[0]} is not one of {cfg.data.dataset}'s "
            f"{counts.shape[1]} classes; allowed: 0..{counts.shape[1] - 1}"
        )
    if cfg.clock.availability == "trace" and not any(row.online for row in (trace or {}).values()):
        raise ConfigError(
            f"config key 'clock.availability': 'trace' needs an online column in {cfg.clock.trace}; allowed: "
            "always, bernoulli"
        )
    speeds = ClientSpeeds.build(cfg.clock, cfg.seed, counts.tolist(), trace)
    return VirtualClock(cfg.clock, speeds, data.num_clients, cfg.client.fraction, cfg.rounds, cfg.seed)
