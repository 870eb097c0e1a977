"""The device a run trains on, its numeric precision, and what a GPU changes.

``engine.device: auto`` (the default) takes CUDA when a CUDA device is present, else Apple's MPS, else the
CPU; the choice is logged, and the embedded runtime writes it into ``config.yaml`` (a resumed run resolves
``auto`` again on the same machine to the same device). An explicit ``cpu``, ``cuda``, ``cuda:N`` or ``mps``
is used as given, or refused with one line when the machine has no such device.

``engine.precision: bf16`` runs every forward pass (local losses and evaluation) under
:func:`torch.autocast` with bfloat16; parameters, gradients, optimizer state and aggregation stay float32.
The default ``fp32`` adds nothing: the numbers are those of a plain float32 run.

``engine.deterministic`` asks torch for deterministic algorithms (:func:`torch.use_deterministic_algorithms`,
cuBLAS' fixed workspace, cuDNN without benchmarking) for the duration of a run; an operation that has no
deterministic implementation then fails with torch's own message instead of running nondeterministically.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

from fedskew.errors import ConfigError

log = logging.getLogger("fedskew.engine")

#: share of the free GPU memory one vectorized chunk of clients may take (the rest: evaluation, the
#: allocator's fragmentation, other processes)
GPU_CHUNK_SHARE = 0.5
#: cuBLAS' setting for reproducible GEMMs (NVIDIA's cuBLAS docs, "Results reproducibility")
CUBLAS_WORKSPACE = ":4096:8"


def available_device() -> torch.device:
    """The best device present: CUDA (the current one), else MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(name: str) -> torch.device:
    """``engine.device`` as a :class:`torch.device`: ``auto`` resolved (and logged), an explicit device
    checked against the machine (a one-line :class:`ConfigError` naming the key and what is available)."""
    if name == "auto":
        device = available_device()
        extra = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
        log.info("engine.device=auto: running on %s%s", device, extra)
        return device
    device = torch.device(name)
    key = f"config key 'engine.device': {name}"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{key}, but there is no CUDA device; allowed here: auto, cpu")
        if device.index is not None and device.index >= count:
            allowed = ", ".join(["auto", "cpu", "cuda", *(f"cuda:{i}" for i in range(count))])
            raise ConfigError(f"{key}, but this machine has {count} CUDA devices; allowed here: {allowed}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}, but MPS is not available; allowed here: auto, cpu")
    return device


def precision_context(device: torch.device, precision: str) -> AbstractContextManager[object]:
    """The context a forward pass runs in: nothing for ``fp32``, bfloat16 autocast for ``bf16``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def chunk_budget_mb(device: torch.device, memory_mb: float) -> float:
    """The memory one vectorized chunk of clients may take: ``engine.memory_mb`` on a CPU, a share of the
    device's free memory on a GPU (a CPU budget would leave most of a GPU idle)."""
    if device.type != "cuda":
        return memory_mb
    free, _total = torch.cuda.mem_get_info(device)
    return GPU_CHUNK_SHARE * free / 2**20


def use_deterministic_algorithms() -> None:
    """Torch's deterministic algorithms for the rest of the process (a Flower ClientApp process serves one
    message); runs that share a process use :func:`deterministic_algorithms` instead."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Within the block, torch's deterministic algorithms (when ``enabled``); the process's settings are
    restored after it, so one run does not change the next."""
    if not enabled:
        yield
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    use_deterministic_algorithms()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.benchmark = saved[1]
        if saved[2] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
