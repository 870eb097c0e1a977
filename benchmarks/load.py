"""Load: peak memory and seconds per round of large federations on one machine.

FedAvg and SCAFFOLD (whose clients keep a control variate the size of the model: personal state) with the
default MNIST MLP (``mlp_mpfedcl``), 10,000 and 100,000 clients of 4 samples each (MNIST-shaped random
images, so no data download is needed and the dataset grows with the federation), 100 clients sampled a
round, global evaluation on 10,000 test images. Each configuration runs in its own process, so its peak RSS
(``ru_maxrss``) is its own; the table gives the peak RSS, the seconds per round (median of the timed rounds),
the clients' state memory budget (``engine.state_memory_mb``), the clients that have trained, the bytes of
their states held in memory and spilled to disk after the rounds (``fedskew.engine.states``), and the
state of one client that has trained.

    python benchmarks/load.py                  # 10k and 100k clients, 5 rounds
    python benchmarks/load.py --quick          # 10k clients, 3 rounds
    python benchmarks/load.py --budget 1024    # engine.state_memory_mb (default: the setting's default)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SAMPLES_PER_CLIENT = 4
PER_ROUND = 100
TEST = 10_000


def synthetic_mnist(n_train: int, seed: int = 0):  # type: ignore[no-untyped-def]
    from fedskew.data.base import Dataset

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n_train + TEST, 1, 28, 28), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (n_train + TEST,), generator=g)
    return Dataset(
        "synthetic-mnist", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10, (0.1307,), (0.3081,)
    )


def _state_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _spilled_bytes(sim) -> int:  # type: ignore[no-untyped-def]
    folder = sim.states.folder() if sim.states.spilled else None
    return sum(p.stat().st_size for p in folder.glob("*.pt")) if folder is not None else 0


def measure(clients: int, algorithm: str, rounds: int, budget: float | None) -> dict[str, float]:
    """One configuration, in this process."""
    from fedskew.data.federated import build_federated
    from fedskew.experiment.config import build_config
    from fedskew.experiment.runner import build_simulation

    torch.set_num_threads(1)
    engine = {"mode": "sequential"} if budget is None else {"mode": "sequential", "state_memory_mb": budget}
    cfg = build_config(
        {
            "rounds": rounds,
            "data": {"dataset": "digits", "num_clients": clients, "partition": {"name": "iid"}},
            "model": {"name": "mlp_mpfedcl"},
            "algorithm": {"name": algorithm},
            "client": {"epochs": 1, "batch_size": 4, "lr": 0.05, "fraction": PER_ROUND / clients},
            "eval": {"protocol": "global", "every": rounds},
            "engine": engine,
        }
    )
    t0 = time.perf_counter()
    data = build_federated(synthetic_mnist(clients * SAMPLES_PER_CLIENT), clients, {"name": "iid"}, cfg.seed)
    sim = build_simulation(cfg, data)
    setup = time.perf_counter() - t0
    rss_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sim.run_round()
        times.append(time.perf_counter() - t)
    trained = sim.states.trained()
    one = _state_bytes(sim.client_state(trained[0])) if trained else 0
    params = sum(p.numel() for p in sim.executor.runtime.models.model_for(None).parameters())
    return {
        "clients": clients,
        "algorithm": algorithm,
        "params": params,
        "setup_s": round(setup, 2),
        "s_per_round": round(statistics.median(times[:-1] or times), 3),
        "rss_after_setup_mb": round(rss_setup),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "state_budget_mb": cfg.engine.state_memory_mb,
        "clients_with_state": len(trained),
        "state_in_memory_mb": round(sim.states.memory_bytes / 2**20, 1),
        "state_spilled_mb": round(_spilled_bytes(sim) / 2**20, 1),
        "state_per_trained_client_kb": round(one / 1024, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=None, help="engine.state_memory_mb (MB)")
    ap.add_argument("--one", nargs=3, metavar=("CLIENTS", "ALGORITHM", "ROUNDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1], int(args.one[2]), args.budget)))
        return
    sizes, rounds = ([10_000], 3) if args.quick else ([10_000, 100_000], 5)
    rows = []
    for n in sizes:
        for alg in ("fedavg", "scaffold"):
            cmd = [sys.executable, __file__, "--one", str(n), alg, str(rounds)]
            cmd += [] if args.budget is None else ["--budget", str(args.budget)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---:|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    (Path(__file__).parent / "results" / "load.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
