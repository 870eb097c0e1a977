"""Seconds to partition MNIST-sized labels (60,000 train / 10,000 test, 10 classes) with every scheme.

Labels are synthetic with MNIST's class frequencies (no files needed). The target is Dirichlet(0.1) of 60k
labels into 1,000 clients in under 2 s; the script exits with status 1 if that row misses it. Writes
``benchmarks/results/partition_speed.json``.

    python benchmarks/partition_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.data.base import Dataset
from fedskew.data.federated import build_federated
from fedskew.data.partition import apply_partition, client_test_split

RESULTS = Path(__file__).parent / "results"
MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
TARGET_S = 2.0


def labels(counts: list[int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(counts)), counts))


def median_time(fn, reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition per row")
    args = ap.parse_args()
    reps = 1 if args.quick else 3
    y, y_test = labels(MNIST_TRAIN, 0), labels(MNIST_TEST, 1)
    domains = np.random.default_rng(2).integers(0, 5, len(y))
    rows: list[dict[str, Any]] = []

    def part(spec: dict, n: int, note: str = "", **kw: Any) -> list[np.ndarray]:
        t, parts = median_time(lambda: apply_partition(spec, y, n, 0, num_classes=10, **kw), reps)
        sizes = np.array([len(p) for p in parts])
        rows.append(
            {
                "workload": json.dumps(spec).replace('"', ""),
                "clients": n,
                "seconds": t,
                "used": int(sizes.sum()),
                "min_size": int(sizes.min()),
                "max_size": int(sizes.max()),
                "note": note,
            }
        )
        return parts

    target = part({"name": "dirichlet", "alpha": 0.1, "min_size": 0}, 1000, "target < 2 s")
    part({"name": "dirichlet", "alpha": 0.1, "min_size": 10}, 100, "NIID-Bench default min_size")
    part({"name": "dirichlet", "alpha": 0.5, "min_size": 10}, 500)
    part({"name": "dirichlet", "alpha": 0.1, "mode": "per_client"}, 1000)
    part({"name": "iid"}, 1000)
    part({"name": "iid", "unbalanced_sigma": 1.0}, 1000)
    part({"name": "quantity", "distribution": "powerlaw"}, 1000)
    part({"name": "shards"}, 100, "McMahan: 200 shards of 300")
    part({"name": "classes_per_client", "k": 2}, 1000)
    fedproto = part({"name": "nway_kshot", "n": 3, "stdev": 2, "k": 100}, 20, "FedProto MNIST")
    part({"name": "longtail", "rho": 100, "then": {"name": "dirichlet", "alpha": 0.2}}, 20, "FedSKC LT")
    part({"name": "domain", "label_skew": {"name": "dirichlet", "alpha": 0.5}}, 50, domains=domains)

    big_train = [y[p] for p in target]
    for rule, tr, note in [
        ({}, big_train, "1,000 Dirichlet clients"),
        ({"per_class": 40}, [y[p] for p in fedproto], "FedProto: 40 per class"),
    ]:
        t, (tests, info) = median_time(lambda r=rule, tr=tr: client_test_split(tr, y_test, 0, **r), reps)
        rows.append(
            {
                "workload": f"client_test_split {rule or 'default'}",
                "clients": len(tr),
                "seconds": t,
                "used": int(sum(len(s) for s in tests)),
                "min_size": int(min(len(s) for s in tests)),
                "max_size": int(max(len(s) for s in tests)),
                "note": f"{note}; disjoint={info['disjoint']}",
            }
        )

    ds = Dataset(
        "mnist-labels",
        torch.zeros(len(y), 1, 1, 1, dtype=torch.uint8),
        torch.from_numpy(y),
        torch.zeros(len(y_test), 1, 1, 1, dtype=torch.uint8),
        torch.from_numpy(y_test),
        10,
    )
    spec = {"name": "dirichlet", "alpha": 0.1, "min_size": 10}
    t, fd = median_time(lambda: build_federated(ds, 100, spec, 0, val_fraction=0.1), reps)
    sizes = fd.client_sizes
    rows.append(
        {
            "workload": "build_federated dirichlet(0.1) + test + val",
            "clients": 100,
            "seconds": t,
            "used": int(sizes.sum()),
            "min_size": int(sizes.min()),
            "max_size": int(sizes.max()),
            "note": "tensors, per-client test, 10% val",
        }
    )

    width = max(len(r["workload"]) for r in rows)
    print(f"{'workload':<{width}}  clients  seconds    used   min    max  note")
    for r in rows:
        print(
            f"{r['workload']:<{width}}  {r['clients']:>7}  {r['seconds']:>7.3f}  {r['used']:>6}  "
            f"{r['min_size']:>4}  {r['max_size']:>5}  {r['note']}"
        )
    ok = rows[0]["seconds"] < TARGET_S
    print(
        f"\nDirichlet(0.1), 60k labels -> 1,000 clients: {rows[0]['seconds']:.3f} s "
        f"({'meets' if ok else 'MISSES'} the {TARGET_S:.0f} s target)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "partition_speed.json").write_text(json.dumps({"reps": reps, "rows": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
