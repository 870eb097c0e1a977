"""Repeated, interleaved timings and their intervals, for ``engine_speed.py``.

Each side (a fedskew engine mode, a peer) runs ``repeats`` times in fresh processes, interleaved: repeat
``i`` runs every side once, in the listed order on even repeats and reversed on odd ones, so a drift of the
machine's speed during the run (other tenants of the host, thermal state) falls on every side alike.

Reported per side: the median seconds per round over the repeats with their min–max. Per comparison: the
ratio ``peer / fedskew`` of each repeat (paired: both measured within the same repeat), their median with
min–max and a distribution-free interval of the median (order statistics, at least 95% coverage where the
number of repeats allows it: 93.75% with 5, 96.1% with 9; :func:`median_interval`).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Sequence
from typing import Any

import torch

#: CPU flags that decide which kernels torch runs
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY")
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")


def interleaved(sides: Sequence[Any], repeats: int) -> list[tuple[int, Any]]:
    """``(repeat, side)`` in run order: every side once per repeat, reversed on odd repeats."""
    order = []
    for r in range(repeats):
        order += [(r, s) for s in (sides if r % 2 == 0 else list(reversed(sides)))]
    return order


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and min–max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval of the median: order statistics ``(x_(k), x_(n+1-k))`` with the largest
    ``k`` whose coverage ``1 - 2 P(Bin(n, 1/2) < k)`` is at least ``level`` (``k = 1``, min–max, when even
    that is below it: 93.75% for n = 5). Returns ``(low, high, coverage)``."""
    v, n = sorted(values), len(values)
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]  # P(Bin(n, 1/2) = i)
    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * sum(below[: k + 1]) >= level:
        k += 1
    return v[k - 1], v[n - k], 1 - 2 * sum(below[:k])


def paired_ratio(peer: Sequence[float], ours: Sequence[float]) -> dict[str, float]:
    """``peer / ours`` per repeat: median, min–max and the distribution-free 95% interval of the median."""
    ratios = [p / o for p, o in zip(peer, ours, strict=True)]
    lo, hi, coverage = median_interval(ratios)
    return {**spread(ratios), "ci_low": lo, "ci_high": hi, "coverage": coverage, "n": len(ratios)}


def cpu_info() -> dict[str, Any]:
    """The machine: CPU model, the kernel-relevant flags, torch's kernel level and thread settings."""
    model, flags = platform.processor() or "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "flags": [f for f in KERNEL_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
        "torch": torch.__version__,
    }


def fmt(s: dict[str, float]) -> str:
    """``median [min–max]``."""
    return f"{s['median']:.3f} [{s['min']:.3f}–{s['max']:.3f}]"


def fmt_ratio(r: dict[str, float]) -> str:
    ci = f"{100 * r['coverage']:.1f}% CI {r['ci_low']:.2f}–{r['ci_high']:.2f}"
    return f"{r['median']:.2f}x ({ci}; range {r['min']:.2f}–{r['max']:.2f})"
