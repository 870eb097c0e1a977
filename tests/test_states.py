"""The client-state store (``fedskew.engine.states``): the memory budget holds, spilled states read back bit
for bit, never-trained clients are not memoised, a run that spills gives the numbers of one that does not,
and resume (also from the previous checkpoint) is exact with spilled states."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

from fedskew.engine.states import STATES_DIR, SpillingStates, state_nbytes
from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import CHECKPOINT_FILE, CHECKPOINT_PREV, run_experiment
from tests.conftest import StopRun, digits_config, run_metrics, stop_after

MB = 2**20


def _state(cid: int, seed: int = 0) -> dict:
    """A state of 1 MB of float32 (with special values and a non-float tensor) and plain values."""
    g = torch.Generator().manual_seed(seed * 1000 + cid)
    w = torch.randn(MB // 4, generator=g)
    w[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    return {"c": {"w": w, "n": torch.arange(4)}, "rate": 0.1 * cid, "name": f"client-{cid}"}


def _same(a: object, b: object) -> bool:
    """Bit-identical nested states (NaN payloads and signed zeros included)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_the_budget_holds_and_spilled_states_read_back_bit_for_bit(tmp_path):
    initial_calls: list[int] = []

    def initial(cid: int) -> dict:
        initial_calls.append(cid)
        return {"c": {"w": torch.zeros(2)}}

    store = SpillingStates(initial, budget_bytes=3 * MB + 1024, folder=tmp_path / "states")
    for r in (1, 2, 3):
        store.commit(r, {cid: _state(cid, r) for cid in range(4 * r - 4, 4 * r)})
        assert store.memory_bytes <= 3 * MB + 1024
    assert store.trained() == list(range(12)) and store.spilled == 9
    assert len(list((tmp_path / "states").glob("*.pt"))) == 9
    for cid in range(12):
        assert _same(store.get(cid), _state(cid, cid // 4 + 1)), cid
    # a client retrained replaces its spilled state (and its file)
    store.commit(4, {0: _state(0, 9)})
    assert _same(store.get(0), _state(0, 9)) and len(list((tmp_path / "states").glob("*.pt"))) == 9
    assert initial_calls == []


def test_never_trained_clients_get_their_initial_state_and_are_not_kept():
    calls: list[int] = []

    def initial(cid: int) -> dict:
        calls.append(cid)
        return {"c": torch.full((3,), float(cid))}

    store = SpillingStates(initial, budget_bytes=MB)
    for _ in range(2):
        assert all(torch.equal(store.get(c)["c"], torch.full((3,), float(c))) for c in range(100))
    assert calls == list(range(100)) * 2  # built on each request, never memoised
    assert store.trained() == [] and store.memory_bytes == 0 and store.state_dict()["memory"] == {}


def test_a_state_is_counted_by_its_storage():
    big = torch.zeros(1000)
    assert state_nbytes({"view": big[:10], "same": big[10:20]}) == big.untyped_storage().nbytes()


def test_a_run_without_output_spills_under_the_cache_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    store = SpillingStates(lambda cid: {}, budget_bytes=0)
    store.commit(1, {0: _state(0)})
    folder = store.folder()
    assert folder.parent == tmp_path / "cache" / STATES_DIR and len(list(folder.glob("*.pt"))) == 1
    assert _same(store.get(0), _state(0))
    del store
    gc.collect()
    assert not folder.exists()


def test_a_damaged_spill_file_is_named(tmp_path):
    store = SpillingStates(lambda cid: {}, budget_bytes=0, folder=tmp_path)
    store.commit(1, {5: _state(5)})
    victim = next(tmp_path.glob("*.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(FedskewError, match=r"client 5's state file .* is missing or damaged"):
        store.get(5)


def test_a_state_that_cannot_be_spilled_stays_in_memory(tmp_path, monkeypatch, caplog):
    def full(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    store = SpillingStates(lambda cid: {}, budget_bytes=0, folder=tmp_path)
    monkeypatch.setattr(torch, "save", full)
    with caplog.at_level("WARNING", logger="fedskew.engine"):
        store.commit(1, {0: _state(0), 1: _state(1)})
    assert "keeping them in memory" in caplog.text and store.spilled == 0
    assert _same(store.get(1), _state(1)) and not list(tmp_path.iterdir())  # no temporary file left
    monkeypatch.undo()
    store.commit(2, {2: _state(2)})  # the disk has room again: the budget holds again
    assert store.spilled == 3 and store.memory_bytes == 0 and _same(store.get(0), _state(0))


def test_the_budget_setting_is_validated_in_one_line():
    with pytest.raises(ConfigError, match=r"^config key 'engine.state_memory_mb': .*greater than 0"):
        build_config(digits_config(engine={"state_memory_mb": 0}))


# ---------------------------------------------------------------------------- runs
def _scaffold(budget_mb: float, rounds: int = 4) -> dict:
    return digits_config(
        rounds=rounds,
        algorithm={"name": "scaffold"},
        data={"dataset": "digits", "num_clients": 8, "partition": {"name": "dirichlet", "alpha": 0.5}},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        client={"epochs": 1, "batch_size": 16, "lr": 0.05, "fraction": 0.5},
        engine={"mode": "sequential", "state_memory_mb": budget_mb},
        checkpoint={"every": 1},
    )


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("memory") / "run"
    run_experiment(build_config(_scaffold(budget_mb=1024)), out)
    assert not list((out / STATES_DIR).glob("*.pt"))  # nothing spilled
    return run_metrics(out)


TINY = 0.05  # MB: a few of the clients' control variates (~0.1 MB each) in memory, the others on disk


def test_a_run_that_spills_gives_the_in_memory_numbers(tmp_path, in_memory):
    out = tmp_path / "run"
    run_experiment(build_config(_scaffold(TINY)), out)
    assert list((out / STATES_DIR).glob("*.pt"))  # states really went to disk, in the output folder
    assert run_metrics(out) == in_memory


def test_resume_with_spilled_states_is_exact(tmp_path, in_memory):
    out = tmp_path / "run"
    with pytest.raises(StopRun):
        run_experiment(build_config(_scaffold(TINY)), out, on_round=stop_after(2))
    run_experiment(build_config(_scaffold(TINY)), out, resume=True)
    assert run_metrics(out) == in_memory


def test_the_previous_checkpoint_still_finds_its_spilled_states(tmp_path, in_memory):
    out = tmp_path / "run"
    run_experiment(build_config(_scaffold(TINY)), out)
    named = set()
    for name in (CHECKPOINT_FILE, CHECKPOINT_PREV):
        clients = torch.load(out / name, weights_only=True)["clients"]
        named |= {file for file, _ in clients["spilled"].values()}
    assert {p.name for p in (out / STATES_DIR).glob("*.pt")} == named  # superseded files were deleted
    (out / CHECKPOINT_FILE).unlink()  # a kill between the renames of the last checkpoint write
    run_experiment(build_config(_scaffold(TINY)), out, resume=True)  # from round 3: round 4 again
    assert run_metrics(out) == in_memory
