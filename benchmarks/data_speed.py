"""Seconds to load a dataset into uint8 tensors: MNIST and Fashion-MNIST from their gzipped IDX files, and the
bundled scikit-learn digits.

``cold`` hashes the files for checksum verification (no cached stamp), ``warm`` is every later load
(verification answered by the stamp). Needs ``$FEDSKEW_DATA`` (e.g. ``../shared/data``) for the IDX rows;
digits always runs. Writes ``benchmarks/results/data_speed.json``.

    python benchmarks/data_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from fedskew.data.checksums import cold_verification
from fedskew.data.datasets import load_dataset

RESULTS = Path(__file__).parent / "results"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cold(name: str, root: str | None) -> float:
    """One load with checksum hashing forced (stamps and the in-process memo ignored)."""
    with cold_verification():
        return timed(lambda: load_dataset(name, root))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    reps = 2 if args.quick else 5
    root = os.environ.get("FEDSKEW_DATA")
    rows = []
    names = ["mnist", "fashion_mnist"] if root else []
    if not root:
        print("FEDSKEW_DATA is unset: skipping MNIST / Fashion-MNIST (set it to e.g. ../shared/data)")
    for name in names:
        c = cold(name, root)
        w = statistics.median(timed(lambda n=name: load_dataset(n, root)) for _ in range(reps))
        d = load_dataset(name, root)
        rows.append({"dataset": name, "samples": len(d.y_train) + len(d.y_test), "cold_s": c, "warm_s": w})
    load_dataset("digits")  # first call imports scikit-learn: keep that out of the timing
    w = statistics.median(timed(lambda: load_dataset("digits")) for _ in range(reps))
    rows.append({"dataset": "digits", "samples": 1797, "cold_s": None, "warm_s": w})

    print(f"{'dataset':<15}{'samples':>9}{'cold s':>9}{'warm s':>9}")
    for r in rows:
        c = f"{r['cold_s']:.3f}" if r["cold_s"] is not None else "-"
        print(f"{r['dataset']:<15}{r['samples']:>9}{c:>9}{r['warm_s']:>9.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = {"workload": "data_speed", "repetitions": reps, "cpu_threads": os.cpu_count(), "rows": rows}
    (RESULTS / "data_speed.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
