"""Build a simulation from a config and run it, honouring the results contract.

An output folder holds ``config.yaml`` (fully resolved), ``metrics.jsonl`` (one JSON object per evaluated
round), ``summary.json`` and ``checkpoint.pt`` (written atomically every ``checkpoint.every`` rounds, on
interrupt and at the end). ``resume=True`` continues from the checkpoint to the same metrics as an
uninterrupted run: per-client randomness is derived from ``(seed, round, client)``, not from a stream.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

import fedskew
from fedskew.algorithms.base import ALGORITHMS
from fedskew.data.base import DATASETS
from fedskew.data.federated import FederatedData, build_federated
from fedskew.engine.loop import Simulation
from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.config import Config, VisionLanguageConfig, dump_config, parse_client_range
from fedskew.models.base import MODELS
from fedskew.models.frozen import frozen_features
from fedskew.models.vision_language import VisionLanguageSpec, vision_language_data

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_FILE = "checkpoint.pt"

RoundCallback = Callable[[Simulation, dict[str, Any] | None], None]


def resolve_device(name: str) -> str:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"engine.device={name} but no CUDA device is available; allowed here: cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("engine.device=mps but MPS is not available; allowed here: cpu")
    return name


def build_data(cfg: Config) -> FederatedData:
    """Load the dataset and partition it (a pure function of the config's data section and seed)."""
    loader = DATASETS.get(cfg.data.dataset)
    from fedskew.data.base import resolve_root

    root = resolve_root(cfg.data.root)
    dataset = loader(root, **cfg.data.options)
    enc = cfg.data.frozen_encoder
    if enc is not None:
        weights = Path(enc.weights) if Path(enc.weights).is_absolute() else Path(root) / enc.weights
        dataset = frozen_features(dataset, enc.name, weights, enc.options, enc.batch_size, cfg.engine.device)
    fed = build_federated(
        dataset,
        cfg.data.num_clients,
        cfg.data.partition,
        cfg.seed,
        test=cfg.data.test or None,
        val_fraction=cfg.data.val_fraction,
        train_limit=cfg.data.train_limit,
        shots=cfg.data.shots,
        val_shots=cfg.data.val_shots,
    )
    vl = cfg.data.vision_language
    if vl is not None:
        fed = vision_language_data(fed, vision_language_spec(vl), root)
    return fed


def vision_language_spec(vl: VisionLanguageConfig) -> VisionLanguageSpec:
    """The pipeline's spec from the validated ``data.vision_language`` section."""
    fields = vl.model_dump(exclude={"backbone", "generator"})
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
                raise ConfigError(f"config key 'model.per_client.{spec}': client {cid} >= data.num_clients")
            table[cid] = {**base, **opts}

    def options_for(cid: int | None) -> dict[str, Any]:
        return table.get(cid, base) if cid is not None else base

    return options_for


def model_builders(
    cfg: Config, data: FederatedData
) -> tuple[Callable[[int | None], nn.Module], Callable[[int | None], Hashable]]:
    """``(build_model, arch_key)`` of a run: client ``cid``'s model (``None``: the global one) and a key
    equal for clients of the same architecture."""
    ds = data.dataset
    factory = MODELS.get(cfg.model.name)
    options_for = model_options(cfg)

    def build_model(cid: int | None) -> nn.Module:
        return factory(ds.in_shape, ds.num_classes, **options_for(cid))

    def arch_key(cid: int | None) -> Hashable:
        return repr(sorted(options_for(cid).items()))

    return build_model, arch_key


def build_simulation(cfg: Config, data: FederatedData | None = None) -> Simulation:
    """Everything a run needs, from a validated config."""
    resolve_device(cfg.engine.device)
    data = data if data is not None else build_data(cfg)
    build_model, arch_key = model_builders(cfg, data)
    alg_cls = ALGORITHMS.get(cfg.algorithm.name)
    return Simulation(
        data=data,
        algorithm_cls=alg_cls,
        params=alg_cls.Params(**cfg.algorithm.hyper()),
        build_model=build_model,
        arch_key=arch_key,
        client=cfg.client,
        evaluation=cfg.eval,
        engine=cfg.engine,
        rounds=cfg.rounds,
        seed=cfg.seed,
    )


def _atomic_write_bytes(path: Path, writer: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    writer(tmp)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write_bytes(path, lambda p: p.write_text(text))


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def save_checkpoint(sim: Simulation, out: Path, elapsed: float) -> None:
    sd = sim.state_dict()
    sd["wall_seconds"] = elapsed
    sd["version"] = fedskew.__version__
    _atomic_write_bytes(out / CHECKPOINT_FILE, lambda p: torch.save(sd, p))


def write_metrics(out: Path, history: list[dict[str, Any]]) -> None:
    lines = "".join(json.dumps({k: _jsonable(v) for k, v in r.items()}) + "\n" for r in history)
    _atomic_write_text(out / METRICS_FILE, lines)


def make_summary(cfg: Config, sim: Simulation, wall: float) -> dict[str, Any]:
    """``summary.json``: the final evaluated round is the result (never the best test round)."""
    last = sim.history[-1]
    final = {k: _jsonable(v) for k, v in last.items() if k.startswith(("accuracy", "loss", "val_"))}
    summary: dict[str, Any] = {
        "final": final,
        "rounds": sim.round,
        "wall_seconds": wall,
        "bytes_up": sim.bytes_up,
        "bytes_down": sim.bytes_down,
        "seconds": {k: round(v, 4) for k, v in sim.times.__dict__.items()},
        "algorithm": cfg.algorithm.name,
        "dataset": cfg.data.dataset,
        "model": cfg.model.name,
        "seed": cfg.seed,
        "protocol": cfg.eval.protocol,
        "version": fedskew.__version__,
    }
    evaluated = [r for r in sim.history if r.get("val_accuracy") is not None]
    if evaluated:  # best round chosen on validation only; its test accuracy reported beside
        best = max(evaluated, key=lambda r: r["val_accuracy"])
        summary["best_val"] = {
            "round": best["round"],
            "val_accuracy": best["val_accuracy"],
            "accuracy": best["accuracy"],
        }
    return summary


def prepare_output(out: Path, cfg: Config, resume: bool, force: bool) -> dict[str, Any] | None:
    """Create / check the output folder; returns the checkpoint to resume from, if any."""
    exists = out.exists() and any(out.iterdir())
    if exists and not (resume or force):
        raise FedskewError(f"output folder '{out}' exists and is not empty; pass --resume or --force")
    out.mkdir(parents=True, exist_ok=True)
    if resume and exists:
        saved = out / CONFIG_FILE
        if saved.is_file():
            old = yaml.safe_load(saved.read_text())
            if old != cfg.to_dict():
                raise FedskewError(f"--resume: config differs from the one saved in '{saved}'")
        ckpt = out / CHECKPOINT_FILE
        if ckpt.is_file():
            return torch.load(ckpt, map_location="cpu", weights_only=True)
        return None
    if force:
        for name in (METRICS_FILE, SUMMARY_FILE, CHECKPOINT_FILE):
            (out / name).unlink(missing_ok=True)
    return None


def run_experiment(
    cfg: Config,
    out: str | Path | None = None,
    *,
    resume: bool = False,
    force: bool = False,
    on_round: RoundCallback | None = None,
    data: FederatedData | None = None,
    attach: Callable[[Simulation], None] | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` to completion (writing the results files when ``out`` is given) and return the summary.

    ``attach(sim)`` is called on the new simulation before its first round: a runtime other than the
    embedded one installs its executor there (``fedskew.flower``)."""
    if cfg.engine.runtime != "embedded" and attach is None:
        raise ConfigError(
            f"engine.runtime={cfg.engine.runtime} runs through fedskew.flower.run_flower (`fedskew run` does "
            "this); allowed here: embedded"
        )
    out_dir = Path(out) if out is not None else None
    ckpt = prepare_output(out_dir, cfg, resume, force) if out_dir is not None else None
    sim = build_simulation(cfg, data)
    if attach is not None:
        attach(sim)
    elapsed0 = 0.0
    if ckpt is not None:
        sim.load_state_dict(ckpt)
        elapsed0 = float(ckpt.get("wall_seconds", 0.0))
    if out_dir is not None:
        _atomic_write_text(out_dir / CONFIG_FILE, dump_config(cfg))
        write_metrics(out_dir, sim.history)
    t0 = time.perf_counter()
    every = cfg.checkpoint.every
    try:
        while sim.round < cfg.rounds:
            outcome = sim.run_round()
            if out_dir is not None:
                if outcome.record is not None:
                    with open(out_dir / METRICS_FILE, "a") as fh:
                        fh.write(json.dumps({k: _jsonable(v) for k, v in outcome.record.items()}) + "\n")
                if every and sim.round % every == 0 and sim.round < cfg.rounds:
                    save_checkpoint(sim, out_dir, elapsed0 + time.perf_counter() - t0)
            if on_round is not None:
                on_round(sim, outcome.record)
    except BaseException:
        # The simulation commits whole rounds only, so its state is consistent: keep the progress.
        if out_dir is not None and sim.round > 0:
            save_checkpoint(sim, out_dir, elapsed0 + time.perf_counter() - t0)
        raise
    finally:
        sim.close()
    wall = elapsed0 + time.perf_counter() - t0
    summary = make_summary(cfg, sim, wall)
    if out_dir is not None:
        save_checkpoint(sim, out_dir, wall)
        _atomic_write_text(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary
