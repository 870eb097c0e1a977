"""``engine.mode`` and ``engine.memory_format``: which executor trains the clients, in which layout.

The ``auto`` rules are measured on this project's 2-core CPU machine (docs/performance.md): vmap wins on
small models at small batches and loses on large convolutions; worker processes win once a client's round
is a few hundred samples x epochs; NHWC convolutions are 1.1-1.6x faster on CPU. ``auto`` never vectorizes
a model with dropout, because vmap's dropout stream differs from the sequential loop's, so ``auto`` always
reproduces the sequential numbers.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from fedskew.engine.executors import Executor, SequentialExecutor, VectorizedExecutor
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.vectorized import unsupported_reason
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


def _has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def choose_mode(rt: ClientRuntime, engine: EngineSection, cids: list[int]) -> tuple[str, str]:
    """``(mode, why)``: ``vectorized``, ``vectorized+workers`` (a vmapped group of clients per worker
    process), ``workers`` or ``sequential``, from ``engine.mode``, ``engine.workers`` and the workload."""
    model = rt.models.model_for(cids[0])
    vec_reason = unsupported_reason(rt.algorithm, model)
    pool_reason = pool_supported(rt.device) if engine.workers > 1 else "engine.workers=1"
    params = sum(p.numel() for p in model.parameters())
    batch = rt.client.batch_size
    if engine.mode == "vectorized" and vec_reason is not None:
        log.warning("engine.mode=vectorized: %s", vec_reason)
    small = params <= AUTO_VECTOR_MAX_PARAMS and batch <= AUTO_VECTOR_MAX_BATCH
    wants_vector = engine.mode == "vectorized" or (
        engine.mode == "auto" and small and not _has_dropout(model)
    )
    if vec_reason is None and wants_vector:
        why = f"{params:,} parameters, batch {batch}"
        if pool_reason is None:  # a group of clients per worker
            return "vectorized+workers", f"{why}, {engine.workers} processes"
        return "vectorized", why
    work = float(np.mean([rt.data.size(c) for c in cids])) * rt.client.epochs
    big_enough = engine.mode != "auto" or work >= AUTO_WORKERS_MIN_SAMPLES
    if pool_reason is None and big_enough:
        return "workers", f"{engine.workers} processes"
    reasons = [r for r in (vec_reason, pool_reason if engine.workers > 1 else None) if r]
    if engine.workers > 1 and not reasons:
        reasons = [f"clients too small for workers (< {AUTO_WORKERS_MIN_SAMPLES} samples x epochs)"]
    return "sequential", "; ".join(reasons) or "engine.workers=1"


def make_executor(rt: ClientRuntime, engine: EngineSection, cids: list[int]) -> Executor:
    """The executor for ``engine`` and the first round's clients ``cids``; the choice is logged."""
    mode, why = choose_mode(rt, engine, cids)
    log.info("engine.mode=%s: training clients %s (%s)", engine.mode, mode, why)
    if mode == "sequential":
        return SequentialExecutor(rt)
    if mode == "vectorized":
        return VectorizedExecutor(rt, engine.memory_mb)
    return WorkerExecutor(rt, engine.workers, mode == "vectorized+workers", engine.memory_mb)
