"""The thread policy of every process fedskew runs: ``fedskew run``, ``demo``, ``sweep`` and Flower nodes.

Why: torch starts one intra-op thread per core in every process. Beside worker processes, sweep jobs,
Flower nodes or anybody else's work, those threads oversubscribe the cores, and OpenMP's fork-join
barriers then wait for threads the kernel has descheduled: on a 2-core machine with two busy processes
beside it the demo ran 3-30x slower with torch's default than with one thread (docs/performance.md,
"Threads under load"). So a process gets the cores that are free when the run starts divided by the
processes the run starts, at least one; ``engine.threads`` / ``--threads N`` pins the count instead.

Free cores = usable cores (CPU affinity, capped by a cgroup CPU quota) minus the cores other processes kept
busy over a short sample of ``/proc/stat``. Thread counts can change the last bits of CPU reductions, so
the count a run used is recorded (:func:`thread_info`, in the summary's provenance) rather than treated as a
result-changing key (docs/decisions.md). ``OMP_NUM_THREADS``, when the user set it, is taken as the
automatic count (the environment's explicit wish beats the machine's guess).

No torch import at module level: the CLI decides the count before anything imports torch.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any

from fedskew.errors import ConfigError

#: ``engine.threads`` / ``--threads`` value meaning "decide from the machine"
AUTO = 0
#: seconds of ``/proc/stat`` sampled to see how many cores other processes keep busy
SAMPLE_SECONDS = 0.25
_CGROUP = Path("/sys/fs/cgroup")
_STAT = Path("/proc/stat")
#: what :func:`apply_threads` last applied in this process: ``(threads, source)``
_applied: dict[str, Any] = {}


def cgroup_cpu_limit(root: Path = _CGROUP) -> float | None:
    """CPUs the cgroup quota allows this process (``cpu.max`` of cgroup v2, else v1's
    ``cpu.cfs_quota_us / cpu.cfs_period_us``), ``None`` without a quota."""
    try:
        quota, period = [*(root / "cpu.max").read_text().split(), "100000"][:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        pass
    for folder in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota_us = int((folder / "cpu.cfs_quota_us").read_text())
            period_us = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def affinity_cores() -> int:
    """CPUs this process may run on (its affinity mask; all CPUs where the platform has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cores(affinity: int | None = None, quota: float | None = None, root: Path = _CGROUP) -> int:
    """Cores this process may use: ``affinity`` (default: its affinity mask) capped by a cgroup CPU
    ``quota`` (default: read under ``root``), rounded down (a fraction of a core is not a thread's worth),
    at least one."""
    cores = affinity if affinity is not None else affinity_cores()
    limit = quota if quota is not None else cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, math.floor(limit))
    return max(1, cores)


def cpu_times(stat: Path = _STAT) -> tuple[int, int]:
    """``(busy, total)`` jiffies of all CPUs from the aggregate ``cpu`` line of ``/proc/stat``."""
    fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_between(before: tuple[int, int], after: tuple[int, int], cpus: int) -> float:
    """Cores kept busy between two :func:`cpu_times` samples of a machine with ``cpus`` CPUs."""
    total = after[1] - before[1]
    return 0.0 if total <= 0 else cpus * (after[0] - before[0]) / total


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """Cores other processes keep busy now (this process sleeps while sampling); 0 where ``/proc/stat``
    cannot be read."""
    try:
        before = cpu_times()
        time.sleep(seconds)
        return busy_between(before, cpu_times(), os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def auto_threads(processes: int, cores: int | None = None, busy: float | None = None) -> int:
    """Threads per process when a run starts ``processes`` processes: the free cores (``cores`` minus the
    ``busy`` ones, rounded to the nearest core) shared out equally, at least one."""
    cores = usable_cores() if cores is None else cores
    busy = busy_cores() if busy is None else busy
    free = min(cores, max(0, round(cores - busy)))
    return max(1, free // max(1, processes))


def env_threads() -> int | None:
    """``OMP_NUM_THREADS`` when the user set it to a positive integer."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def resolve_threads(requested: int, processes: int) -> tuple[int, str]:
    """``(threads, source)``: ``requested`` if positive ("explicit"), else ``OMP_NUM_THREADS`` if set, else
    :func:`auto_threads` over ``processes`` ("auto")."""
    if requested > AUTO:
        return requested, "explicit"
    env = env_threads()
    if env is not None:
        return env, "OMP_NUM_THREADS"
    return auto_threads(processes), "auto"


def run_processes(workers: int) -> int:
    """Processes an embedded run starts: the main one, plus ``workers`` worker processes when
    ``engine.workers > 1`` (one worker trains in the main process)."""
    return 1 + (workers if workers > 1 else 0)


def apply_threads(threads: int, source: str = "explicit") -> int:
    """Give this process ``threads`` torch intra-op threads (and as many inter-op threads where torch still
    allows it: only before its first inter-op work). Called before the run's first torch operation, OpenMP's
    pool starts at that size (``torch.set_num_threads`` sets OpenMP's and MKL's counts alike, so no
    environment variable is needed, and none is set: child processes get their count explicitly).
    Returns ``threads``."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # the inter-op pool has started already: it stays as it is
        torch.set_num_interop_threads(threads)
    _applied.update(threads=threads, source=source)
    return threads


def threads_in_use() -> int:
    """Torch intra-op threads of this process now (for provenance: what a run actually used)."""
    import torch

    return int(torch.get_num_threads())


def thread_info() -> dict[str, Any]:
    """The threads of this process for a run's provenance: intra-op and inter-op threads in use, how the
    count was chosen (explicit, OMP_NUM_THREADS, auto, or default: torch's own) and the usable cores."""
    import torch

    return {
        "threads": int(torch.get_num_threads()),
        "interop_threads": int(torch.get_num_interop_threads()),
        "threads_source": _applied.get("source", "default"),
        "usable_cores": usable_cores(),
    }


def apply_policy(requested: int, processes: int) -> int:
    """:func:`resolve_threads` then :func:`apply_threads`: the threads this process now has."""
    return apply_threads(*resolve_threads(requested, processes))


def check_threads_option(value: int | None, option: str = "--threads") -> None:
    """One-line :class:`ConfigError` for a negative thread count (0 is auto)."""
    if value is not None and value < 0:
        raise ConfigError(
            f"{option} {value}: allowed: 0 (auto: the free cores divided by the processes the run starts) "
            "or a positive number of threads"
        )
