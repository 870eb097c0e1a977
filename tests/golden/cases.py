"""Golden results: the final metrics of every registered algorithm on small fixed digits configs.

``python -m tests.golden.cases --record`` rewrites ``results.json`` from the current code. The golden test
(tests/test_golden.py) re-runs every case in the sequential mode and asserts bit-equal metrics, so an engine
or contract refactor that changes any number is caught; a deliberate change is re-recorded and explained.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from tests.conftest import VL_WORLD, digits_config

RESULTS = Path(__file__).with_name("results.json")
#: wall-clock fields: not results
TIMING = ("seconds",)


def _personal(name: str) -> bool:
    return bool(getattr(ALGORITHMS.get(name), "personalized_eval", False))


def case_config(name: str) -> dict[str, Any]:
    """The golden config of case ``name`` (an algorithm name, or ``<algorithm>-hetero``)."""
    alg = name.split("-")[0]
    cfg = digits_config(
        rounds=3,
        algorithm={"name": alg},
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5}},
        client={"epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 0.67},
        engine={"mode": "sequential", "workers": 1},
        checkpoint={"every": 0},
    )
    if _personal(alg):
        cfg["eval"] = {"protocol": "personalized", "every": 1}
    if name == "moon-hetero":  # same shapes, different forward passes (averaging needs equal shapes)
        cfg["model"] = {
            "name": "mlp_mpfedcl",
            "hidden": 64,
            "embed_dim": 32,
            "per_client": {"0-2": {"normalize": True}},
        }
    elif name.endswith("-hetero"):  # heterogeneous models: three hidden widths
        cfg["model"] = {
            "name": "mlp_mpfedcl",
            "hidden": 64,
            "embed_dim": 32,
            "per_client": {"0-1": {"hidden": 48}, "2-3": {"hidden": 80}},
        }
    elif getattr(ALGORITHMS.get(alg), "vision_language", False):  # heads over frozen-backbone features
        cfg["data"]["vision_language"] = VL_WORLD
        cfg["model"] = {"name": "identity"}
    else:
        cfg["model"] = {"name": "mlp_mpfedcl", "hidden": 64, "embed_dim": 32}
    return cfg


def case_names() -> list[str]:
    package = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("fedskew.")]
    return [*package, "fedproto-hetero", "local-hetero", "moon-hetero"]


def run_case(name: str, out: Path | None = None) -> list[dict[str, Any]]:
    """Run a case and return its metrics records without timing fields."""
    torch.set_num_threads(1)
    out_dir = out
    run_experiment(build_config(case_config(name)), out_dir)
    assert out_dir is not None
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--record", action="store_true", help="rewrite results.json")
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args()
    names = args.cases or case_names()
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = run_case(name, Path(tmp) / name)
            print(name, results[name][-1].get("accuracy"))
    if args.record:
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
