"""Shared fixtures: small offline federations on scikit-learn digits."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from fedskew.algorithms.base import Context
from fedskew.models.base import FedModel
from fedskew.settings import ClientSection
from tests.ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (the hooks)

torch.set_num_threads(1)  # tests run in parallel (pytest -n 2) on 2 cores
#: and so does every run a test starts, in this process (the CLI's thread policy: engine.threads auto
#: takes OMP_NUM_THREADS first) or in a subprocess: the automatic count depends on the load, and tests that
#: compare two runs with ``==`` must not depend on it (tests/test_threads.py unsets it to test the policy)
os.environ["OMP_NUM_THREADS"] = "1"


#: test files that take minutes mostly waiting on other processes: collected first, so that under
#: ``pytest -n 2`` (``make test``) the first worker's first chunk of tests holds them all (one shared
#: Flower deployment) while the other workers run the rest of the suite
FIRST = ("test_flower_deployment.py",)


#: the tests whose numbers depend on which CPU kernels PyTorch picks: golden records, portable math, the
#: optimizers against torch.optim, bit-parity between engine modes / runtimes / folding, the contract suite
#: and the learning margins. ``make test-kernels`` (marker ``kernels``) runs only these: CI's second pass on
#: ATen's AVX2 kernels (every ISA failure so far was a golden case: docs/decisions.md, "Golden results on
#: every CPU" and "Portable float32 math")
KERNELS = (
    "test_golden.py",
    "test_numerics.py",
    "test_engine_sgd.py",
    "test_engine_optim.py",
    "test_engine_modes.py",
    "test_folding.py",
    "test_runtimes_agree.py",
    "test_contract.py",
    "test_learning.py",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kernels: depends on the CPU kernels (make test-kernels; conftest.KERNELS)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order
    for item in items:
        if item.path.name in KERNELS:
            item.add_marker(pytest.mark.kernels)


def data_root() -> Path | None:
    root = os.environ.get("FEDSKEW_DATA")
    return Path(root) if root else None


requires_data = pytest.mark.skipif(
    data_root() is None, reason="needs real datasets: set FEDSKEW_DATA (e.g. ../shared/data); CI sets it"
)


#: vision-language methods train heads over a backbone's features: a tiny random CLIP, procedural images
VL_WORLD = {
    "backbone": {"name": "random_clip"},
    "generator": {"name": "procedural"},
    "shots": 2,
    "cache": False,
}


def digits_config(**over) -> dict:
    """A fast digits federation; keyword arguments replace top-level sections / keys."""
    cfg = {
        "seed": 0,
        "rounds": 3,
        "data": {"dataset": "digits", "num_clients": 5, "partition": {"name": "dirichlet", "alpha": 0.5}},
        "model": {"name": "mlp_mpfedcl"},
        "algorithm": {"name": "fedavg"},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.5},
        "eval": {"protocol": "global", "every": 1},
        "checkpoint": {"every": 1},
    }
    cfg.update(over)
    return cfg


class TinyLinearModel(FedModel):
    """features = a 2x2 linear map (embedding d = 2), head = a 3-class classifier: hand-checkable hooks."""

    embed_dim = 2

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False)
        self.classifier = nn.Linear(2, 3)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


def tiny_context() -> Context:
    """Two clients, three classes, 2-d inputs and :class:`TinyLinearModel`: hook-level algorithm tests."""
    return Context(
        num_clients=2,
        num_classes=3,
        in_shape=(2,),
        device=torch.device("cpu"),
        client=ClientSection(epochs=1, batch_size=4, lr=0.1),
        client_sizes=torch.tensor([3, 3]),
        class_counts=torch.tensor([[2, 1, 0], [0, 1, 2]]),
        rounds=2,
        seed=0,
        build_model=lambda cid: TinyLinearModel(),
    )


# ---------------------------------------------------------------------------- the data root is only read
def tree_snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` (itself included, links not followed) -> (size, mtime_ns, mode)."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for path in (Path(folder), *(Path(folder) / n for n in dirs + names)):
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def tree_changes(before: dict, after: dict) -> list[str]:
    """Paths created, removed or changed (size, mtime, mode) between two :func:`tree_snapshot` calls."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@pytest.fixture(scope="session", autouse=True)
def data_root_is_only_read(request: pytest.FixtureRequest) -> None:
    """Fail the session when anything under ``$FEDSKEW_DATA`` was created, changed or removed.

    Tests run as root in CI, where permissions stop no write: the snapshot is the guard. Session-scoped, so
    each pytest-xdist worker checks the whole tree at its own end.
    """
    root = data_root()
    if root is None or not root.is_dir():
        return
    before = tree_snapshot(root)

    def check() -> None:
        changed = tree_changes(before, tree_snapshot(root))
        if changed:
            pytest.fail(f"tests wrote under the data root {root}: {', '.join(changed[:10])}", pytrace=False)

    request.addfinalizer(check)


class StopRun(Exception):
    """Raised by :func:`stop_after` to interrupt a run after a given round (its checkpoint is kept)."""


def stop_after(round_: int):  # type: ignore[no-untyped-def]
    """A runner ``on_round`` callback that stops the run once round ``round_`` is committed."""

    def on_round(sim, record) -> None:  # type: ignore[no-untyped-def]
        if sim.round == round_:
            raise StopRun

    return on_round


def run_metrics(out: Path) -> list[dict]:
    """A run folder's ``metrics.jsonl`` records without their wall-clock ``seconds*`` keys."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in rows]


def cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``fedskew ARGV`` in this process through ``fedskew.cli.main`` (its exit-code mapping included)."""
    import fedskew.cli

    monkeypatch.setattr(sys, "argv", ["fedskew", *argv])
    try:
        fedskew.cli.main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
