"""Seconds per FedAvg round: the engine against a hand-written tight loop and the common
DataLoader + deep-copy-per-client loop, with achieved GFLOP/s against two GEMM ceilings measured in the
same process (a float32 2048^3 ``torch.mm`` and the same GEMM run as a 1x1 convolution).

Workload: MNIST, 20 clients, Dirichlet(0.5), 1 local epoch; ``cnn_mnist`` at batch 32 and
``cnn_fedproto`` at batch 8. Needs MNIST under ``$FEDSKEW_DATA`` (e.g. ``FEDSKEW_DATA=../shared/data``).
Every variant trains the same model instance (the engine's, in its memory format); their rounds are timed in
turn and the median reported, so drift of a shared machine does not favour whichever variant ran first.

    python benchmarks/round_speed.py            # full MNIST (60k samples per round)
    python benchmarks/round_speed.py --quick    # 10% of MNIST per client, fewer timed rounds
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data, build_simulation

RESULTS = Path(__file__).parent / "results"


def gemm_ceilings(n: int = 2048, reps: int = 5, device: str = "cpu") -> tuple[float, float]:
    """GFLOP/s of an ``n^3`` float32 GEMM as ``torch.mm`` and as a 1x1 convolution on ``device``."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    x = a.t().contiguous().view(1, n, n, 1)  # [1, C_in=n, H=n, W=1]: conv computes b @ a^T-shaped GEMM
    w = b.view(n, n, 1, 1)
    flops = 2 * n**3
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return flops / min(times) / 1e9

    return best(lambda: torch.mm(a, b)), best(lambda: F.conv2d(x, w))


def train_flops_per_sample(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward + backward FLOPs of one training step, per sample."""
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / x.shape[0]


def config(model: str, batch: int, quick: bool) -> dict:
    return {
        "seed": 0,
        "rounds": 1000,
        "data": {
            "dataset": "mnist",
            "num_clients": 20,
            "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 10},
        },
        "model": {"name": model},
        "algorithm": {"name": "fedavg"},
        "client": {"epochs": 1, "batch_size": batch, "lr": 0.01, "momentum": 0.5},
        "eval": {"protocol": "global", "every": 1},
        "checkpoint": {"every": 0},
    }


def shrink(fd, fraction: float) -> None:
    """Keep the first ``fraction`` of each client's indices (quick mode)."""
    fd.train_idx = [idx[: max(2, int(len(idx) * fraction))] for idx in fd.train_idx]


def engine_round(sim, evaluate: bool) -> Callable[[], None]:
    """One round of the engine, with or without its default evaluation."""

    def one_round() -> None:
        sim.every = 1 if evaluate else 10**9
        sim.rounds = 10**9
        sim.run_round()

    return one_round


def tight_loop_round(sim, batch: int, lr: float, momentum: float) -> Callable[[], None]:
    """Tensors in memory, one reused model, weights copied in place, FedAvg by stacking."""
    model = sim.executor.runtime.models.model_for(0)
    gstate = {k: v.clone() for k, v in model.state_dict().items()}
    x_all, y_all = sim.executor.runtime.data.x, sim.executor.runtime.data.y

    def one_round() -> None:
        states, sizes = [], []
        for idx in sim.executor.runtime.data.index:
            model.load_state_dict(gstate)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            model.train()
            xs, ys = x_all[idx], y_all[idx]
            perm = torch.randperm(len(idx))
            for s in range(0, len(idx), batch):
                b = perm[s : s + batch]
                loss = F.cross_entropy(model(xs[b]), ys[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sizes.append(len(idx))
        w = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        for k in gstate:
            gstate[k] = sum(wi * s[k].float() for wi, s in zip(w, states, strict=True)).to(gstate[k].dtype)

    return one_round


def dataloader_round(sim, batch: int, lr: float, momentum: float) -> Callable[[], None]:
    """The common research-code pattern: a DataLoader per client per round and a deep copy of the model."""
    global_model = sim.executor.runtime.models.model_for(0)
    x_all, y_all = sim.executor.runtime.data.x, sim.executor.runtime.data.y

    def one_round() -> None:
        states, sizes = [], []
        for idx in sim.executor.runtime.data.index:
            local = copy.deepcopy(global_model)
            loader = DataLoader(TensorDataset(x_all[idx], y_all[idx]), batch_size=batch, shuffle=True)
            opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum)
            local.train()
            for xb, yb in loader:
                loss = F.cross_entropy(local(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
            states.append(copy.deepcopy(local.state_dict()))
            sizes.append(len(idx))
        avg = {
            k: sum(s[k].float() * n for s, n in zip(states, sizes, strict=True)) / sum(sizes)
            for k in states[0]
        }
        global_model.load_state_dict(avg)

    return one_round


def interleaved(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per round of each variant, after a warm-up round each, the variants' rounds taken in
    turn (A B C D A B C D ...) so that a slow spell of a shared machine hits every variant alike."""
    for one_round in variants.values():
        one_round()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, one_round in variants.items():
            t = time.perf_counter()
            one_round()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10%% of each client's data, 1 timed round each")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    ap.add_argument("--models", nargs="+", default=["cnn_mnist", "cnn_fedproto"], help="workloads to run")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    torch.manual_seed(0)
    mm, conv = gemm_ceilings()
    ceiling = max(mm, conv)
    print(
        f"threads={torch.get_num_threads()}  GEMM ceilings: mm {mm:.1f} GFLOP/s, 1x1-conv {conv:.1f} GFLOP/s"
    )
    rows = []
    workloads = [(m, b) for m, b in (("cnn_mnist", 32), ("cnn_fedproto", 8)) if m in args.models]
    for model_name, batch in workloads:
        cfg = build_config(config(model_name, batch, args.quick))
        fd = build_data(cfg)
        if args.quick:
            shrink(fd, 0.1)
        sim = build_simulation(cfg, fd)
        samples = sum(len(i) for i in sim.executor.runtime.data.index)
        m = sim.executor.runtime.models.model_for(0)
        fps = train_flops_per_sample(
            m, sim.executor.runtime.data.x[:batch], sim.executor.runtime.data.y[:batch]
        )
        variants = interleaved(
            {
                "engine (eval off)": engine_round(sim, evaluate=False),
                "engine (eval on)": engine_round(sim, evaluate=True),
                "tight loop": tight_loop_round(sim, batch, 0.01, 0.5),
                "DataLoader + deepcopy": dataloader_round(sim, batch, 0.01, 0.5),
            },
            rounds,
        )
        for name, spr in variants.items():
            gflops = fps * samples / spr / 1e9
            rows.append(
                {
                    "model": model_name,
                    "batch": batch,
                    "variant": name,
                    "seconds_per_round": spr,
                    "samples_per_second": samples / spr,
                    "gflops": gflops,
                    "ceiling_fraction": gflops / ceiling,
                }
            )
    header = (
        f"{'model':<13}{'batch':>6}  {'variant':<24}{'s/round':>9}{'samples/s':>11}{'GFLOP/s':>9}{'ceil':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:<13}{r['batch']:>6}  {r['variant']:<24}{r['seconds_per_round']:>9.3f}"
            f"{r['samples_per_second']:>11.0f}{r['gflops']:>9.1f}{100 * r['ceiling_fraction']:>6.1f}%"
        )
    for model_name, _ in workloads:
        v = {r["variant"]: r["seconds_per_round"] for r in rows if r["model"] == model_name}
        print(
            f"{model_name}: engine/tight = {v['engine (eval off)'] / v['tight loop']:.3f} (target <= 1.05); "
            f"eval on/off = {v['engine (eval on)'] / v['engine (eval off)']:.3f} (target <= 1.15); "
            f"DataLoader loop/engine = {v['DataLoader + deepcopy'] / v['engine (eval off)']:.2f}x"
        )
    if args.quick:
        print("quick mode: training cut to 10% per client, 10k test set kept: eval on/off not representative")
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if args.quick else ""
    if len(workloads) == 1:
        suffix += f"_{workloads[0][0]}"
    out = RESULTS / f"round_speed{suffix}.json"
    out.write_text(
        json.dumps({"ceilings_gflops": {"mm": mm, "conv1x1": conv}, "rows": rows}, indent=2) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
