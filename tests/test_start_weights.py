"""``LocalPlan.start_weights``: the runtime loads them after ``start_local`` and before ``init_scratch``, so
the first batch of local training sees them, in every engine mode (the vectorized engine stacks the
parameters after ``prepare_client``).

A test-only algorithm starts from the received weights + 1 and records, in its scratch, the parameters the
loss sees on the first batch; ``finish_local`` keeps that record in the client state.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import (
    Algorithm,
    Batch,
    ContractError,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    clone_state,
)
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from tests.test_contract import tiny_config

NAME = "_start_shifter"
SEEN = "seen"


def key(name: str) -> str:
    return "first." + name


class _StartShifter(Algorithm):
    """Test-only: trains from the received weights + 1 and records what the first batch's loss sees."""

    name: ClassVar[str] = NAME
    vectorizable = True
    loss_reads: ClassVar[frozenset[str]] = frozenset()

    def start_local(self, step: LocalStep) -> LocalPlan:
        plan = super().start_local(step)
        shifted = {n: p.detach() + 1.0 for n, p in step.model.named_parameters()}
        return LocalPlan(plan.phases, plan.derived, start_weights=shifted)

    def init_scratch(self, step: LocalStep) -> dict[str, torch.Tensor]:
        out = {key(n): torch.zeros_like(p.detach()) for n, p in step.model.named_parameters()}
        return {**out, SEEN: torch.zeros(())}

    def local_loss(self, step: LocalStep, batch: Batch) -> torch.Tensor:
        first = step.scratch[SEEN] == 0  # a tensor condition: no Python branching under vmap
        for n, p in step.model.named_parameters():
            record = step.scratch[key(n)]
            record.copy_(torch.where(first, p.detach(), record))
        step.scratch[SEEN].add_(1.0)
        return super().local_loss(step, batch)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        out = super().finish_local(step, result)
        first = {n[len("first.") :]: v for n, v in step.scratch.items() if n.startswith("first.")}
        return LocalOutput(out.upload, {**step.state, "first": clone_state(first), "steps": result.steps})


class _UnknownKey(Algorithm):
    name: ClassVar[str] = "_unknown_start"

    def start_local(self, step: LocalStep) -> LocalPlan:
        plan = super().start_local(step)
        return LocalPlan(plan.phases, start_weights={"no.such.weight": torch.zeros(1)})


def one_round(mode: str) -> Any:
    with ALGORITHMS.replaced(NAME, _StartShifter):
        cfg = tiny_config("fedavg", rounds=1, mode=mode) | {"algorithm": {"name": NAME}}
        sim = build_simulation(build_config(cfg))
        received = clone_state(sim.server["weights"])
        record = sim.run_round().record
    return sim, received, record


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_the_first_batch_sees_the_start_weights(mode):
    sim, received, record = one_round(mode)
    try:
        assert sim.executor.name == mode and record["rejected"] == 0
        trained = [c for c in sim.states.trained() if "first" in sim.client_state(c)]
        assert trained
        for cid in trained:
            state = sim.client_state(cid)
            if state["steps"] == 0:  # a client without a batch never ran the loss
                continue
            for n, v in state["first"].items():
                assert torch.equal(v, received[n] + 1.0), (cid, n)
    finally:
        sim.close()


def test_sequential_and_vectorized_agree_on_the_shifted_start():
    seq, _, a = one_round("sequential")
    vec, _, b = one_round("vectorized")
    try:
        for k in ("accuracy", "loss", "train_loss"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7, nan_ok=True), k
        for n, v in seq.server["weights"].items():
            torch.testing.assert_close(vec.server["weights"][n], v, rtol=1e-5, atol=1e-6)
        for cid in seq.states.trained():
            for n, v in seq.client_state(cid)["first"].items():
                assert torch.equal(vec.client_state(cid)["first"][n], v), (cid, n)
    finally:
        seq.close()
        vec.close()


def test_start_weights_the_model_lacks_break_the_contract():
    with ALGORITHMS.replaced(_UnknownKey.name, _UnknownKey):
        cfg = tiny_config("fedavg", rounds=1) | {"algorithm": {"name": _UnknownKey.name}}
        sim = build_simulation(build_config(cfg))
        with pytest.raises(ContractError, match="start_weights the model lacks"):
            sim.run_round()
    assert sim.round == 0
