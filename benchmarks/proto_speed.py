"""Milliseconds for the prototype primitives (fedskew.algorithms.protos) on FedProto / MP-FedCL sized inputs.

Target: nearest-prototype prediction for 10,000 samples x 10 classes x 50 dims under 20 ms on CPU (one
thread); the script exits with status 1 if that row misses it. Also times the class-mean accumulation, the
server aggregation of 20 clients' uploads, the K-prototype variant and k-means. Writes
``benchmarks/results/proto_speed.json``.

    python benchmarks/proto_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedskew.algorithms.protos import aggregate_prototypes, class_means, kmeans, nearest_prototype_scores

RESULTS = Path(__file__).parent / "results"
TARGET_MS = 20.0


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps = 5 if args.quick else 30
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, 50, generator=g)
    y = torch.randint(0, 10, (10_000,), generator=g)
    table = torch.randn(10, 50, generator=g)
    mask = torch.rand(10, generator=g) > 0.5
    multi = torch.randn(10, 5, 50, generator=g)
    uploads = torch.randn(80, 50, generator=g)  # 20 clients x 4 classes
    up_cls = torch.randint(0, 10, (80,), generator=g)
    up_cnt = torch.randint(90, 110, (80,), generator=g)
    rows = [
        (
            "nearest_prototype_scores [C, D]",
            "10k x 10 x 50",
            lambda: nearest_prototype_scores(x, table).argmax(1),
        ),
        ("  + class mask", "10k x 10 x 50", lambda: nearest_prototype_scores(x, table, mask).argmax(1)),
        (
            "nearest_prototype_scores [C, K, D]",
            "10k x 10 x 5 x 50",
            lambda: nearest_prototype_scores(x, multi),
        ),
        ("class_means (Eq. 3)", "10k x 50, 10 classes", lambda: class_means(x, y, 10)),
        (
            "aggregate_prototypes weighted",
            "20 clients x 4 classes",
            lambda: aggregate_prototypes(up_cls, uploads, up_cnt, 10),
        ),
        ("kmeans K=5", "1k x 50", lambda: kmeans(x[:1000], 5, generator=torch.Generator().manual_seed(0))),
    ]
    results = [{"op": op, "size": size, "ms": median_ms(fn, reps)} for op, size, fn in rows]
    width = max(len(r["op"]) for r in results)
    print(f"{'operation':<{width}}  {'size':<22}  ms (median of {reps}, 1 thread)")
    for r in results:
        print(f"{r['op']:<{width}}  {r['size']:<22}  {r['ms']:8.3f}")
    ok = results[0]["ms"] < TARGET_MS
    print(
        f"\nnearest prototype, 10k x 10 x 50: {results[0]['ms']:.2f} ms "
        f"({'meets' if ok else 'MISSES'} the 20 ms target)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "proto_speed.json").write_text(json.dumps({"reps": reps, "rows": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
