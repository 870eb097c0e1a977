"""``engine.mode`` and ``engine.memory_format``: which executor trains the clients, in which layout.

``engine.mode`` names an executor kind registered in :data:`~fedskew.engine.executors.EXECUTORS`, or
``auto``. The ``auto`` rules are measured on this project's 2-core CPU machine (docs/performance.md): vmap
wins on small models at small batches and loses on large convolutions; worker processes win once a
client's round is a few hundred samples x epochs, or whatever the clients' size when the method's mean is
folded in the workers (:mod:`fedskew.engine.folding`: no upload is shipped); NHWC convolutions are
1.1-1.6x faster on CPU. ``auto`` never vectorizes a model with dropout, because vmap's dropout stream
differs from the sequential loop's, so ``auto`` always reproduces the sequential numbers.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from fedskew.engine import executors, workers  # noqa: F401  (the built-in executor kinds register)
from fedskew.engine.executors import EXECUTORS, Executor, ExecutorKind, InProcessExecutor
from fedskew.engine.folding import FoldedRound, FoldingExecutor, folds_uploads
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.engine.workers import WorkerExecutor, pool_supported
from fedskew.settings import EngineSection

log = logging.getLogger("fedskew.engine")

#: engine.mode=auto trains vectorized up to this many parameters and this batch size
AUTO_VECTOR_MAX_PARAMS, AUTO_VECTOR_MAX_BATCH = 100_000, 16
#: engine.mode=auto uses workers only when a client's round is at least this many samples x epochs
AUTO_WORKERS_MIN_SAMPLES = 256


def memory_format(setting: str, device: torch.device, mode: str) -> str:
    """``channels_last`` (NHWC) or ``contiguous``: ``auto`` is NHWC on CPU outside the vectorized mode
    (oneDNN's grouped convolutions under vmap are NCHW-only fast paths). Values are unchanged; only the
    layout, and so the order of floating-point sums, differs."""
    if setting != "auto":
        return setting
    return "channels_last" if device.type == "cpu" and mode != "vectorized" else "contiguous"


def modes() -> list[str]:
    """The values of ``engine.mode``: ``auto`` and every registered executor kind."""
    return ["auto", *EXECUTORS.names()]


def _has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def _auto_kind(rt: ClientRuntime, engine: EngineSection, cids: list[int]) -> tuple[ExecutorKind, str, bool]:
    """``engine.mode=auto``: ``(kind, why, pooled)``: vectorized for small dropout-free models at small
    batches, else workers when the clients are large enough to pay for shipping them, else sequential."""
    model = rt.models.model_for(cids[0])
    vec = EXECUTORS.get("vectorized")(engine)
    vec_reason = vec.unsupported(rt, cids)
    pool_reason = pool_supported(rt.device) if engine.workers > 1 else "engine.workers=1"
    params = sum(p.numel() for p in model.parameters())
    batch = rt.client.batch_size
    small = params <= AUTO_VECTOR_MAX_PARAMS and batch <= AUTO_VECTOR_MAX_BATCH
    if vec_reason is None and small and not _has_dropout(model):
        return vec, f"{params:,} parameters, batch {batch}", pool_reason is None
    seq = EXECUTORS.get("sequential")(engine)
    work = float(np.mean([rt.data.size(c) for c in cids])) * rt.client.epochs
    if pool_reason is None and work >= AUTO_WORKERS_MIN_SAMPLES:
        return seq, "", True
    if pool_reason is None and engine.fold_uploads and folds_uploads(rt.algorithm):
        # folded in the workers, a round ships no upload: many small clients pay for the processes too
        return seq, "the mean folded in the workers", True
    reasons = [r for r in (vec_reason, pool_reason if engine.workers > 1 else None) if r]
    if engine.workers > 1 and not reasons:
        reasons = [f"clients too small for workers (< {AUTO_WORKERS_MIN_SAMPLES} samples x epochs)"]
    return seq, "; ".join(reasons) or "engine.workers=1", False


def _named_kind(rt: ClientRuntime, engine: EngineSection, cids: list[int]) -> tuple[ExecutorKind, str, bool]:
    """``engine.mode=<kind>``: that kind (sequential, with the reason logged, when it cannot train these
    clients), in worker processes when ``engine.workers > 1`` allows."""
    kind = EXECUTORS.get(engine.mode)(engine)
    reason = kind.unsupported(rt, cids)
    if reason is not None:
        log.warning("engine.mode=%s: %s", engine.mode, reason)
        kind = EXECUTORS.get("sequential")(engine)
    pool_reason = pool_supported(rt.device) if engine.workers > 1 else "engine.workers=1"
    why = ""
    if kind.name == "vectorized":
        model = rt.models.model_for(cids[0])
        why = f"{sum(p.numel() for p in model.parameters()):,} parameters, batch {rt.client.batch_size}"
    return kind, "; ".join(r for r in (why, reason, pool_reason) if r), pool_reason is None


def make_executor(rt: ClientRuntime, engine: EngineSection, cids: list[int]) -> Executor:
    """The executor for ``engine`` and the first round's clients ``cids``; the choice is logged. The first
    client's model instance is built here whatever the mode (the rules read it), so model instances are
    built at the same point of the run, from the same generator state, in every mode."""
    rt.models.model_for(cids[0])
    choose = _auto_kind if engine.mode == "auto" else _named_kind
    kind, why, pooled = choose(rt, engine, cids)
    if pooled:
        executor: Executor = WorkerExecutor(rt, kind, engine.workers)
        why = f"{why}, {engine.workers} processes" if why else f"{engine.workers} processes"
    else:
        executor = InProcessExecutor(rt, kind)
    log.info("engine.mode=%s: training clients %s (%s)", engine.mode, executor.name, why)
    return executor


class EmbeddedExecutor:
    """The embedded engine's executor: trains in this machine's processes from the :class:`ClientRuntime`
    it holds (the only place the embedded engine builds one), with the executor ``engine.mode`` names,
    chosen on the first round (the ``auto`` rules look at the round's clients)."""

    def __init__(self, runtime: ClientRuntime, engine: EngineSection) -> None:
        self.runtime, self.engine = runtime, engine
        self.chosen: Executor | None = None

    @property
    def name(self) -> str:
        """The chosen executor's name (``engine.mode`` until the first round)."""
        return self.chosen.name if self.chosen is not None else self.engine.mode

    @property
    def processes(self) -> int:
        """Worker processes alive now (0 in-process)."""
        return int(getattr(self.chosen, "processes", 0))

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        if self.chosen is None:
            self.chosen = make_executor(self.runtime, self.engine, job.cids)
        return self.chosen.train(job)

    def train_folded(self, job: RoundJob) -> FoldedRound:
        """The chosen executor's folded round (:mod:`fedskew.engine.folding`), or its plain one."""
        if self.chosen is None:
            self.chosen = make_executor(self.runtime, self.engine, job.cids)
        if isinstance(self.chosen, FoldingExecutor):
            return self.chosen.train_folded(job)
        return FoldedRound(self.chosen.train(job), None)

    def close(self) -> None:
        if self.chosen is not None:
            self.chosen.close()
