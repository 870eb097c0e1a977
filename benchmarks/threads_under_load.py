"""`fedskew demo` on a quiet machine and beside a CPU hog, for three thread settings (docs/performance.md,
"Threads under load").

Settings: torch's default (one thread per core: what `fedskew demo` did before the thread policy, now
`--threads <cores>`), fedskew's default policy (no flag: the free cores divided by the processes) and
`--threads 1`. The hog is ``--hogs`` busy-looping processes (default: one per core), started before and
killed after each loaded run. Each cell is the median wall time of ``--repeat`` runs of the installed CLI
(a fresh process: start-up included), and the threads the run used as its summary's provenance records.
"background" is the cores other processes kept busy just before the setting's quiet runs (measured over
one second): on a shared machine a "quiet" run is only as quiet as that.

    .venv/bin/python benchmarks/threads_under_load.py  # --rounds 5 --repeat 3

The target (issue 54): the default policy under the hog within 1.5x of its quiet time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedskew.threads import busy_cores

FEDSKEW = str(Path(sys.executable).parent / "fedskew")


def _spin() -> None:
    while True:
        pass


class Hog:
    """``n`` busy-looping processes for the length of a ``with`` block."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[mp.Process] = []

    def __enter__(self) -> Hog:
        self.procs = [mp.Process(target=_spin, daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(1.0)  # let the scheduler see them busy before the run samples the load
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.join()


def run_demo(flags: list[str], rounds: int, timeout: float) -> tuple[float, str]:
    """Wall seconds of one `fedskew demo` and the threads its runs recorded (``?`` if none)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    with tempfile.TemporaryDirectory(prefix="fedskew-threads-") as tmp:
        out = Path(tmp) / "demo"
        cmd = [FEDSKEW, "demo", "--rounds", str(rounds), "--out", str(out), *flags]
        t0 = time.perf_counter()
        try:
            subprocess.run(cmd, env=env, cwd=tmp, check=True, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return float("inf"), "?"
        seconds = time.perf_counter() - t0
        summary = json.loads((out / "fedavg" / "summary.json").read_text())
        threads = summary.get("provenance", {}).get("machine", {}).get("threads", "?")
        return seconds, str(threads)


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="demo rounds (the full demo: 30)")
    ap.add_argument("--hogs", type=int, default=cores, help="busy-looping processes beside the run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell (the median is shown)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as too slow")
    args = ap.parse_args()
    settings = {
        f"torch default (--threads {cores})": ["--threads", str(cores)],
        "fedskew default (no flag)": [],
        "--threads 1": ["--threads", "1"],
    }
    print(f"fedskew demo --rounds {args.rounds}; {cores} cores; hog: {args.hogs} busy loops")
    print("| threads setting | background | quiet s (threads) | under hog s (threads) | hog / quiet |")
    print("|---|---|---|---|---|")
    for label, flags in settings.items():
        background = busy_cores(1.0)
        quiet = [run_demo(flags, args.rounds, args.timeout) for _ in range(args.repeat)]
        loaded = []
        for _ in range(args.repeat):
            with Hog(args.hogs):
                loaded.append(run_demo(flags, args.rounds, args.timeout))
        q = statistics.median(s for s, _ in quiet)
        h = statistics.median(s for s, _ in loaded)
        print(
            f"| {label} | {background:.1f} cores | {q:.1f} ({quiet[0][1]}) | {h:.1f} ({loaded[0][1]}) "
            f"| {h / q:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
