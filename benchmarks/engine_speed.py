"""Seconds per round of fedskew's engine modes against Flower's simulation engine, side by side.

Workloads (MNIST under ``$FEDSKEW_DATA``):

* W1: FedAvg, ``cnn_mnist``, 20 clients Dirichlet(0.5), 1 epoch, batch 32, all clients every round;
* W2: FedProto, ``nway_kshot`` n=3 (k=100, stdev 2), 20 clients, ``cnn_fedproto``, batch 8;
* W3: FedAvg, ``mlp_mpfedcl``, 1,000 clients (Dirichlet 0.5), 10% per round, batch 32; plus the round time
  at 50 / 100 / 200 participating clients (how it grows);
* W4 (cross-device scale): FedAvg, ``mlp_mpfedcl``, 10,000 clients (Dirichlet 0.1, ``min_size: 0``, so many
  clients hold a handful of images or none), 100 per round, batch 32; plus two scaling curves
  (``--scaling``): seconds per round against participating clients (10 → 1,000 of 10,000) and against total
  clients (1,000 → 100,000 at 100 per round), plotted log-log to ``docs/img/engine_w4_participants.png``
  and ``docs/img/engine_w4_total.png``.

Every side (each engine mode: ``sequential``, ``workers`` = one process per core, ``vectorized``,
``vectorized+workers``, ``auto``; each peer) runs ``--repeats`` times (default 5) in fresh processes,
interleaved (``speed_stats.py``: every side once per repeat, the order reversed on odd repeats), so
``peak_rss_bytes`` is that run's own peak (parent + largest worker). Each run reports ``seconds_per_round``
(evaluation off, median of the timed rounds after a warm-up round), ``seconds_per_round_eval`` (the
engine's default evaluation on: the global 10k test set every round), ``samples_per_second`` and
``ceiling_fraction`` (training GFLOP/s against the faster of the ``mm`` and 1x1-conv GEMM ceilings, measured
in the same process); Flower's runs report ``flower_seconds_per_round`` (evaluation off) and
``flower_seconds_per_round_eval`` (its default federated evaluation on every sampled client), and Apple's
``pfl`` the same (``pfl_peer.py``: its FedAvg over a ``SimulatedBackend``, one worker process per CPU;
evaluation on = its central evaluation of the test set). The table gives each side's median with min–max
over the repeats, and each speed-up (peer / fedskew, of ``auto`` and of the fastest mode) as the median of
the repeats' paired ratios with a 95% bootstrap interval and the range; the JSON keeps every run and the
machine (CPU flags, torch's kernel level, threads).

    python benchmarks/engine_speed.py                 # all workloads, 3 timed rounds
    python benchmarks/engine_speed.py --quick         # 1 timed round, 10% of each client's data (W1, W2)
    python benchmarks/engine_speed.py --workloads W2 --no-flower --no-pfl
    python benchmarks/engine_speed.py --workloads W4 --modes auto --scaling
    python benchmarks/engine_speed.py --replot        # redraw the W4 plots from engine_w4_scaling.json
    python benchmarks/engine_speed.py --device cuda   # the default when a GPU is present; both sides on it

On a GPU the results go to ``engine_<workload>[_quick]_cuda.json`` (with ``peak_gpu_bytes``); workers run
in-process there (a CUDA context cannot be forked), so ``workers`` rows equal ``sequential``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedskew.engine.sampling import sampling_schedule
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data, build_simulation

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from engine_plots import W4_PARTICIPATING, W4_TOTAL, plot_w4_scaling  # noqa: E402
from round_speed import gemm_ceilings, shrink, train_flops_per_sample  # noqa: E402
from speed_stats import cpu_info, fmt, fmt_ratio, interleaved, paired_ratio, spread  # noqa: E402

MODES = ["sequential", "workers", "vectorized", "vectorized+workers", "auto"]


def workload_config(
    name: str, participating: int | None = None, total_clients: int | None = None
) -> dict[str, Any]:
    base: dict[str, Any] = {"seed": 0, "rounds": 100, "checkpoint": {"every": 0}, "eval": {"every": 1}}
    if name == "W1":
        base.update(
            data={"dataset": "mnist", "num_clients": 20, "partition": {"name": "dirichlet", "alpha": 0.5}},
            model={"name": "cnn_mnist"},
            algorithm={"name": "fedavg"},
            client={"epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.5},
        )
    elif name == "W2":
        base.update(
            data={
                "dataset": "mnist",
                "num_clients": 20,
                "partition": {"name": "nway_kshot", "n": 3, "stdev": 2, "k": 100},
                "test": {"per_class": 40},
            },
            model={"name": "cnn_fedproto"},
            algorithm={"name": "fedproto", "lam": 1.0},
            client={"epochs": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.5},
            eval={"protocol": "personalized", "every": 1},
        )
    elif name in ("W3", "W4"):
        total = total_clients or (1000 if name == "W3" else 10_000)
        frac = (participating or 100) / total
        alpha, min_size = (0.5, 10) if name == "W3" else (0.1, 0)
        base.update(
            data={
                "dataset": "mnist",
                "num_clients": total,
                "partition": {"name": "dirichlet", "alpha": alpha, "min_size": min_size},
            },
            model={"name": "mlp_mpfedcl"},
            algorithm={"name": "fedavg"},
            client={"epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.5, "fraction": frac},
        )
    else:
        raise SystemExit(f"unknown workload {name!r}; allowed: W1, W2, W3, W4")
    return base


def _with_mode(cfg: dict[str, Any], mode: str, device: str = "cpu") -> dict[str, Any]:
    """``workers``: the sequential loop over one process per core; ``vectorized+workers``: a vmapped group
    of clients per process; ``auto`` may use them too. (On a GPU the engine runs workers in-process.)"""
    cores = os.cpu_count() or 1
    workers = 1 if mode in ("sequential", "vectorized") else cores
    engine_mode = {"workers": "sequential", "vectorized+workers": "vectorized"}.get(mode, mode)
    return dict(cfg, engine={"mode": engine_mode, "workers": workers, "device": device})


def _timed(sim: Any, rounds: int, evaluate: bool) -> float:
    sim.every = 1 if evaluate else 10**9
    sim.run_round()  # warm-up (forks the workers, builds the vmapped step)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sim.run_round()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


SHRUNK_WHEN_QUICK = ("W1", "W2")  # W3 / W4 clients are already small


def measure_one(
    workload: str,
    mode: str,
    rounds: int,
    quick: bool,
    participating: int | None,
    device: str = "cpu",
    total_clients: int | None = None,
) -> dict[str, Any]:
    """One (workload, mode) in this process: timings, throughput, ceiling fraction, peak RSS (and peak GPU
    memory on a GPU)."""
    cfg = build_config(_with_mode(workload_config(workload, participating, total_clients), mode, device))
    fd = build_data(cfg)
    if quick and workload in SHRUNK_WHEN_QUICK:
        shrink(fd, 0.1)
    sim = build_simulation(cfg, fd)
    try:
        off = _timed(sim, rounds, evaluate=False)
        on = _timed(sim, rounds, evaluate=True)
        resolved = sim.executor.name
    finally:
        sim.close()
    timed_rounds = sim.schedule[1 : rounds + 1]  # the eval-off rounds after the warm-up
    per_round = sum(sim.executor.runtime.data.size(c) for c in timed_rounds.flatten().tolist()) / len(
        timed_rounds
    )
    per_round *= cfg.client.epochs
    model = sim.executor.runtime.models.model_for(0)
    fps = train_flops_per_sample(
        model,
        sim.executor.runtime.data.x[: cfg.client.batch_size],
        sim.executor.runtime.data.y[: cfg.client.batch_size],
    )
    mm, conv = gemm_ceilings(4096 if device.startswith("cuda") else 2048, device=device)
    gflops = fps * per_round / off / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {
        "workload": workload,
        "mode": mode,
        "resolved": resolved,
        "participating": len(sim.schedule[0]),
        "total_clients": cfg.data.num_clients,
        "seconds_per_round": off,
        "seconds_per_round_eval": on,
        "samples_per_second": per_round / off,
        "gflops": gflops,
        "ceiling_gflops": max(mm, conv),
        "ceiling_fraction": gflops / max(mm, conv),
        "peak_rss_bytes": rss + child,
        "device": device,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0,
    }


def write_bundle(
    workload: str,
    quick: bool,
    path: Path,
    participating: int | None,
    device: str = "cpu",
    total_clients: int | None = None,
) -> dict[str, Any]:
    """The workload's tensors, partition and settings for the peers (same data, model, hyper-params)."""
    cfg = build_config(workload_config(workload, participating, total_clients))
    fd = build_data(cfg)
    if quick and workload in SHRUNK_WHEN_QUICK:
        shrink(fd, 0.1)
    ds = fd.dataset
    n = len(fd.train_idx)
    test = torch.arange(ds.y_test.numel()).chunk(n)  # Flower's default evaluation: every client a shard
    bundle = {
        "x_train": ds.x_train,
        "y_train": ds.y_train,
        "x_test": ds.x_test,
        "y_test": ds.y_test,
        "train_idx": fd.train_idx,
        "test_idx": list(test),
        "in_shape": ds.in_shape,
        "num_classes": ds.num_classes,
        "model": cfg.model.name,
        "model_options": cfg.model.options(),
        "algorithm": cfg.algorithm.name,
        "lam": 1.0,
        "epochs": cfg.client.epochs,
        "batch_size": cfg.client.batch_size,
        "lr": cfg.client.lr,
        "momentum": cfg.client.momentum,
        "fraction": cfg.client.fraction,
        "num_clients": n,
        # fedskew's pre-drawn sampling stream: pfl's peer trains the same clients each round
        "schedule": sampling_schedule(n, cfg.client.fraction, cfg.rounds, cfg.seed).tolist(),
        "mean": torch.tensor(ds.mean).view(-1, 1, 1),
        "std": torch.tensor(ds.std).view(-1, 1, 1),
        "device": device,
    }
    torch.save(bundle, path)
    return bundle


def run_subprocess(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark subprocess {args} failed:\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def _flower(path: Path, rounds: int, evaluate: bool, bundle: dict, device: str) -> float:
    from flower_peer import flower_seconds_per_round

    cpus = os.cpu_count() or 1
    return flower_seconds_per_round(path, rounds, evaluate, bundle["num_clients"], cpus, device)


def _pfl(path: Path, rounds: int, evaluate: bool, bundle: dict, device: str) -> float:
    from pfl_peer import pfl_seconds_per_round

    # pfl's distributed simulation is one process per device: one per CPU, or one on a single GPU
    workers = 1 if device.startswith("cuda") else os.cpu_count() or 1
    return pfl_seconds_per_round(path, rounds, evaluate, workers)


PEERS = {"flower": _flower, "pfl": _pfl}


def measure_peer(peer: str, workload: str, rounds: int, quick: bool, device: str) -> dict[str, float]:
    """The peer's median seconds per round, evaluation off and on, on the workload's bundle."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bundle.pt"
        bundle = write_bundle(workload, quick, path, None, device)
        timed = PEERS[peer]
        return {
            f"{peer}_seconds_per_round": timed(path, rounds + 1, False, bundle, device),
            f"{peer}_seconds_per_round_eval": timed(path, rounds + 1, True, bundle, device),
        }


def scaling_runs(workload: str, extra: list[str]) -> list[dict]:
    """W3: the round time at 50 / 100 / 200 participants; W4: both scaling curves (``--scaling``)."""
    points: list[tuple[int, int | None]] = []
    if workload == "W3":
        points = [(k, None) for k in (50, 100, 200)]
    elif workload == "W4":
        points = [(k, 10_000) for k in W4_PARTICIPATING] + [(100, n) for n in W4_TOTAL if n != 10_000]
    args = [["--participating", str(k)] + (["--total", str(n)] if n else []) for k, n in points]
    return [run_subprocess(["--one", workload, "auto", *a, *extra]) for a in args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 timed round; 10%% of each client's data (W1, W2)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per run (default 3, quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="fresh runs per side (default 5, quick 1)")
    ap.add_argument("--workloads", nargs="+", default=["W1", "W2", "W3", "W4"])
    ap.add_argument("--modes", nargs="+", default=MODES)
    ap.add_argument("--no-flower", action="store_true", help="skip the Flower side")
    ap.add_argument("--no-pfl", action="store_true", help="skip the pfl side")
    ap.add_argument("--scaling", action="store_true", help="W4's two scaling curves (9 more runs) and plots")
    ap.add_argument("--replot", action="store_true", help="redraw the W4 plots from the saved scaling points")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="engine.device of every run and of the peers' clients (default: cuda when present)",
    )
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=2, metavar=("PEER", "WORKLOAD"), help=argparse.SUPPRESS)
    ap.add_argument("--participating", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    repeats = args.repeats or (1 if args.quick else 5)
    if args.replot:
        saved = json.loads((RESULTS / "engine_w4_scaling.json").read_text())["scaling"]
        for path in plot_w4_scaling(saved, HERE.parent / "docs" / "img"):
            print(f"wrote {path}")
        return
    if args.one:
        one = measure_one(
            args.one[0], args.one[1], rounds, args.quick, args.participating, args.device, args.total
        )
        print(json.dumps(one))
        return
    if args.peer:
        print(json.dumps(measure_peer(args.peer[0], args.peer[1], rounds, args.quick, args.device)))
        return
    extra = ["--quick"] if args.quick else []
    extra += ["--rounds", str(rounds), "--device", args.device]
    peers = [p for p in PEERS if not getattr(args, f"no_{p}")]
    for workload in args.workloads:
        sides = [("mode", m) for m in args.modes] + [("peer", p) for p in peers]
        runs: dict[tuple[str, str], dict[int, dict]] = {side: {} for side in sides}
        for rep, (kind, name) in interleaved(sides, repeats):
            argv = ["--one", workload, name] if kind == "mode" else ["--peer", name, workload]
            try:
                runs[(kind, name)][rep] = run_subprocess([*argv, *extra])
            except RuntimeError as err:
                if kind == "mode":
                    raise
                print(f"{workload}: {name} side failed ({str(err).splitlines()[0]})")
        scaling = (
            scaling_runs(workload, extra) if workload == "W3" or (workload == "W4" and args.scaling) else []
        )
        report(workload, runs, scaling, args.quick, args.device, repeats)
        if workload == "W4" and scaling:
            for path in plot_w4_scaling(scaling, HERE.parent / "docs" / "img"):
                print(f"wrote {path}")


def summarize_runs(runs: dict[tuple[str, str], dict[int, dict]]) -> tuple[dict, dict, dict]:
    """Per mode and per peer: every run, and the median [min–max] of seconds per round with evaluation off
    and on; per (peer, mode): the paired ratios of the repeats both completed (``auto`` and the fastest mode
    by median)."""
    modes, peers = {}, {}
    for (kind, name), by_rep in runs.items():
        if not by_rep:
            continue
        if kind == "mode":
            off = [r["seconds_per_round"] for r in by_rep.values()]
            on = [r["seconds_per_round_eval"] for r in by_rep.values()]
            modes[name] = {"runs": by_rep, "off": spread(off), "on": spread(on)}
        else:
            off = [r[f"{name}_seconds_per_round"] for r in by_rep.values()]
            on = [r[f"{name}_seconds_per_round_eval"] for r in by_rep.values()]
            peers[name] = {"runs": by_rep, "off": spread(off), "on": spread(on)}
    ratios = {}
    if modes:
        fastest = min(modes, key=lambda m: modes[m]["off"]["median"])
        for peer in peers:
            for mode in dict.fromkeys(m for m in ("auto", fastest) if m in modes):
                reps = sorted(set(runs[("peer", peer)]) & set(runs[("mode", mode)]))
                key = {"off": "seconds_per_round", "on": "seconds_per_round_eval"}
                ratios[f"{peer}/{mode}"] = {
                    when: paired_ratio(
                        [runs[("peer", peer)][r][f"{peer}_{k}"] for r in reps],
                        [runs[("mode", mode)][r][k] for r in reps],
                    )
                    for when, k in key.items()
                }
    return modes, peers, ratios


def report(
    workload: str,
    runs: dict[tuple[str, str], dict[int, dict]],
    scaling: list[dict],
    quick: bool,
    device: str = "cpu",
    repeats: int = 1,
) -> None:
    modes, peers, ratios = summarize_runs(runs)
    head = f"{'side':<20}{'ran as':<20}{'s/round, eval off':>26}{'eval on':>26}{'samples/s':>11}{'RSS':>10}"
    title = f"{workload}{' (quick)' if quick else ''} on {device}: median [min–max] of {repeats} runs"
    print(f"\n{title}")
    print(head)
    print("-" * len(head))
    for mode, m in modes.items():
        rs = list(m["runs"].values())
        resolved = ",".join(sorted({r["resolved"] for r in rs}))
        samples = statistics.median(r["samples_per_second"] for r in rs)
        rss = max(r["peak_rss_bytes"] for r in rs) / 2**30
        print(f"{mode:<20}{resolved:<20}{fmt(m['off']):>26}{fmt(m['on']):>26}{samples:>11.0f}{rss:>9.2f}G")
    for peer, p in peers.items():
        print(f"{peer:<40}{fmt(p['off']):>26}{fmt(p['on']):>26}")
    for key, r in ratios.items():
        peer, mode = key.split("/")
        print(f"speed-up vs {peer} ({mode}): eval off {fmt_ratio(r['off'])}; eval on {fmt_ratio(r['on'])}")
    for s in scaling:
        samples = s["samples_per_second"] * s["seconds_per_round"]
        print(
            f"{workload} with {s['participating']:>5} of {s['total_clients']:>6} clients per round: "
            f"{s['seconds_per_round']:.3f} s ({1000 * s['seconds_per_round'] / s['participating']:.2f} ms a "
            f"client, {samples:.0f} samples, {s['resolved']}, peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB)"
        )
    RESULTS.mkdir(exist_ok=True)
    gpu = "" if device == "cpu" else "_" + device.replace(":", "")
    stem = f"engine_{workload.lower()}{'_quick' if quick else ''}{gpu}"
    meta = {
        "quick": quick,
        "repeats": repeats,
        "machine": cpu_info(),
        "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
    }
    # the scaling curves go to their own file, so a later run without them does not erase them
    payload = {"workload": workload, "modes": modes, "peers": peers, "ratios": ratios, **meta}
    parts = [(f"{stem}.json", payload)]
    if scaling:
        parts.append((f"{stem}_scaling.json", {"workload": workload, "scaling": scaling, **meta}))
    for name, out in parts:
        (RESULTS / name).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
