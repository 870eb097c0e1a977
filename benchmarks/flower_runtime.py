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

    python benchmarks/flower_runtime.py            # 4 rounds per run
    python benchmarks/flower_runtime.py --quick    # 2 rounds, many-clients only
    python benchmarks/flower_runtime.py --rounds 3 --cases W1-like --runtimes embedded flower-deployment
"""

from __future__ import annotations

import argparse
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

HERE = Path(__file__).parent
RUNTIMES = ("embedded", "flower-simulation", "flower-deployment")
JSON_HELP = "results file (default: results/flower_runtime[_quick].json for a full or --quick run, else none)"


def case_config(name: str, rounds: int) -> dict[str, Any]:
    """The fedskew config of a benchmark case."""
    common: dict[str, Any] = {
        "seed": 0,
        "rounds": rounds,
        "algorithm": {"name": "fedavg"},
        "eval": {"protocol": "global", "every": 1},
        "engine": {"mode": "sequential", "nodes": 4, "round_timeout": 600},
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


def run_case(cfg: dict[str, Any], runtime: str, folder: Path) -> dict[str, Any]:
    """Run ``cfg`` on ``runtime`` with ``fedskew run`` in a subprocess; the table row's figures."""
    path = folder / f"{runtime}.yaml"
    path.write_text(yaml.safe_dump({**cfg, "engine": {**cfg["engine"], "runtime": runtime}}))
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
    later = records[1:] or records
    row: dict[str, Any] = {
        "runtime": runtime,
        "wall_s": wall,
        "round_s": statistics.mean(r["seconds"] for r in later),
        "round_median_s": statistics.median(r["seconds"] for r in later),
        "startup_s": wall - sum(r["seconds"] for r in records),
        "accuracy": records[-1]["accuracy"],
        "accounted_down": statistics.mean(r["round_bytes_down"] for r in records),
        "accounted_up": statistics.mean(r["round_bytes_up"] for r in records),
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, many-clients case only")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--cases", nargs="+", default=None, choices=["W1-like", "many-clients"])
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    ap.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    args = ap.parse_args()
    try:
        import flwr  # noqa: F401
    except ImportError:
        print("flower_runtime: skipped (pip install 'fedskew[flower]')")
        return 0
    rounds = args.rounds or (2 if args.quick else 4)
    cases = args.cases or (["many-clients"] if args.quick else ["W1-like", "many-clients"])
    results: dict[str, Any] = {"rounds": rounds, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="fedskew-flower-bench-") as tmp:
        for case in cases:
            folder = Path(tmp) / case
            folder.mkdir()
            cfg = case_config(case, rounds)
            rows = [run_case(cfg, rt, folder) for rt in args.runtimes]
            results["cases"][case] = {"config": cfg, "rows": rows}
            print_table(case, rows)
    full = args.cases is None and args.rounds is None and list(args.runtimes) == list(RUNTIMES)
    name = "flower_runtime_quick.json" if args.quick else "flower_runtime.json"
    path = args.json or (HERE / "results" / name if full else None)
    if path is not None:
        path.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
