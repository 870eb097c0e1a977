"""Golden results: every registered algorithm's metrics on small digits configs, against the record.

Each case runs twice, in fresh processes (tests/golden/isa.py):

* pinned to AVX2 (ATen, MKL's cross-vendor reproducibility branch, oneDNN off, one thread): the metrics
  equal ``tests/golden/results.json`` bit for bit on every x86-64 CPU with AVX2; with another torch or
  another architecture, within the tolerances below;
* with the machine's native kernels (AVX-512 where the CPU has it): within ``tolerances.json``, ten times
  the largest drift measured between the pinned run and the other kernel choices of an x86-64 CPU.

So a record made unpinned (an AVX2-only or AVX-512-only number) fails on every machine, and so does code
that only holds on one kind of CPU. A deliberate change re-records (``python -m tests.golden.cases
--record``) and is explained in the change's notes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from tests.golden import isa
from tests.golden.cases import RESULTS, TOLERANCES, case_names, digest, mismatches, run_cases
from tests.test_contract import package_algorithms

GOLDEN = json.loads(RESULTS.read_text())
TOLERANCE = json.loads(TOLERANCES.read_text())
KINDS = ("pinned", "native")


class SharedRuns:
    """One run of every case per kind, made once per test session: under pytest-xdist the first worker
    that needs a kind runs it, behind a file lock, and the others read its file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.memo: dict[str, dict[str, Any]] = {}

    def get(self, kind: str) -> dict[str, Any]:
        if kind not in self.memo:
            path = self.folder / f"golden-{kind}.json"
            with FileLock(str(path) + ".lock"):
                if not path.is_file():
                    env = isa.pinned_env() if kind == "pinned" else dict(os.environ)
                    path.write_text(json.dumps(run_cases(env)))
                self.memo[kind] = json.loads(path.read_text())
        return self.memo[kind]


@pytest.fixture(scope="session")
def golden_runs(tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    base = tmp_path_factory.getbasetemp()
    # xdist workers' temp folders sit in one folder of this session; a plain session owns its own
    return SharedRuns(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


def test_every_registered_algorithm_has_a_golden_case():
    assert set(package_algorithms()) <= set(GOLDEN["cases"])
    assert set(case_names()) == set(GOLDEN["cases"]) == set(TOLERANCE["cases"])


def test_the_record_was_made_pinned_to_avx2():
    """A record made with native kernels would hold on one kind of CPU only."""
    env = GOLDEN["environment"]
    assert env["pinned"] and env["capability"] == "AVX2", env


def _bit_equal_expected(got_env: dict[str, Any]) -> bool:
    """Bits are promised only where the pin holds: the recorded torch on the recorded architecture."""
    want = GOLDEN["environment"]
    return got_env["pinned"] and all(got_env[k] == want[k] for k in ("torch", "machine", "capability"))


def test_no_float32_call_reaches_mkl_vector_math(golden_runs: SharedRuns):
    """MKL's float32 vector math is not correctly rounded and its bits differ between CPU models (issue 56):
    every method and optimizer goes through ``fedskew.numerics`` instead. The pinned run records each call."""
    calls = golden_runs.get("pinned")["vector_math"]
    assert not calls, "float32 calls reaching MKL's vector math:\n" + "\n".join(
        f"{name}: {'; '.join(sites)}" for name, sites in calls.items()
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", case_names())
def test_metrics_match_the_golden_record(golden_runs: SharedRuns, kind: str, name: str):
    run = golden_runs.get(kind)
    exact = kind == "pinned" and _bit_equal_expected(run["environment"])
    tolerance = None if exact else TOLERANCE["cases"][name]
    found = mismatches(run["cases"][name], GOLDEN["cases"][name], tolerance)
    how = "bit for bit" if exact else "within the measured drift"
    assert not found, f"{name} ({kind} kernels, {run['environment']}) differs {how}:\n" + "\n".join(found)


def test_the_probe_digest_sees_a_one_ulp_change():
    """What ``--probe`` compares: a metric moved by one float64 ulp changes the case's digest."""
    records = GOLDEN["cases"]["fedavg"]
    moved = [dict(r) for r in records]
    moved[-1]["loss"] = math.nextafter(moved[-1]["loss"], math.inf)
    assert digest(records) == digest([dict(r) for r in records]) != digest(moved)
