"""The cost of running fedskew on Flower: one config on the embedded engine, on Flower's simulation runtime
(Ray) and on a loopback deployment (SuperLink + SuperNode processes, ``flwr run``), side by side.

Cases (FedAvg, all on ``engine.nodes`` = 4):

* ``W1-like``: W1 of ``engine_speed.py`` at a tenth of its data: ``cnn_mnist`` on the first 6,000 MNIST
  training images (``FEDSKEW_DATA``; scikit-learn digits when it is unset),
  20 clients Dirichlet(0.5), all of them every round, 1 epoch, batch 32;
* ``many-clients``: ``mlp_mpfedcl`` on the first 20,000 MNIST training images, 200 clients Dirichlet(0.5)
  (digits: 100 clients), 10% per round.

Per runtime it reports the wall time of the whole command, the mean round time (rounds 2.., so the first
round's warm-up is left out), the start-up (wall minus the rounds), and from ``flower_rounds.jsonl`` the
bytes Flower actually serialized per round (each message's distinct objects: Flower stores identical
arrays of one message once) beside the bytes fedskew accounts (``round_bytes_down`` / ``_up``: one payload
per client). For the deployment it splits a round (medians over rounds 2..), for the node whose reply came
last: the wait from the server's push to its ClientApp process's start (the SuperNode's 3 s idle poll, the
process launch), the process's start-up (Flower starts one process per message; with fedskew's warm
launcher a fork of a process that imported flwr, torch and fedskew already; plus the message's transfer),
its runtime build (0.0x s when the node's data comes from its disk cache), its training, and the way back
(serialisation, the SuperNode's 0.5 s reply check, transport to the ServerApp).

``flower-bare`` is the same training as a bare Flower app (``flower_bare.py``: a plain PyTorch
``ClientApp``, Flower's ``FedAvg``) on the same kind of deployment (``LocalDeployment``: as many
SuperNodes, TLS and SuperNode authentication, the same torch threads per node), its ClientApp processes
started the way Flower starts them (``flower-bare-warm``, not run by default: forked from fedskew's warm
launcher, as fedskew's are). Both deployments' threads per node are fixed once for the whole run. Where a
case has both ``flower-deployment`` and ``flower-bare``, it reports each one's round (median of rounds
2.., with the distribution-free interval of the median: ``speed_stats.median_interval``) and their ratio
paired by round index (the same round trains the same clients on both sides), against the target
deployment ≤ 1.2x bare Flower.

    python benchmarks/flower_runtime.py            # 4 rounds per run
    python benchmarks/flower_runtime.py --quick    # 2 rounds, many-clients only
    python benchmarks/flower_runtime.py --rounds 3 --cases W1-like --runtimes embedded flower-deployment
    python benchmarks/flower_runtime.py --rounds 8 --runtimes flower-deployment flower-bare --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from speed_stats import cpu_info, median_interval, paired_ratio  # noqa: E402

RUNTIMES = ("embedded", "flower-simulation", "flower-deployment", "flower-bare")
#: runtimes run only when named: the bare app with fedskew's warm ClientApp launcher (the launch's share)
EXTRA_RUNTIMES = ("flower-bare-warm",)
#: fedskew's deployment round against the bare Flower app's: the target ratio
TARGET = 1.2
JSON_HELP = "results file (default: results/flower_runtime[_quick].json for a full or --quick run, else none)"


#: SuperNodes of every case
NODES = 4


def case_config(name: str, rounds: int) -> dict[str, Any]:
    """The fedskew config of a benchmark case."""
    common: dict[str, Any] = {
        "seed": 0,
        "rounds": rounds,
        "algorithm": {"name": "fedavg"},
        "eval": {"protocol": "global", "every": 1},
        "engine": {"mode": "sequential", "nodes": NODES, "round_timeout": 600},
        "checkpoint": {"every": 0},
    }
    if name == "W1-like":
        mnist = bool(os.environ.get("FEDSKEW_DATA"))
        data = {"dataset": "mnist", "train_limit": 6000} if mnist else {"dataset": "digits"}
        return {
            **common,
            "name": "flower-w1-like",
            "data": {**data, "num_clients": 20, "partition": {"name": "dirichlet", "alpha": 0.5}},
            "model": {"name": "cnn_mnist"},
            "client": {"epochs": 1, "batch_size": 32, "lr": 0.01, "fraction": 1.0},
        }
    mnist = bool(os.environ.get("FEDSKEW_DATA"))
    data = {"dataset": "mnist", "train_limit": 20000, "num_clients": 200} if mnist else {
        "dataset": "digits", "num_clients": 100}  # fmt: skip
    return {
        **common,
        "name": "flower-many-clients",
        "data": {**data, "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5}},
        "model": {"name": "mlp_mpfedcl"},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.05, "fraction": 0.1},
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


#: the bare app's runtimes: whether its ClientApp processes are forked from fedskew's warm launcher
BARE = {"flower-bare": False, "flower-bare-warm": True}


def round_figures(runtime: str, wall: float, seconds: list[float], accuracy: list[float]) -> dict[str, Any]:
    """A row's round figures: every round's seconds, the mean and median of rounds 2.. (round 1 carries
    one-off warm-up), the start-up (wall minus the rounds) and the last round's accuracy."""
    later = seconds[1:] or seconds
    return {
        "runtime": runtime,
        "wall_s": wall,
        "rounds_s": seconds,
        "round_s": statistics.mean(later),
        "round_median_s": statistics.median(later),
        "startup_s": wall - sum(seconds),
        "accuracy": accuracy[-1],
    }


def bare_deployment(nodes: int, threads: int, warm: bool, bundle: Path) -> Any:
    """fedskew's loopback deployment (TLS, SuperNode authentication, ``threads`` per node), whose
    processes (the ``flwr`` CLI, ServerApp, ClientApps) import ``flower_bare`` from this folder and read
    the workload ``bundle``."""
    from fedskew.flower.deploy import LocalDeployment
    from flower_bare import BUNDLE_ENV

    class BareDeployment(LocalDeployment):
        def env(self) -> dict[str, str]:
            env = super().env()
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
            env[BUNDLE_ENV] = str(bundle)
            return env

    return BareDeployment(nodes, threads=threads, warm=warm)


def run_bare(cfg: dict[str, Any], folder: Path, threads: int, warm: bool) -> dict[str, Any]:
    """The bare Flower app (``flower_bare.py``) on a fresh deployment of ``engine.nodes`` SuperNodes: the
    round times its ServerApp stamped; "accounted" bytes are one model per node each way."""
    from fedskew.errors import FedskewError
    from flower_bare import APP_DIR, model_bytes, write_bundle

    runtime = next(k for k, v in BARE.items() if v == warm)
    nodes = int(cfg["engine"]["nodes"])
    bundle_path = folder / f"{runtime}.pt"
    bundle = write_bundle(cfg, bundle_path, nodes)
    stamps = bundle_path.with_suffix(".stamps.json")
    t0 = time.perf_counter()
    with bare_deployment(nodes, threads, warm, bundle_path) as dep:
        try:
            text = dep.flwr(["run", str(APP_DIR), "local", "--format", "json"])
            dep.wait(int(json.loads(text[text.index("{") :])["run-id"]), timeout=3600)
        except FedskewError as e:
            raise SystemExit(f"{runtime} failed: {e}\n{dep.tail('superlink', 40)}") from e
    wall = time.perf_counter() - t0
    got = json.loads(stamps.read_text())
    seconds = [b - a for a, b in itertools.pairwise(got["times"])]
    per_round = model_bytes(bundle) * nodes
    row = round_figures(runtime, wall, seconds, got["accuracy"][1:])
    return {**row, "accounted_down": per_round, "accounted_up": per_round, "messages": nodes}


def interval(values: list[float]) -> dict[str, float]:
    """Median, mean and the distribution-free interval of the median (``speed_stats.median_interval``)."""
    lo, hi, coverage = median_interval(values)
    median, mean = statistics.median(values), statistics.mean(values)
    return {
        "median": median,
        "mean": mean,
        "ci_low": lo,
        "ci_high": hi,
        "coverage": coverage,
        "n": len(values),
    }


def compare(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """fedskew's deployment round against the bare Flower app's (and the warm bare app's, if run): rounds
    2.., each side's median with its interval, and the ratio deployment / bare paired by round index (the
    same round trains the same clients on both sides: fedskew's pre-drawn sample)."""
    by = {r["runtime"]: r["rounds_s"][1:] for r in rows}
    ours = by.get("flower-deployment")
    if not ours or len(by.get("flower-bare", [])) != len(ours):
        return None
    out: dict[str, Any] = {"target": TARGET, "deployment": interval(ours)}
    for name in BARE:
        if len(by.get(name, [])) == len(ours):
            out[name] = interval(by[name])
            out[f"deployment/{name}"] = paired_ratio(ours, by[name])
    out["met"] = out["deployment/flower-bare"]["median"] <= TARGET
    return out


def run_case(cfg: dict[str, Any], runtime: str, folder: Path, threads: int) -> dict[str, Any]:
    """Run ``cfg`` on ``runtime``: the bare Flower app (:func:`run_bare`), or ``fedskew run`` in a
    subprocess (a deployment with ``threads`` torch threads per node); the table row's figures."""
    if runtime in BARE:
        return run_bare(cfg, folder, threads, warm=BARE[runtime])
    engine = {**cfg["engine"], "runtime": runtime}
    if runtime == "flower-deployment":
        engine["threads"] = threads
    path = folder / f"{runtime}.yaml"
    path.write_text(yaml.safe_dump({**cfg, "engine": engine}))
    out = folder / runtime
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fedskew", "run", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{runtime} failed:\n{(done.stdout + done.stderr)[-2000:]}")
    records, rows = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "flower_rounds.jsonl")
    row: dict[str, Any] = {
        **round_figures(runtime, wall, [r["seconds"] for r in records], [r["accuracy"] for r in records]),
        "accounted_down": statistics.mean(r["round_bytes_down"] for r in records),
        "accounted_up": statistics.mean(r["round_bytes_up"] for r in records),
        # the round's evaluation (eval.protocol global: on the server, after the aggregation), rounds 2..
        "eval_median_s": statistics.median(r.get("seconds_eval", 0.0) for r in records[1:] or records),
    }
    if rows:
        later_rows = rows[1:] or rows
        row["wire_down"] = statistics.mean(r["wire_bytes_down"] for r in rows)
        row["wire_up"] = statistics.mean(r["wire_bytes_up"] for r in rows)
        row["messages"] = statistics.mean(r["messages"] for r in rows)
        # a simulation node is a long-lived Ray actor: its process age says nothing about one message
        row["split"] = round_split(later_rows) if runtime == "flower-deployment" else None
    return row


def round_split(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median seconds per round of: the exchange (push to last reply), and within it, for the node whose
    reply came last: the wait from the push to its ClientApp process's start (the SuperNode's idle poll,
    the SuperExec's task poll, the process launch), the process's start-up (imports, or the warm fork, and
    the message's transfer), its runtime build or load, its training, and the way back (serialisation, the
    SuperNode's hand-over, transport to the ServerApp)."""
    if not rows or any(r.get("node_seconds_process") is None for r in rows):
        return None

    def median(f: Any) -> float:
        return statistics.median(f(r) for r in rows)

    split = {
        "exchange": median(lambda r: r["seconds_exchange"]),
        "startup": median(lambda r: max(0.0, r["node_seconds_process"] - r["node_seconds_handler"])),
        "build": median(lambda r: r["node_seconds_build"]),
        "train": median(lambda r: r["node_seconds_handler"] - r["node_seconds_build"]),
    }
    if all("node_seconds_waiting" in r for r in rows):
        split["waiting"] = median(lambda r: r["node_seconds_waiting"])
        split["returning"] = median(lambda r: r["node_seconds_returning"])
    else:  # rounds logged before the way there and back were timed
        split["rest"] = median(lambda r: max(0.0, r["seconds_exchange"] - r["node_seconds_process"]))
    return split


def kib(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024:,.0f}"


def print_table(case: str, rows: list[dict[str, Any]]) -> None:
    base = next((r["round_s"] for r in rows if r["runtime"] == "embedded"), None)
    print(f"\n{case}")
    head = (
        f"{'runtime':<18} {'wall s':>7} {'start-up s':>10} {'s/round':>8} {'median':>7} {'x embedded':>10} "
        f"{'acc %':>6} {'KiB down':>9} {'wire down':>9} {'KiB up':>8} {'wire up':>8}"
    )
    print(head)
    for r in rows:
        ratio = "-" if base is None else f"{r['round_s'] / base:.1f}"
        print(
            f"{r['runtime']:<18} {r['wall_s']:>7.1f} {r['startup_s']:>10.1f} {r['round_s']:>8.2f} "
            f"{r['round_median_s']:>7.2f} {ratio:>10} {100 * r['accuracy']:>6.2f} "
            f"{kib(r['accounted_down']):>9} {kib(r.get('wire_down')):>9} {kib(r['accounted_up']):>8} "
            f"{kib(r.get('wire_up')):>8}"
        )
    split = [r for r in rows if r.get("split")]
    if split:
        print("  where a deployment round goes (median s, the node whose reply came last):")
        for r in split:
            v = r["split"]
            print(f"  {'messages':>10} " + " ".join(f"{k:>9}" for k in v))
            print(f"  {r['messages']:>10.1f} " + " ".join(f"{x:>9.2f}" for x in v.values()))
            print(f"  and the server's evaluation after the exchange: {r['eval_median_s']:.2f} s (median)")
    cmp = compare(rows)
    if cmp is not None:
        print_comparison(cmp)


def fmt_interval(v: dict[str, float]) -> str:
    return f"{v['median']:.2f} s [{v['ci_low']:.2f}–{v['ci_high']:.2f}, {100 * v['coverage']:.1f}%]"


def print_comparison(cmp: dict[str, Any]) -> None:
    """Each side's round (median of rounds 2.. [its interval, coverage]) and the paired ratios."""
    print("  s/round, rounds 2..: median [distribution-free interval of the median, coverage]")
    for name in ("deployment", *BARE):
        if name in cmp:
            print(f"  {name:<18} {fmt_interval(cmp[name])}")
    for name in BARE:
        r = cmp.get(f"deployment/{name}")
        if r is not None:
            ci = f"[{r['ci_low']:.2f}–{r['ci_high']:.2f}, {100 * r['coverage']:.1f}%]"
            print(f"  deployment / {name}: {r['median']:.2f}x {ci} (paired by round, n = {r['n']})")
    verdict = "met" if cmp["met"] else "NOT met"
    print(f"  target deployment <= {cmp['target']}x bare Flower (median ratio): {verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, many-clients case only")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--cases", nargs="+", default=None, choices=["W1-like", "many-clients"])
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES + EXTRA_RUNTIMES)
    ap.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    args = ap.parse_args()
    try:
        import flwr  # noqa: F401
    except ImportError:
        print("flower_runtime: skipped (pip install 'fedskew[flower]')")
        return 0
    from fedskew.flower.deploy import node_threads

    rounds = args.rounds or (2 if args.quick else 4)
    cases = args.cases or (["many-clients"] if args.quick else ["W1-like", "many-clients"])
    threads = node_threads(NODES)  # once: both deployments get the same threads whatever the load does
    results: dict[str, Any] = {
        "rounds": rounds,
        "threads_per_node": threads,
        "machine": cpu_info(),
        "cases": {},
    }
    with tempfile.TemporaryDirectory(prefix="fedskew-flower-bench-") as tmp:
        for case in cases:
            folder = Path(tmp) / case
            folder.mkdir()
            cfg = case_config(case, rounds)
            load = [os.getloadavg()[0]]
            rows = [run_case(cfg, rt, folder, threads) for rt in args.runtimes]
            load.append(os.getloadavg()[0])
            results["cases"][case] = {"config": cfg, "rows": rows, "comparison": compare(rows), "load1": load}
            print_table(case, rows)
            print(f"  load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}")
    full = args.cases is None and args.rounds is None and list(args.runtimes) == list(RUNTIMES)
    name = "flower_runtime_quick.json" if args.quick else "flower_runtime.json"
    path = args.json or (HERE / "results" / name if full else None)
    if path is not None:
        path.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
