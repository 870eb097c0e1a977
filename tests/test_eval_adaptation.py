"""Personalization at evaluation time (``Algorithm.adapt_for_eval``): the hook's math on hand-checkable
cases, evaluation commits nothing (same numbers twice, resume exact), every engine mode and the Flower nodes
score the same adapted models, and a hook that mutates what it is handed is caught by the contract rules."""

from __future__ import annotations

import math

import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import ContractError, LocalStep, Payload, RoundInfo, load_state
from fedskew.algorithms.fedavg_ft import FedAvgFT
from fedskew.engine.evaluation import load_eval_weights
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from fedskew.testing import checked, fingerprint
from tests.test_contract import tiny_config
from tests.test_personal_split import X1, Y0, OneD, client_view, col, make, one_d_context


def eval_step(alg, model, weights, client, r: int = 3) -> LocalStep:
    load_state(model, weights)
    payload = Payload(arrays={f"model.{k}": v for k, v in weights.items()})
    return LocalStep(model=model, payload=payload, state={}, client=client, info=RoundInfo(r, client.cid, 0))


def test_fedavg_ft_fine_tunes_the_model_being_evaluated_by_hand():
    """One epoch, one batch (x = 1, y = 0) at W = (0, 0): ∇ = (−1/2, 1/2), so W' = (lr/2, −lr/2)."""
    alg = make("fedavg_ft", one_d_context(), finetune_epochs=1)
    model = OneD()
    step = eval_step(
        alg, model, {"classifier.weight": col(0.0, 0.0)}, client_view(X1.repeat(2, 1), Y0.repeat(2))
    )
    out = alg.adapt_for_eval(step)
    lr = 0.1 * 1.0  # client.lr x round 3's factor (no decay)
    assert torch.allclose(out["classifier.weight"], col(lr / 2, -lr / 2))
    assert torch.equal(model.classifier.weight.detach(), col(0.0, 0.0))  # the evaluated model untouched


def test_perfedavg_takes_one_alpha_step_at_the_evaluated_model_by_hand():
    """§5: w − α∇f(w); at W = (1, 0) on (x = 1, y = 0), ∇ = (σ(1) − 1, 1 − σ(1))."""
    alg = make("perfedavg", one_d_context(), alpha=0.5, adapt="full")
    step = eval_step(alg, OneD(), {"classifier.weight": col(1.0, 0.0)}, client_view(X1, Y0))
    g = 1 / (1 + math.exp(-1.0)) - 1
    assert torch.allclose(alg.adapt_for_eval(step)["classifier.weight"], col(1.0 - 0.5 * g, 0.5 * g))
    stale = make("perfedavg", one_d_context(), alpha=0.5, eval_adapt="stale")
    assert stale.adapt_for_eval(step) is None  # the former procedure: the step was taken in the round


def test_a_client_without_training_data_is_scored_unadapted():
    alg = make("fedavg_ft", one_d_context())
    empty = client_view(torch.zeros(0, 1), torch.zeros(0, dtype=torch.long))
    assert alg.adapt_for_eval(eval_step(alg, OneD(), {"classifier.weight": col(1.0, 0.0)}, empty)) is None


def test_the_default_hook_never_reads_the_clients_data():
    alg = make("fedavg", one_d_context())
    reads: list[int] = []
    model = OneD()
    payload = Payload(arrays={"model.classifier.weight": col(1.0, 2.0)})

    def read():
        reads.append(1)
        return client_view(X1, Y0)

    load_eval_weights(alg, model, payload, {}, RoundInfo(1, 0, 0), read)
    assert reads == [] and torch.equal(model.classifier.weight.detach(), col(1.0, 2.0))


def test_adapted_weights_the_model_lacks_break_the_contract():
    class Stray(FedAvgFT):
        def adapt_for_eval(self, step):
            return {"nonexistent.weight": torch.zeros(1)}

    alg = Stray(Stray.Params(), one_d_context())
    payload = Payload(arrays={"model.classifier.weight": col(1.0, 2.0)})
    with pytest.raises(ContractError, match="adapt_for_eval returned weights the model lacks"):
        load_eval_weights(alg, OneD(), payload, {}, RoundInfo(1, 0, 0), lambda: client_view(X1, Y0))


def test_fedbabu_local_start_needs_the_stale_procedure():
    with pytest.raises(ConfigError, match="finetune_from=local needs eval_finetune=stale") as err:
        build_simulation(
            build_config(
                tiny_config("fedbabu") | {"algorithm": {"name": "fedbabu", "finetune_from": "local"}}
            )
        )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["fedavg_ft", "fedbabu", "perfedavg"])
def test_evaluation_commits_nothing_and_scores_the_same_twice(name):
    sim = build_simulation(build_config(tiny_config(name, rounds=2)))
    sim.run_round()
    before = fingerprint(sim.server), fingerprint([sim.client_state(c) for c in range(6)])
    first, second = sim.evaluate(), sim.evaluate()
    assert first == second
    assert (fingerprint(sim.server), fingerprint([sim.client_state(c) for c in range(6)])) == before
    assert all(sim.client_state(c) == {} for c in range(6))  # fresh adaptation keeps no per-client state


def test_fresh_fine_tuning_scores_another_model_than_the_stale_one():
    """The point of item 5: after round 1, the fresh fine-tune of w_2, not the kept fine-tune of w_1 (which is
    better is data-dependent; docs/methods/personalized.md has the measured comparison)."""
    fresh = build_simulation(build_config(tiny_config("fedavg_ft", rounds=1)))
    raw = tiny_config("fedavg_ft", rounds=1)
    raw["algorithm"]["eval_finetune"] = "stale"
    stale = build_simulation(build_config(raw))
    a, b = fresh.run_round().record, stale.run_round().record
    assert a["train_loss"] == b["train_loss"]  # the same training
    assert a["accuracy"] != b["accuracy"]  # another model scored


@pytest.mark.parametrize("name", ["fedavg_ft", "perfedavg"])
def test_adapting_at_evaluation_leaves_the_training_streams_alone(name):
    """Evaluating every round (adapting each time, with its own seeded stream) or only at the end trains the
    same bits: the run's random streams never see the adaptation."""

    def run(every: int) -> list[dict]:
        raw = tiny_config(name, rounds=3)
        raw["eval"] = {"protocol": "personalized", "every": every}
        sim = build_simulation(build_config(raw))
        try:
            return [r for r in (sim.run_round().record for _ in range(3)) if r is not None]
        finally:
            sim.close()

    each, last = run(1), run(3)
    assert len(each) == 3 and len(last) == 1
    same = ("round", "train_loss", "accuracy", "loss")
    assert {k: each[-1][k] for k in same} == {k: last[-1][k] for k in same}


def _modes(name: str, mode: str, workers: int) -> list[dict]:
    raw = tiny_config(name, rounds=2, mode=mode, workers=workers)
    raw["client"]["fraction"] = 1.0
    sim = build_simulation(build_config(raw))
    try:
        return [sim.run_round().record for _ in range(2)]
    finally:
        sim.close()


def test_fedavg_ft_engine_modes_score_the_same_adapted_models():
    seq = _modes("fedavg_ft", "sequential", 1)
    for mode, workers in (("vectorized", 1), ("sequential", 2)):
        other = _modes("fedavg_ft", mode, workers)
        for a, b in zip(seq, other, strict=True):
            for key in ("accuracy", "loss", "train_loss"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), (mode, workers, key)


class _MutatesState(FedAvgFT):
    def adapt_for_eval(self, step):
        step.state["sneaky"] = torch.zeros(1)  # a hook must never change what it was handed
        return super().adapt_for_eval(step)


class _MutatesPayload(FedAvgFT):
    def adapt_for_eval(self, step):
        for v in step.payload.arrays.values():
            v.add_(1.0)
        return None


@pytest.mark.parametrize("bad", [_MutatesState, _MutatesPayload])
def test_an_adapt_hook_that_mutates_its_inputs_is_caught_by_the_contract_rules(bad):
    bad.name = "fedavg_ft"
    with ALGORITHMS.replaced("fedavg_ft", checked(bad)):
        sim = build_simulation(build_config(tiny_config("fedavg_ft", rounds=1)))
        with pytest.raises(ContractError, match="adapt_for_eval changed the model, its payload or state"):
            sim.run_round()


def test_fedavg_ft_flower_nodes_score_the_embedded_adapted_models(tmp_path):
    """The nodes hold the clients' data and adapt there, through the embedded evaluator's path."""
    pytest.importorskip("flwr")
    from tests.flower_loopback import LoopbackGrid
    from tests.test_flower import assert_same_metrics, embedded, flower_config, on_flower

    raw = flower_config("fedavg_ft", rounds=2)
    raw["name"] = "eval-adaptation-fedavg_ft"  # its own node runtime (nodes cache one per config)
    here = embedded(raw, tmp_path / "embedded")
    there = on_flower(raw, tmp_path / "flower", LoopbackGrid(3))
    assert_same_metrics(here, there)
    assert here[-1]["accuracy"] > 0.2  # the fine-tuned models were scored, not nothing
