"""One property test per flag of ``Algorithm`` (contract v4): each has a runtime reader and the base
defaults are FedAvg's, so FedAvg declares none."""

from __future__ import annotations

import pytest
import torch

from fedskew.algorithms.base import ALGORITHMS, Algorithm, ContractError
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from tests.conftest import digits_config

FLAGS = {
    "personalized_eval", "requires_personalized_eval", "heterogeneous_models", "mean_aggregation",
    "vision_language", "vectorizable", "loss_reads", "working_buffers", "reads_client_scalars",
    "discloses_client_statistics", "partial_work", "federation_counts",
}  # fmt: skip


def test_the_flags_are_these_and_fedavg_declares_none() -> None:
    declared = {
        k
        for k, v in vars(Algorithm).items()
        if k not in ("name", "Params") and not k.startswith("_") and isinstance(v, (bool, frozenset, str))
    }
    assert declared == FLAGS
    assert not FLAGS & set(vars(ALGORITHMS.get("fedavg")))


def test_heterogeneous_models_refuses_other_shapes_at_build_time() -> None:
    model = {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16, "per_client": {"0-1": {"hidden": 48}}}
    for policy in ("fail", "drop"):  # dropping clients every round is no way out
        cfg = build_config(
            digits_config(algorithm={"name": "fedavg"}, model=model, engine={"on_client_error": policy})
        )
        with pytest.raises(ConfigError, match=r"model.per_client: client 0.*heterogeneous_models") as err:
            build_simulation(cfg)
        assert "\n" not in str(err.value)
    same = {**model, "per_client": {"0-1": {"normalize": True}}}  # same shapes: allowed
    build_simulation(build_config(digits_config(algorithm={"name": "fedavg"}, model=same))).close()
    cfg = digits_config(algorithm={"name": "local"}, model=model, eval={"protocol": "personalized"})
    build_simulation(build_config(cfg)).close()  # declared: allowed


def test_requires_personalized_eval_refuses_the_global_protocol() -> None:
    with pytest.raises(ConfigError, match="personalized"):
        build_config(digits_config(algorithm={"name": "local"}, eval={"protocol": "global"}))


def test_mean_aggregation_decides_security_eligibility() -> None:
    assert ALGORITHMS.get("fedavgm").mean_aggregation and not ALGORITHMS.get("fedproto").mean_aggregation
    with pytest.raises(ConfigError, match="allowed algorithms"):
        build_config(digits_config(algorithm={"name": "qfedavg"}, defence={"name": "median"}))


def test_vision_language_needs_its_data_section() -> None:
    with pytest.raises(ConfigError, match="data.vision_language"):
        build_config(digits_config(algorithm={"name": "zeroshot"}))


def test_vectorizable_is_what_the_vectorized_kind_accepts() -> None:
    from fedskew.engine.executors import EXECUTORS
    from fedskew.engine.vectorized import unsupported_reason
    from fedskew.settings import EngineSection

    kind = EXECUTORS.get("vectorized")(EngineSection())
    verdicts = {name: kind.supports(ALGORITHMS.get(name)) for name in ALGORITHMS.names()}
    assert verdicts == {name: ALGORITHMS.get(name).vectorizable for name in ALGORITHMS.names()}
    assert verdicts["fedavg"] and not verdicts["moon"]  # both answers occur
    sim = build_simulation(build_config(digits_config(algorithm={"name": "moon"})))
    try:
        reason = unsupported_reason(sim.algorithm, torch.nn.Linear(2, 2))
    finally:
        sim.close()
    assert reason is not None and "moon" in reason
    assert ALGORITHMS.get("fedprox").loss_reads == {"payload", "state", "derived"}


def test_reads_client_scalars_is_refused_under_privacy() -> None:
    with pytest.raises(ConfigError, match="per-client scalars"):
        build_config(
            digits_config(
                algorithm={"name": "fednova"},
                privacy={"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5},
            )
        )


def test_discloses_client_statistics_false_under_dp_hides_counts() -> None:
    from fedskew.algorithms.security.config import security_plan
    from fedskew.algorithms.security.secured import secured
    from fedskew.settings import AttackSection, DefenceSection, PrivacySection

    priv = PrivacySection(
        mechanism="local", clip=1.0, noise_multiplier=1.0, delta=1e-5, randomness="reproducible"
    )
    plan = security_plan(
        AttackSection(), DefenceSection(), priv, num_clients=4, per_round=2, rounds=1, seed=0
    )
    cls = secured(ALGORITHMS.get("fedavg"), plan)
    assert not cls.discloses_client_statistics and cls.mean_aggregation  # local DP: still folded
    central = PrivacySection(
        mechanism="central", clip=1.0, noise_multiplier=1.0, delta=1e-5, randomness="reproducible"
    )
    plan = security_plan(
        AttackSection(), DefenceSection(), central, num_clients=4, per_round=2, rounds=1, seed=0
    )
    assert not secured(ALGORITHMS.get("fedavg"), plan).mean_aggregation  # the server replaces the mean


class _CachingFedAvg(Algorithm):
    """FedAvg whose server step leaves a value on the algorithm object (contract rule 2)."""

    def server_step(self, server, mean, info):  # type: ignore[no-untyped-def]
        self.last_round_cache = info.round
        return super().server_step(server, mean, info)


class _DeclaredCache(_CachingFedAvg):
    working_buffers = frozenset({"last_round_cache"})


def test_working_buffers_are_the_only_attributes_a_hook_may_add() -> None:
    for cls, allowed in ((_CachingFedAvg, False), (_DeclaredCache, True)):
        with ALGORITHMS.replaced("fedavg", cls):
            sim = build_simulation(build_config(digits_config(algorithm={"name": "fedavg"}, rounds=1)))
            try:
                if allowed:
                    sim.run_round()
                    assert sim.round == 1
                else:
                    with pytest.raises(ContractError, match="last_round_cache.*working_buffers"):
                        sim.run_round()
                    assert sim.round == 0  # nothing committed
            finally:
                sim.close()


class _ZeroedClients(Algorithm):
    """FedAvg whose per-client evaluation weights are all zeros (a client's ``state`` is not ``None``)."""

    def eval_weights(self, payload, state):  # type: ignore[no-untyped-def]
        weights = dict(payload.model_state())
        return weights if state is None else {k: torch.zeros_like(v) for k, v in weights.items()}


def test_personalized_eval_decides_whether_clients_are_scored_with_their_own_weights() -> None:
    """The evaluators read ``personalized_eval``: without it, the personalized protocol scores the global
    model on each client's test split (per-client ``eval_weights`` are never asked for); with it, each
    client's own weights."""

    def accuracy(personal: bool) -> float:
        cls = type("Zeroed", (_ZeroedClients,), {"personalized_eval": personal})
        with ALGORITHMS.replaced("fedavg", cls):
            raw = digits_config(rounds=1, eval={"protocol": "personalized", "every": 1})
            sim = build_simulation(build_config(raw))
            try:
                return float(sim.run_round().record["accuracy"])
            finally:
                sim.close()

    with ALGORITHMS.replaced("fedavg", type("Plain", (Algorithm,), {})):
        sim = build_simulation(build_config(digits_config(rounds=1, eval={"protocol": "personalized"})))
        try:
            fedavg = float(sim.run_round().record["accuracy"])
        finally:
            sim.close()
    assert accuracy(False) == fedavg > 0.3  # the global model, per client
    assert accuracy(True) < 0.2  # the zeroed weights: one constant class


def test_partial_work_decides_whether_a_deadline_may_cut_local_steps() -> None:
    clock = {"deadline": 1.0, "late": "partial"}
    with pytest.raises(ConfigError, match="'fedavg' does not declare partial_work"):
        build_config({**digits_config(algorithm={"name": "fedavg"}), "clock": clock})
    declared = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).partial_work]
    assert sorted(declared) == ["fednova", "fedprox"]
    cfg = digits_config(algorithm={"name": "fedprox"}, engine={"mode": "sequential"}, rounds=1)
    build_simulation(build_config({**cfg, "clock": clock})).close()  # declared: allowed


def test_federation_counts_decides_what_a_nodes_context_holds_of_other_clients() -> None:
    """A Flower node's context holds its own clients' counts, plus what the method declares (the full
    property, every method bit-identical from its view: tests/test_need_to_know.py)."""
    from fedskew.flower.node import build_node
    from tests.test_contract import tiny_config

    cases = (("fedavg", False, False), ("fedent", True, False), ("fedgen", True, True))
    for name, sizes, histograms in cases:
        raw = tiny_config(name, rounds=1)
        raw["engine"]["nodes"] = 3
        node = build_node(build_config(raw), 0)
        ctx, others = node.rt.algorithm.ctx, [c for c in range(6) if c not in node.owned]
        assert bool(ctx.client_sizes[node.owned].all()) and bool(ctx.class_counts[node.owned].any())
        assert bool(ctx.client_sizes[others].any()) == sizes, name
        assert bool(ctx.class_counts[others].any()) == histograms, name
