"""Golden results: the metrics of every registered algorithm on small fixed digits configs.

``python -m tests.golden.cases --record`` re-records ``results.json`` in a process pinned to AVX2 (see
``tests/golden/isa.py``) and re-derives ``tolerances.json`` from the drift between that run and the other
kernel choices of an x86-64 CPU (``isa.VARIANTS``). The golden test (tests/test_golden.py) runs every case
twice: pinned, where the metrics must equal the record bit for bit, and with the machine's native kernels,
where they must stay within the measured drift. A deliberate change re-records and is explained.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedskew.algorithms import ALGORITHMS
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from fedskew.numerics import VectorMathGuard
from tests.conftest import VL_WORLD, digits_config
from tests.golden import isa
from tests.test_contract import BATCHNORM_METHODS, TINY_BN_CNN

HERE = Path(__file__).parent
RESULTS = HERE / "results.json"
TOLERANCES = HERE / "tolerances.json"
REPO = HERE.parent.parent
#: wall-clock fields: not results
TIMING = ("seconds",)
#: a tolerance is this many times the largest drift measured between kernel variants
SAFETY = 10.0
#: the least drift a float metric is allowed under other kernels, on top of the measured one: this many
#: float32 ulps of the recorded value (one float32 rounding of a metric is already 0.5 ulp, so a floor below
#: an ulp — the former relative floor 1e-7 was 0.4 ulp at 2.09 — can never hold across CPUs) ...
ULP_FLOOR = 4
#: ... and at least this much, for metrics near 0 whose float32 summands were larger than their result
ABS_FLOOR = 1e-8

Records = list[dict[str, Any]]


def _personal(name: str) -> bool:
    return bool(ALGORITHMS.get(name).personalized_eval)


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
    elif alg in BATCHNORM_METHODS:  # BatchNorm layers are the method's point
        cfg["model"] = TINY_BN_CNN
    elif ALGORITHMS.get(alg).vision_language:  # heads over frozen-backbone features
        cfg["data"]["vision_language"] = VL_WORLD
        cfg["model"] = {"name": "identity"}
    else:
        cfg["model"] = {"name": "mlp_mpfedcl", "hidden": 64, "embed_dim": 32}
    return cfg


def case_names() -> list[str]:
    package = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("fedskew.")]
    return [*package, "fedproto-hetero", "local-hetero", "moon-hetero"]


def run_case(name: str, out: Path, guard: VectorMathGuard | None = None) -> Records:
    """Run a case in this process (under ``guard`` when given) and return its metrics records without
    timing fields."""
    isa.apply_in_process_pin()
    with guard if guard is not None else contextlib.nullcontext():
        run_experiment(build_config(case_config(name)), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def run_cases(env: dict[str, str], names: Iterable[str] | None = None) -> dict[str, Any]:
    """Run cases in a fresh process with environment ``env`` (the kernel choices are made at ``import
    torch``); returns ``{"environment": ..., "cases": {name: records}}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        cmd = [sys.executable, "-m", "tests.golden.cases", "--emit", str(out), *(names or [])]
        subprocess.run(cmd, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def _drift(got: Any, want: Any) -> float:
    """Largest absolute difference between two metric values (lists elementwise); ``inf`` if incomparable."""
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return math.inf
        return max((_drift(g, w) for g, w in zip(got, want, strict=True)), default=0.0)
    if isinstance(want, bool) or not isinstance(want, int | float):
        return 0.0 if got == want else math.inf
    if isinstance(got, bool) or not isinstance(got, int | float):
        return math.inf
    return abs(got - want)


def float_floor(value: Any) -> float:
    """The drift a value's floats may show on any CPU: ``ULP_FLOOR`` float32 ulps of its largest float, at
    least ``ABS_FLOOR``; 0 when it holds none (integers and strings compare exactly)."""
    if isinstance(value, list):
        return max((float_floor(v) for v in value), default=0.0)
    if not isinstance(value, float) or not math.isfinite(value):
        return 0.0
    ulp = 2.0 ** (math.frexp(value)[1] - 24) if value else 0.0  # float32: 24 significant bits
    return max(ULP_FLOOR * ulp, ABS_FLOOR)


def mismatches(got: Records, want: Records, tol: dict[str, float] | None) -> list[str]:
    """What differs between two runs of a case: bit for bit when ``tol`` is None, else within
    ``tol[metric] + float_floor(recorded)`` (a metric not in ``tol`` drifted in no measured variant)."""
    if len(got) != len(want):
        return [f"{len(got)} evaluated rounds, recorded {len(want)}"]
    found = []
    for g, w in zip(got, want, strict=True):
        if g.keys() != w.keys():
            found.append(f"round {w['round']}: keys {sorted(g.keys() ^ w.keys())} differ")
            continue
        for key, want_value in w.items():
            limit = None if tol is None else tol.get(key, 0.0) + float_floor(want_value)
            bad = g[key] != want_value if limit is None else _drift(g[key], want_value) > limit
            if bad:
                allowed = "" if limit is None else f" (allowed drift {limit:.3g})"
                found.append(f"round {w['round']}: {key} {g[key]!r} != recorded {want_value!r}{allowed}")
    return found


def derive_tolerances(reference: dict[str, Records], variants: dict[str, dict[str, Records]]) -> dict:
    """Per case and metric: SAFETY x the largest drift of any variant from the pinned reference."""
    cases: dict[str, dict[str, float]] = {}
    for name, want in reference.items():
        worst: dict[str, float] = {}
        for runs in variants.values():
            for g, w in zip(runs[name], want, strict=True):
                for key in w:
                    drift = _drift(g.get(key), w[key])
                    if drift > 0:
                        worst[key] = max(worst.get(key, 0.0), SAFETY * drift)
        cases[name] = dict(sorted(worst.items()))
    return cases


def record(names: list[str]) -> None:
    """Re-record the pinned results of ``names`` (every case when empty) and re-derive their tolerances;
    the other cases' records stay as they are (about a minute on 2 cores for all of them)."""
    pinned = run_cases(isa.pinned_env(), names or None)
    if pinned["vector_math"]:
        raise SystemExit(f"not recorded: float32 calls reach MKL's vector math: {pinned['vector_math']}")
    variants = {
        kind: run_cases({**os.environ, **env}, names or None)["cases"] for kind, env in isa.VARIANTS.items()
    }
    old = json.loads(RESULTS.read_text()) if names else {"cases": {}}
    results = {"environment": {**pinned["environment"], "cpu": isa.cpu_description()}}
    results["cases"] = {**old["cases"], **pinned["cases"]}
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    derived = derive_tolerances(pinned["cases"], variants)
    old_tol = json.loads(TOLERANCES.read_text())["cases"] if names else {}
    tolerances = {
        "safety": SAFETY,
        "ulp_floor": ULP_FLOOR,
        "abs_floor": ABS_FLOOR,
        "variants": isa.VARIANTS,
        "measured_on": isa.cpu_description(),
        "cases": {**old_tol, **derived},
    }
    TOLERANCES.write_text(json.dumps(tolerances, indent=1, sort_keys=True) + "\n")
    for name, tol in derived.items():
        print(f"{name:16s} " + ", ".join(f"{k} {v:.2g}" for k, v in tol.items()))


def digest(records: Records) -> str:
    """A short fingerprint of a case's records (floats by their exact ``repr``)."""
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def probe() -> None:
    """Print what a golden failure on an unseen CPU is diagnosed from: the CPU, the libraries, and each
    case's pinned digest beside the recorded one (``python -m tests.golden.cases --probe``, ~30 s)."""
    recorded = json.loads(RESULTS.read_text())
    for key, value in isa.libraries().items():
        print(f"{key:12s} {value}")
    run = run_cases(isa.pinned_env())
    print(f"{'pinned run':12s} {run['environment']}")
    print(f"{'recorded on':12s} {recorded['environment']}")
    same = 0
    for name in sorted(recorded["cases"]):
        got, want = digest(run["cases"].get(name, [])), digest(recorded["cases"][name])
        same += got == want
        print(f"  {name:18s} {got}  {'= record' if got == want else 'differs from ' + want}")
    print(f"{same} of {len(recorded['cases'])} cases equal the record bit for bit")
    for name, calls in run.get("vector_math", {}).items():
        print(f"  {name}: float32 MKL vector math: {'; '.join(calls)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--record",
        action="store_true",
        help="re-record the named cases (all when none) in results.json and tolerances.json",
    )
    ap.add_argument("--probe", action="store_true", help="this machine's CPU, libraries and pinned digests")
    ap.add_argument("--emit", type=Path, help="run the cases in this process, write their records here")
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args()
    if args.record:
        record(args.cases)
        return
    if args.probe:
        probe()
        return
    names = args.cases or case_names()
    # the pinned run also records every float32 call that reaches MKL's vector math (fedskew.numerics)
    guards = {name: VectorMathGuard() if isa.pinned() else None for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run_case(name, Path(tmp) / name, guards[name]) for name in names}
    vector_math = {
        name: [f"{op} at {site} x{count}" for (op, site), count in sorted(guard.calls.items())]
        for name, guard in guards.items()
        if guard is not None and guard.calls
    }
    result = {"environment": isa.environment(), "cases": runs, "vector_math": vector_math}
    if args.emit:
        args.emit.write_text(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
