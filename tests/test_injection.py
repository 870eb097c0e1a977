"""The round transaction takes its executor, evaluator and client-state store at construction (typed
protocols), so a runtime supplies parts instead of patching a live simulation: a simulation built from
custom parts trains exactly as the embedded one; the run loop takes an assembler; nothing in the package
assigns another object's parts; and the Flower ServerApp's simulation holds no client runtime and no
training sample but the validation ones."""

from __future__ import annotations

import ast
import gc
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import fedskew
from fedskew.algorithms.base import State
from fedskew.engine.assembly import client_data, initial_server
from fedskew.engine.evaluation import RoundEvaluator
from fedskew.engine.executors import Executor
from fedskew.engine.loop import Simulation
from fedskew.engine.modes import EmbeddedExecutor
from fedskew.engine.runtime import ClientData, ClientRuntime, Inputs
from fedskew.engine.states import ClientStates
from fedskew.engine.types import ClientOutcome, RoundJob
from fedskew.experiment.build import build_algorithm, build_data, round_plan
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from tests.conftest import digits_config

SRC = Path(fedskew.__file__).parent


def _config() -> dict[str, Any]:
    return digits_config(
        rounds=2,
        algorithm={"name": "scaffold"},
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5}},
        client={"epochs": 1, "batch_size": 32, "lr": 0.05, "fraction": 0.5},
        engine={"mode": "sequential"},
    )


class RecordingExecutor:
    """An executor that delegates to another and records the jobs it was given."""

    name = "recording"

    def __init__(self, inner: Executor) -> None:
        self.inner, self.jobs = inner, []

    def train(self, job: RoundJob) -> list[ClientOutcome]:
        self.jobs.append((job.round, list(job.cids)))
        return self.inner.train(job)

    def close(self) -> None:
        self.inner.close()


class ConstantEvaluator:
    """An evaluator that reports how many clients' states it could read."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients, self.calls = num_clients, []

    def evaluate(self, server: State, state_of: Callable[[int], State], round_idx: int) -> dict[str, Any]:
        self.calls.append(round_idx)
        seen = sum("c" in state_of(cid) for cid in range(self.num_clients))
        return {"accuracy": 0.5, "loss": 1.0, "states_seen": seen}


class DictStates:
    """A store in a plain dict (no budget), never keeping an initial state."""

    def __init__(self, initial: Callable[[int], State]) -> None:
        self.initial, self.states, self.commits = initial, {}, []

    def get(self, cid: int) -> State:
        return self.states[cid] if cid in self.states else self.initial(cid)

    def commit(self, round_idx: int, states: Mapping[int, State]) -> None:
        self.commits.append((round_idx, sorted(states)))
        self.states.update(states)

    def trained(self) -> list[int]:
        return sorted(self.states)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.states)

    def load_state_dict(self, sd: Mapping[Any, Any]) -> None:
        self.states = dict(sd)


def _custom(cfg_raw: dict[str, Any]) -> tuple[Simulation, RecordingExecutor, ConstantEvaluator, DictStates]:
    cfg = build_config(cfg_raw)
    data = build_data(cfg)
    algorithm, models = build_algorithm(cfg, data)
    rt = ClientRuntime(
        algorithm, client_data(data, models.device), models, cfg.client, cfg.seed, cfg.rounds, models.device
    )
    server = initial_server(algorithm, models, cfg.seed)
    executor = RecordingExecutor(EmbeddedExecutor(rt, cfg.engine))
    evaluator, states = ConstantEvaluator(data.num_clients), DictStates(rt.initial_state)
    parts: tuple[Executor, RoundEvaluator, ClientStates] = (executor, evaluator, states)  # the protocols
    sim = Simulation(
        algorithm,
        server,
        round_plan(cfg, data.num_clients),
        executor=parts[0],
        evaluator=parts[1],
        states=parts[2],
    )
    return sim, executor, evaluator, states


def test_a_simulation_built_from_custom_parts_trains_as_the_embedded_one():
    sim, executor, evaluator, states = _custom(_config())
    reference = build_simulation(build_config(_config()))
    for _ in range(2):
        record = sim.run_round().record
        reference.run_round()
    assert executor.jobs == [(r + 1, sim.schedule[r].tolist()) for r in range(2)]
    assert evaluator.calls == [1, 2] and record is not None and record["accuracy"] == 0.5
    assert [c for _, c in states.commits] == [sorted(sim.schedule[r].tolist()) for r in range(2)]
    trained = set(sim.schedule[:2].flatten().tolist())
    assert record["states_seen"] == 6 and states.trained() == sorted(trained)  # SCAFFOLD: every state has c
    for key, value in reference.server.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, sim.server[key]), key
        else:
            assert value.keys() == sim.server[key].keys(), key
            assert all(torch.equal(v, sim.server[key][k]) for k, v in value.items()), key
    for cid in trained:
        assert all(
            torch.equal(v, sim.client_state(cid)["c"][k]) for k, v in reference.client_state(cid)["c"].items()
        )


def test_the_run_loop_takes_an_assembler(tmp_path):
    built: list[Path | None] = []

    def assemble(cfg, states_dir):  # type: ignore[no-untyped-def]
        built.append(states_dir)
        return _custom(_config())[0]

    summary = run_experiment(build_config(_config()), tmp_path / "run", assemble=assemble)
    assert built == [tmp_path / "run" / "client-states"]
    assert summary["final"]["accuracy"] == 0.5 and summary["rounds"] == 2


# ---------------------------------------------------------------------------- no patching
PARTS = {"executor", "evaluator", "states", "prepare", "initial_client_state", "runtime"}


def _foreign_part_assignments(tree: ast.AST) -> list[tuple[int, str]]:
    """``x.<part> = ...`` where ``x`` is not ``self``: a live object's part replaced from outside."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            own = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            if isinstance(t, ast.Attribute) and t.attr in PARTS and not own:
                out.append((node.lineno, ast.unparse(t)))
    return out


def test_the_finder_finds_a_patched_part():
    assert _foreign_part_assignments(ast.parse("sim.executor = x\nself.executor = y\nm.prepare = f")) == [
        (1, "sim.executor"),
        (3, "m.prepare"),
    ]


def test_no_module_patches_a_part_of_another_object():
    bad = {
        str(p.relative_to(SRC)): hits
        for p in SRC.rglob("*.py")
        if (hits := _foreign_part_assignments(ast.parse(p.read_text())))
    }
    assert not bad, bad
    server = (SRC / "flower" / "server.py").read_text()
    assert "type: ignore[assignment]" not in server and "attach" not in server
    assert "attach" not in (SRC / "experiment" / "runner.py").read_text()


# ---------------------------------------------------------------------------- the ServerApp's memory
def _reachable(root: object) -> Iterator[object]:
    """Objects reachable from ``root`` through references (not through modules, classes or a function's
    globals: those reach everything)."""
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or id(o) in module_dicts or isinstance(o, (types.ModuleType, type)):
            continue
        seen.add(id(o))
        yield o
        if isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in o.__closure__ or () if c.cell_contents is not None)
            stack.extend(o.__defaults__ or ())
        else:
            stack.extend(gc.get_referents(o))


def test_the_server_app_holds_no_client_runtime_and_no_training_samples():
    pytest.importorskip("flwr")
    from fedskew.flower.server import server_simulation
    from tests.flower_loopback import LoopbackGrid

    raw = _config()
    raw["data"]["val_fraction"] = 0.1
    raw["engine"].update(runtime="flower-simulation", nodes=3)
    cfg = build_config(raw)
    n_train = len(build_data(cfg).dataset.x_train)
    sim = server_simulation(LoopbackGrid(3), cfg, None, None)
    kinds = {type(o) for o in _reachable(sim)}
    assert not kinds & {ClientRuntime, ClientData, Inputs}
    big = [
        o.shape for o in _reachable(sim) if isinstance(o, torch.Tensor) and o.dim() and o.shape[0] >= n_train
    ]
    assert not big  # neither the training images nor their labels; the test set is smaller
    embedded = build_simulation(build_config({**raw, "engine": {"mode": "sequential"}}))
    assert any(isinstance(o, ClientData) for o in _reachable(embedded))  # the walk does see a runtime


# ---------------------------------------------------------------------------- executors
class _Reversed:
    """A test executor kind: the sampled clients one by one, last first."""

    name, pooled_name, grouped = "_reversed", "_reversed+workers", False

    def __init__(self, engine: Any) -> None:
        pass

    def supports(self, algorithm: Any) -> bool:
        return True

    def unsupported(self, rt: ClientRuntime, cids: list[int]) -> str | None:
        return None

    def train(self, rt: ClientRuntime, job: RoundJob, cids: list[int]) -> list[ClientOutcome]:
        from fedskew.engine.executors import train_sequential

        return train_sequential(rt, job, cids[::-1])[::-1]


def test_a_registered_executor_kind_is_an_engine_mode():
    from fedskew.engine.executors import EXECUTORS
    from fedskew.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"^config key 'engine.mode': unknown executor '_reversed'.*allowed: auto"
    ):
        build_config({**_config(), "engine": {"mode": "_reversed"}})
    reference = build_simulation(build_config(_config()))
    with EXECUTORS.replaced("_reversed", _Reversed):
        sim = build_simulation(build_config({**_config(), "engine": {"mode": "_reversed"}}))
        for _ in range(2):
            mine, theirs = sim.run_round().record, reference.run_round().record
            assert {k: v for k, v in mine.items() if not k.startswith("seconds")} == {
                k: v for k, v in theirs.items() if not k.startswith("seconds")
            }
        assert sim.executor.name == "_reversed"
    assert all(torch.equal(v, sim.server["weights"][k]) for k, v in reference.server["weights"].items())
