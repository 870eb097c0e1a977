"""Build a simulation from a config and run it, honouring the results contract.

An output folder holds ``config.yaml`` (fully resolved), ``metrics.jsonl`` (one JSON object per evaluated
round), ``summary.json`` and ``checkpoint.pt`` (written every ``checkpoint.every`` rounds, on interrupt and
at the end). ``resume=True`` continues from the checkpoint to the same metrics as an uninterrupted run:
per-client randomness is derived from ``(seed, round, client)``, not from a stream.

Faults: every file but ``metrics.jsonl`` is written atomically (a temporary file, fsynced, renamed); the
checkpoint it replaces is kept as ``checkpoint.prev.pt``, and resume uses it when ``checkpoint.pt`` is
missing (a kill between the two renames). ``metrics.jsonl`` is appended to, and rewritten from the
checkpoint's history on resume, so a line cut by a kill never survives. A process holds an exclusive
``flock`` on ``.lock`` while it writes a folder (the kernel releases it when the process dies). A failed
write (disk full) stops the run with one line and leaves every file as it was.

Every byte of a results file goes through :func:`write_bytes`, the one place the fault-injection campaign
(``benchmarks/faults.py``) replaces in its forked runs to kill them inside a write.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fedskew
from fedskew.algorithms.base import ALGORITHMS
from fedskew.data.base import DATASETS
from fedskew.data.federated import FederatedData, build_federated
from fedskew.engine.device import deterministic_algorithms, resolve_device
from fedskew.engine.loop import Simulation
from fedskew.errors import ConfigError, FedskewError, RunFailure
from fedskew.experiment.config import (
    Config,
    VisionLanguageConfig,
    dump_config,
    parse_client_range,
    read_saved_config,
)
from fedskew.models.base import MODELS
from fedskew.models.frozen import frozen_features
from fedskew.models.vision_language import VisionLanguageSpec, vision_language_data

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_FILE = "checkpoint.pt"
#: the checkpoint before the last one (kept so that a damaged checkpoint.pt loses rounds, not the run)
CHECKPOINT_PREV = "checkpoint.prev.pt"
LOCK_FILE = ".lock"
#: the checkpoint entry holding the SHA-256 of the rest of its content
DIGEST_KEY = "sha256"

RoundCallback = Callable[[Simulation, dict[str, Any] | None], None]


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
    return with_resolved_device(cfg) if cfg.engine.runtime == "embedded" else cfg


def build_data(cfg: Config) -> FederatedData:
    """Load the dataset and partition it (a pure function of the config's data section and seed)."""
    loader = DATASETS.get(cfg.data.dataset)
    from fedskew.data.base import resolve_root

    root = resolve_root(cfg.data.root)
    dataset = loader(root, **cfg.data.options)
    enc = cfg.data.frozen_encoder
    if enc is not None:
        weights = Path(enc.weights) if Path(enc.weights).is_absolute() else Path(root) / enc.weights
        device = str(resolve_device(cfg.engine.device))  # the encoder runs where the clients train
        dataset = frozen_features(dataset, enc.name, weights, enc.options, enc.batch_size, device)
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
                raise ConfigError(
                    f"config key 'model.per_client.{spec}': client {cid} >= data.num_clients; allowed: "
                    f"client ids 0-{cfg.data.num_clients - 1}"
                )
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
    cfg = with_resolved_device(cfg)
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


def write_bytes(fh: io.RawIOBase | io.BufferedIOBase, data: bytes) -> None:
    """The one place the bytes of every results file are written (fault injection replaces it); an
    unbuffered file may take fewer bytes a call, so the rest is written until none is left."""
    view = memoryview(data)
    while view:
        view = view[fh.write(view) or 0 :]


def _write_failed(path: Path, err: OSError) -> RunFailure:
    why = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else err.strerror or str(err)
    return RunFailure(
        f"cannot write '{path}': {why}; the files written before are intact: free space and continue "
        "with --resume"
    )


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform / file system can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes, keep: Path | None = None) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary file and a rename; the file replaced is
    renamed to ``keep`` first when given. A failed write raises :class:`RunFailure` and changes nothing."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            write_bytes(fh, data)
            fh.flush()
            os.fsync(fh.fileno())
        if keep is not None and path.exists():
            os.replace(path, keep)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _write_failed(path, err) from None
    _fsync_dir(path.parent)


def _atomic_write_text(path: Path, text: str) -> None:
    write_atomic(path, text.encode())


def append_line(path: Path, line: str) -> None:
    """Append one line to ``path``; a failed write is undone (no partial line) and raises RunFailure."""
    with open(path, "ab", buffering=0) as fh:  # unbuffered: nothing left to flush after a failure
        start = fh.tell()
        try:
            write_bytes(fh, line.encode())
        except OSError as err:
            with contextlib.suppress(OSError):
                fh.truncate(start)
            raise _write_failed(path, err) from None


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out`` (``.lock``): a second process on the same folder is refused. The
    lock is an ``flock``, released by the kernel when its process dies, so a killed run never leaves a
    stale lock behind."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock on this platform: no lock
        yield
        return
    with open(out / LOCK_FILE, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            pid = fh.read().strip() or "?"
            raise FedskewError(
                f"output folder '{out}' is in use by another fedskew process (pid {pid}); wait for it to "
                "finish or choose another --out"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def save_checkpoint(sim: Simulation, out: Path, elapsed: float) -> None:
    sd = sim.state_dict()
    sd["wall_seconds"] = elapsed
    sd["version"] = fedskew.__version__
    sd[DIGEST_KEY] = tree_digest(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    write_atomic(out / CHECKPOINT_FILE, buf.getvalue(), keep=out / CHECKPOINT_PREV)


def tree_digest(obj: Any) -> str:
    """SHA-256 of a nested dict / list / tensor structure's content (keys, types, dtypes, shapes, bytes);
    a ``DIGEST_KEY`` entry of the top-level dict is left out."""
    h = hashlib.sha256()

    def feed(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            h.update(b"D%d" % len(o))
            for k in sorted(o, key=repr):
                h.update(repr(k).encode())
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(b"L%d" % len(o))
            for v in o:
                feed(v)
        else:
            h.update(f"{type(o).__name__}:{o!r}".encode())

    feed({k: v for k, v in obj.items() if k != DIGEST_KEY} if isinstance(obj, dict) else obj)
    return h.hexdigest()


def _read_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path``, or ``None`` when it cannot be read back whole. torch does not check the
    CRCs of its zip records, so a flipped bit in a tensor would load silently: the content digest saved
    with the checkpoint catches it."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # truncated zip, bad pickle, ...: torch raises several types
        return None
    if not (isinstance(sd, dict) and {"round", "server", "history"} <= sd.keys()):
        return None
    saved = sd.get(DIGEST_KEY)
    return sd if saved is None or saved == tree_digest(sd) else None


def load_checkpoint(out: Path) -> dict[str, Any] | None:
    """The checkpoint to resume from: ``checkpoint.pt``, or the previous one when it is missing (a kill
    between the renames of a checkpoint write). A damaged ``checkpoint.pt`` is an error naming the file
    and the fix; the previous checkpoint is never used silently in its place."""
    path, prev = out / CHECKPOINT_FILE, out / CHECKPOINT_PREV
    if not path.is_file():
        path = prev
        if not path.is_file():
            return None
    sd = _read_checkpoint(path)
    if sd is not None:
        return sd
    older = _read_checkpoint(prev) if path != prev and prev.is_file() else None
    fix = (
        f"delete it to resume from '{prev}' (round {older['round']})"
        if older is not None
        else "rerun with --force to start over"
    )
    raise FedskewError(f"checkpoint '{path}' is truncated or corrupted; {fix}")


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
        "skipped_rounds": list(sim.skipped),
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
    exists = out.exists() and any(p.name != LOCK_FILE for p in out.iterdir())
    if exists and not (resume or force):
        raise FedskewError(f"output folder '{out}' exists and is not empty; pass --resume or --force")
    out.mkdir(parents=True, exist_ok=True)
    if resume and exists:
        saved = out / CONFIG_FILE
        if saved.is_file() and read_saved_config(saved) != cfg.to_dict():
            raise FedskewError(f"--resume: config differs from the one saved in '{saved}'")
        return load_checkpoint(out)
    if force:
        for name in (METRICS_FILE, SUMMARY_FILE, CHECKPOINT_FILE, CHECKPOINT_PREV):
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
    cfg = recorded_config(cfg)
    out_dir = Path(out) if out is not None else None
    with (
        output_lock(out_dir) if out_dir is not None else contextlib.nullcontext(),
        deterministic_algorithms(cfg.engine.deterministic),
    ):
        return _run(cfg, out_dir, resume, force, on_round, data, attach)


def _run(
    cfg: Config,
    out_dir: Path | None,
    resume: bool,
    force: bool,
    on_round: RoundCallback | None,
    data: FederatedData | None,
    attach: Callable[[Simulation], None] | None,
) -> dict[str, Any]:
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
                    line = json.dumps({k: _jsonable(v) for k, v in outcome.record.items()}) + "\n"
                    append_line(out_dir / METRICS_FILE, line)
                if every and sim.round % every == 0 and sim.round < cfg.rounds:
                    save_checkpoint(sim, out_dir, elapsed0 + time.perf_counter() - t0)
            if on_round is not None:
                on_round(sim, outcome.record)
    except BaseException:
        # The simulation commits whole rounds only, so its state is consistent: keep the progress.
        if out_dir is not None and sim.round > 0:
            with contextlib.suppress(RunFailure):  # disk full: the last checkpoint written stays the one
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
