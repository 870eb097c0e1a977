"""MP-FedCL clustering cost: k-means for one client, and the share of a round spent clustering.

Target: k-means for one client, 10 classes x 300 points x 256 dims, K = 4, under 50 ms on CPU
(one thread); the script exits with status 1 if fedskew's k-means misses it. Rows compare fedskew's torch
k-means (the one MP-FedCL uses: Lloyd, random or k-means++ seeding, max 300 iterations, tol 1e-4) with
scikit-learn's KMeans on the same data, and time DBSCAN (DP-FedCL). The second table runs the MNIST
Table VI config (``configs/mpfedcl/mnist-dir0.05.yaml``; scikit-learn digits when ``FEDSKEW_DATA`` is unset)
and reports how much of each round the clustering takes. Writes ``benchmarks/results/cluster_speed.json``.

    python benchmarks/cluster_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fedskew.algorithms.mpfedcl as mp
from fedskew.experiment.config import build_config, load_config
from fedskew.experiment.runner import build_simulation
from proto_speed import median_ms  # this folder is on sys.path when a benchmark script runs

RESULTS = Path(__file__).parent / "results"
CONFIG = Path(__file__).parent.parent / "configs" / "mpfedcl" / "mnist-dir0.05.yaml"
TARGET_MS = 50.0


def client_embeddings(classes: int = 10, per_class: int = 300, dim: int = 256) -> list[torch.Tensor]:
    """Normalised embeddings with 4 sub-clusters per class, like a trained encoder's output."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(classes):
        centers = torch.randn(4, dim, generator=g)
        pick = torch.randint(0, 4, (per_class,), generator=g)
        out.append(
            torch.nn.functional.normalize(centers[pick] + 0.5 * torch.randn(per_class, dim, generator=g))
        )
    return out


def clustering_rows(reps: int) -> list[dict[str, Any]]:
    from sklearn.cluster import KMeans

    data = client_embeddings()

    def ours(init: str) -> Callable[[], Any]:
        def run() -> None:
            g = torch.Generator().manual_seed(0)
            for v in data:
                mp.cluster_class(v, "kmeans", 4, g, init, 0.5, 2)

        return run

    def sklearn_kmeans() -> None:
        for v in data:
            KMeans(4, init="random", n_init=1, max_iter=300, tol=1e-4, random_state=0).fit(v.numpy())

    def dbscan() -> None:
        g = torch.Generator().manual_seed(0)
        for v in data:
            mp.cluster_class(v, "dbscan", 4, g, "random", 0.5, 2)

    rows = [
        ("fedskew kmeans, random init (MP-FedCL default)", ours("random")),
        ("fedskew kmeans, k-means++ init", ours("kmeans++")),
        ("scikit-learn KMeans, random init, n_init=1", sklearn_kmeans),
        ("DBSCAN eps=0.5 (DP-FedCL)", dbscan),
    ]
    return [{"op": op, "ms": median_ms(fn, reps)} for op, fn in rows]


def round_share(rounds: int) -> dict[str, Any]:
    """Seconds per round and seconds in clustering, on the MNIST config (digits without FEDSKEW_DATA)."""
    if os.environ.get("FEDSKEW_DATA"):
        cfg, data = load_config(CONFIG), "MNIST (configs/mpfedcl/mnist-dir0.05.yaml)"
    else:
        raw = json.loads(load_config(CONFIG).model_dump_json())
        raw["data"] = {
            "dataset": "digits",
            "num_clients": 5,
            "partition": raw["data"]["partition"],
            "test": {"fraction": 1.0},
        }
        cfg, data = build_config(raw), "scikit-learn digits (set FEDSKEW_DATA for MNIST)"
    sim = build_simulation(cfg)
    spent = [0.0]
    original = mp.cluster_class

    def timed(*args: Any, **kw: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = original(*args, **kw)
        spent[0] += time.perf_counter() - t0
        return out

    mp.cluster_class = timed
    try:
        sim.run_round()  # warm-up (round 1 trains without a pool)
        spent[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(rounds):
            sim.run_round()
        total = time.perf_counter() - t0
    finally:
        mp.cluster_class = original
    return {
        "data": data,
        "rounds": rounds,
        "s_per_round": total / rounds,
        "cluster_s_per_round": spent[0] / rounds,
        "share": spent[0] / total,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and rounds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps = 3 if args.quick else 15
    rows = clustering_rows(reps)
    width = max(len(r["op"]) for r in rows)
    print(
        f"{'one client: 10 classes x 300 points x 256 dims, K=4':<{width}}  ms (median of {reps}, 1 thread)"
    )
    for r in rows:
        print(f"{r['op']:<{width}}  {r['ms']:8.2f}")
    share = round_share(2 if args.quick else 5)
    print(
        f"\nMP-FedCL round on {share['data']}: {share['s_per_round']:.3f} s/round, clustering "
        f"{share['cluster_s_per_round']:.3f} s ({100 * share['share']:.1f}% of the round)"
    )
    ok = rows[0]["ms"] < TARGET_MS
    print(
        f"fedskew k-means for one client: {rows[0]['ms']:.1f} ms "
        f"({'meets' if ok else 'MISSES'} the 50 ms target)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster_speed.json").write_text(
        json.dumps({"reps": reps, "rows": rows, "round": share}, indent=2)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
