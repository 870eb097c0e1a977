"""Run every benchmark script in this folder (``make bench``; ``make bench QUICK=1`` for short versions).

Each script prints its own table and writes ``benchmarks/results/<workload>.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shortened version of each benchmark")
    args = ap.parse_args()
    skip = (
        "run_all.py",
        "__init__.py",
        "flower_peer.py",
        "pfl_peer.py",
        "flower_bare.py",
        "speed_stats.py",
    )  # the peers are modules of engine_speed.py and flower_runtime.py; speed_stats is their helper
    scripts = sorted(p for p in HERE.glob("*.py") if p.name not in skip)
    failed = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        if subprocess.run(cmd).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
