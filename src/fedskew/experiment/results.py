"""The results files of a run: atomic writes, the output-folder lock, checkpoints and their digests.

An output folder holds ``config.yaml`` (fully resolved), ``metrics.jsonl`` (one JSON object per evaluated
round), ``summary.json``, ``checkpoint.pt`` (written every ``checkpoint.every`` rounds, on interrupt and at
the end) and ``client-states/`` (clients' states beyond ``engine.state_memory_mb``, named by the
checkpoints: :mod:`fedskew.engine.states`).

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
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import fedskew
from fedskew.engine.loop import Simulation
from fedskew.engine.states import STATES_DIR
from fedskew.errors import FedskewError, RunFailure
from fedskew.experiment.config import Config, read_saved_config
from fedskew.experiment.extension import check_resume_config, extended_checkpoint
from fedskew.experiment.failure import assess
from fedskew.experiment.fairness import client_accuracies, client_fairness

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_FILE = "checkpoint.pt"
#: the checkpoint before the last one (kept so that a damaged checkpoint.pt loses rounds, not the run)
CHECKPOINT_PREV = "checkpoint.prev.pt"
LOCK_FILE = ".lock"
#: the checkpoint entry holding the SHA-256 of the rest of its content
DIGEST_KEY = "sha256"


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


def write_text(path: Path, text: str) -> None:
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


def jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def save_checkpoint(
    sim: Simulation, out: Path, elapsed: float, provenance: dict[str, Any] | None = None
) -> None:
    sd = sim.state_dict()
    sd["wall_seconds"] = elapsed
    sd["version"] = fedskew.__version__
    if provenance is not None:  # the process that wrote it: a resume keeps it in resumed_from
        sd["provenance"] = provenance
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


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _history(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(r, dict) and _count(r.get("round")) for r in v)


def _provenance(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and isinstance(v.get("resumed_from", []), list))


#: the top-level fields read before the simulation loads the rest (which checks its own: :func:`restore`),
#: each with the test its value passes in a checkpoint :func:`save_checkpoint` writes (absent: ``None``)
_LAYOUT: dict[str, Callable[[Any], bool]] = {
    "round": _count,
    "history": _history,
    "server": lambda v: isinstance(v, dict),
    "clients": lambda v: isinstance(v, dict),
    "wall_seconds": lambda v: v is None or _number(v),
    "provenance": _provenance,
}


def _read_checkpoint(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint at ``path`` and ``""``, or ``None`` and why it cannot be used. torch does not check the
    CRCs of its zip records, so a flipped bit in a tensor would load silently: the content digest saved
    with the checkpoint catches it. The digest is mandatory (every checkpoint fedskew writes has one): it
    guards against damage, not forgery (anyone who can write the folder can compute it), so the content is
    checked as well, here and when it is loaded."""
    damaged = "is truncated or corrupted"
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # truncated zip, bad pickle, ...: torch raises several types
        return None, damaged
    if not (isinstance(sd, dict) and {"round", "server", "history"} <= sd.keys()):
        return None, damaged
    saved = sd.get(DIGEST_KEY)
    if saved is None:
        return None, f"has no content digest ('{DIGEST_KEY}'), which every checkpoint fedskew writes has"
    try:
        if not (isinstance(saved, str) and saved == tree_digest(sd)):
            return None, damaged
    except RecursionError:  # nested deeper than any state: not a checkpoint fedskew wrote
        return None, damaged
    bad = [key for key, ok in _LAYOUT.items() if not ok(sd.get(key))]
    return (None, f"does not have the layout fedskew writes ({', '.join(bad)})") if bad else (sd, "")


def load_checkpoint(out: Path) -> dict[str, Any] | None:
    """The checkpoint to resume from: ``checkpoint.pt``, or the previous one when it is missing (a kill
    between the renames of a checkpoint write). A damaged (or unusable) ``checkpoint.pt`` is an error naming
    the file and the fix; the previous checkpoint is never used silently in its place."""
    path, prev = out / CHECKPOINT_FILE, out / CHECKPOINT_PREV
    if not path.is_file():
        path = prev
        if not path.is_file():
            return None
    sd, why = _read_checkpoint(path)
    if sd is not None:
        return sd
    older = _read_checkpoint(prev)[0] if path != prev and prev.is_file() else None
    fix = (
        f"delete it to resume from '{prev}' (round {older['round']})"
        if older is not None
        else "rerun with --force to start over"
    )
    raise FedskewError(f"checkpoint '{path}' {why}; {fix}")


def restore(sim: Simulation, ckpt: dict[str, Any]) -> None:
    """Load ``ckpt`` into ``sim``. Content this version does not write (a crafted checkpoint passes the
    digest) is refused with one line, never a traceback; file names in it are refused by the stores that use
    them."""
    try:
        sim.load_state_dict(ckpt)
    except FedskewError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        what = " ".join(f"{type(err).__name__}: {err}".split())[:100]
        raise FedskewError(
            f"the checkpoint's content does not have the layout fedskew writes ({what}); rerun with --force "
            "to start over"
        ) from None


def write_metrics(out: Path, history: list[dict[str, Any]]) -> None:
    lines = "".join(json.dumps({k: jsonable(v) for k, v in r.items()}) + "\n" for r in history)
    write_text(out / METRICS_FILE, lines)


def make_summary(
    cfg: Config, sim: Simulation, wall: float, provenance: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``summary.json``: the final evaluated round is the result (never the best test round); its
    ``status`` says whether the run counts as failed (:mod:`fedskew.experiment.failure`), ``provenance``
    where it came from (:mod:`fedskew.experiment.provenance`)."""
    last = sim.history[-1]
    final = {
        k: jsonable(v)
        for k, v in last.items()
        if k.startswith(("accuracy", "loss", "val_", "epsilon", "attack_"))
    }
    final.update(client_fairness(client_accuracies(last)))  # personalized protocol: who is left behind
    extra = sim.algorithm.run_summary()  # DP: the guarantee, ε from both accountants with their adjacency
    privacy = extra.get("privacy", {})
    final.update({k: privacy[k] for k in ("epsilon_rdp", "epsilon_pld") if isinstance(privacy.get(k), float)})
    summary: dict[str, Any] = {
        "final": final,
        "rounds": sim.round,
        "wall_seconds": wall,
        "bytes_up": sim.bytes_up,
        "bytes_down": sim.bytes_down,
        "seconds": {k: round(v, 4) for k, v in sim.times.__dict__.items()},
        # the work spent, steps and samples (fedskew.engine.compute); it counts the clients' batches, a
        # statistic of their data sizes no noise covers: withheld under DP like the other such statistics
        **({"compute": sim.compute.summary()} if sim.algorithm.discloses_client_statistics else {}),
        "algorithm": cfg.algorithm.name,
        "dataset": cfg.data.dataset,
        "model": cfg.model.name,
        "seed": cfg.seed,
        "protocol": cfg.eval.protocol,
        "skipped_rounds": list(sim.skipped),
        "version": fedskew.__version__,
        **extra,
        **assess(sim.round, sim.skipped, sim.history, cfg.engine.max_skipped_share),
    }
    if provenance is not None:
        summary["provenance"] = provenance
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
    states = out / STATES_DIR
    if states.is_symlink():  # a run never makes one: spilling (and deleting) through it would leave `out`
        if resume and exists:
            raise FedskewError(
                f"'{STATES_DIR}' in '{out}' is a symbolic link, which no run makes; refusing to resume "
                "through it (rerun with --force to start over)"
            )
        if force:
            states.unlink()  # the link, never what it points to
    if resume and exists:
        saved = out / CONFIG_FILE
        # every changed key named; only rounds may change (an exact extension: experiment/extension.py)
        extend = saved.is_file() and check_resume_config(read_saved_config(saved), cfg, saved)
        ckpt = load_checkpoint(out)
        if extend:
            ckpt = extended_checkpoint(ckpt, cfg, out)
            if ckpt is not None and ckpt["round"] < cfg.rounds:  # more rounds to go: the summary is stale
                (out / SUMMARY_FILE).unlink(missing_ok=True)
        return ckpt
    if force:
        for name in (METRICS_FILE, SUMMARY_FILE, CHECKPOINT_FILE, CHECKPOINT_PREV):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / STATES_DIR, ignore_errors=True)
    return None
