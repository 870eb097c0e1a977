"""What Flower's SecAgg+ (``engine.secagg``) costs a deployed round: FedAvg on one loopback deployment (TLS,
SuperNode authentication, ``engine.nodes`` SuperNodes), plain and secure runs interleaved on the same
deployment, side by side.

A secure round is four message exchanges with every node (SecAgg+'s setup, key sharing, masked update,
unmasking) where a plain round is one; the masked update is quantized and masked on the node, summed and
unmasked on the ServerApp. Per run it reads each round's ``seconds`` from ``metrics.jsonl`` (rounds 2..:
round 1 carries the nodes' one-off start-up) and reports, per case, the median round time of each side and
the secure / plain ratio per repeat (paired: the runs of a repeat follow each other) with the
distribution-free 95% interval of its median (``speed_stats.paired_ratio``), and the accuracy of both sides
after the last round (they differ by SecAgg+'s quantization only).

    python benchmarks/secagg_cost.py                 # W1-like and many-clients, 3 repeats of 4 rounds
    python benchmarks/secagg_cost.py --quick         # many-clients, 1 repeat of 3 rounds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from flower_runtime import NODES, case_config  # noqa: E402
from speed_stats import cpu_info, fmt_ratio, interleaved, paired_ratio, spread  # noqa: E402

SIDES = ("plain", "secagg")


def side_config(case: str, side: str, rounds: int) -> dict[str, Any]:
    raw = case_config(case, rounds)
    raw["engine"] = {**raw["engine"], "runtime": "flower-deployment"}
    if side == "secagg":
        raw["engine"]["secagg"] = {}
    return raw


def run_case(case: str, rounds: int, repeats: int, folder: Path) -> dict[str, Any]:
    """Every repeat's plain and secure run (interleaved) on one deployment: round seconds and accuracy."""
    from fedskew.experiment.config import build_config
    from fedskew.flower.apps import Job
    from fedskew.flower.deploy import LocalDeployment

    seconds: dict[str, list[float]] = {s: [] for s in SIDES}
    accuracy: dict[str, list[float]] = {s: [] for s in SIDES}
    with LocalDeployment(NODES, state_root=folder / "states") as dep:
        for repeat, side in interleaved(SIDES, repeats):
            out = folder / f"{case}-{side}-{repeat}"
            dep.run([Job(build_config(side_config(case, side, rounds)), out)])
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            seconds[side].append(statistics.median(r["seconds"] for r in rows[1:]))
            accuracy[side].append(rows[-1]["accuracy"])
            print(f"  {case} {side} repeat {repeat}: round {seconds[side][-1]:.3f} s", flush=True)
    return {
        "case": case,
        "rounds": rounds,
        "repeats": repeats,
        "round_s": {s: spread(seconds[s]) for s in SIDES},
        "ratio": paired_ratio(seconds["secagg"], seconds["plain"]),
        "accuracy": accuracy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=["W1-like", "many-clients"])
    parser.add_argument("--json", type=Path, default=None, help="results file (default: none)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.repeats, args.cases = 3, 1, ["many-clients"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedskew-secagg-") as tmp:
        results = [run_case(c, args.rounds, args.repeats, Path(tmp)) for c in args.cases]
    print(f"\nFedAvg on a loopback deployment, {NODES} SuperNodes (TLS + authentication); median round time "
          "of rounds 2.. per run, seconds")  # fmt: skip
    print(f"{'case':<14}{'plain':>10}{'secagg':>10}  secagg / plain (paired per repeat)      accuracy")
    for r in results:
        acc = " / ".join(f"{statistics.mean(r['accuracy'][s]):.4f}" for s in SIDES)
        print(
            f"{r['case']:<14}{r['round_s']['plain']['median']:>10.3f}{r['round_s']['secagg']['median']:>10.3f}"
            f"  {fmt_ratio(r['ratio']):<40} {acc}"
        )
    print(f"({time.perf_counter() - t0:.0f} s; {cpu_info()['cpu']})")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": cpu_info(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
