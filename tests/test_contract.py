"""The algorithm contract, checked for every registered algorithm (a new one is covered without edits).

For each algorithm on a tiny digits federation: a round runs and every upload is accepted; no hook mutates
what it was handed (payload, server state, client state, uploads, the model's structure); a run interrupted
after a checkpoint and resumed gives the uninterrupted metrics exactly; every engine mode the algorithm
qualifies for gives the sequential numbers; and algorithms that declare heterogeneous models train with
clients of different architectures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import Algorithm, ContractError, RoundInfo
from fedskew.engine.client import train_client
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from fedskew.testing import fingerprint
from tests.conftest import VL_WORLD, digits_config


def package_algorithms() -> list[str]:
    """Every algorithm the package registers (tests and README examples register their own elsewhere)."""
    return [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("fedskew.")]


NAMES = package_algorithms()
#: methods whose defining behaviour concerns BatchNorm layers: the suites give them a model with BN
BATCHNORM_METHODS = frozenset({"fedbn"})
#: FedBN's DigitModel layout at a width that trains in milliseconds on 8x8 digits
TINY_BN_CNN = {"name": "cnn_fedbn", "conv_channels": [4, 4, 8], "fc_widths": [16, 16]}
TIMING = ("seconds",)


def tiny_config(name: str, rounds: int = 2, **engine: Any) -> dict:
    alg = ALGORITHMS.get(name)
    cfg = digits_config(
        rounds=rounds,
        algorithm={"name": name},
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5}},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        client={"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 0.67},
        engine={"mode": "sequential", "workers": 1, **engine},
        checkpoint={"every": 1},
    )
    if alg.personalized_eval:
        cfg["eval"] = {"protocol": "personalized", "every": 1}
    if alg.vision_language:  # runs on frozen-backbone features: a feature world
        cfg["data"]["vision_language"] = VL_WORLD
        cfg["model"] = {"name": "identity"}
    if name in BATCHNORM_METHODS:  # the method's point is BatchNorm: a net with BN layers
        cfg["model"] = TINY_BN_CNN
    if "head_epochs" in alg.Params.model_fields:  # a head-then-body method: keep the head phase short
        cfg["algorithm"]["head_epochs"] = 1
    return cfg


def metrics_of(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)} for x in lines]


def test_the_suite_covers_the_whole_registry():
    import fedskew.algorithms as package

    modules = {
        m.__name__
        for m in vars(package).values()
        if getattr(m, "__name__", "").startswith(package.__name__ + ".")
    }
    registered = {ALGORITHMS.get(n).__module__ for n in NAMES}
    assert len(NAMES) >= 22 and set(NAMES) == set(package_algorithms())
    assert registered <= modules  # every algorithm module of the package contributes its classes


@pytest.mark.parametrize("name", NAMES)
def test_a_round_runs_and_every_upload_is_accepted(name):
    sim = build_simulation(build_config(tiny_config(name, rounds=1)))
    record = sim.run_round().record
    assert record is not None and record["round"] == 1 and sim.round == 1
    assert record["rejected"] == 0
    assert torch.isfinite(torch.tensor([record["accuracy"], record["loss"]])).all()
    # a method that trains nothing (zero-shot, an untrained cache) sends nothing and has no training loss
    assert math.isfinite(record["train_loss"]) or record["round_bytes_up"] == 0
    assert (
        record["round_bytes_down"] == record["bytes_down"] and record["round_bytes_up"] == record["bytes_up"]
    )


@pytest.mark.parametrize("name", NAMES)
def test_hooks_do_not_mutate_their_inputs(name):
    sim = build_simulation(build_config(tiny_config(name, rounds=2)))
    sim.run_round()  # round 2 sees real prototypes, control variates, personal state ...
    rt, alg, r = sim.executor.runtime, sim.algorithm, 2
    server_print = fingerprint(sim.server)
    uploads = []
    for cid in sim.schedule[r - 1].tolist():
        state = sim.client_state(cid)
        payload = alg.broadcast(sim.server, RoundInfo(r, cid, sim.seed))
        before = fingerprint(payload), fingerprint(state)
        names = [n for n, _ in rt.models.model_for(cid).named_parameters()]
        outcome = train_client(rt, cid, r, payload, state)
        assert (fingerprint(payload), fingerprint(state)) == before, f"{name} changed its payload or state"
        assert [n for n, _ in rt.models.model_for(cid).named_parameters()] == names  # model structure
        assert outcome.upload is not None and outcome.state is not None
        uploads.append(outcome.upload)
    upload_print = fingerprint(uploads)
    new = alg.aggregate(sim.server, uploads, RoundInfo(r, None, sim.seed)).state
    assert fingerprint(sim.server) == server_print, f"{name}.aggregate mutated the server state"
    assert fingerprint(uploads) == upload_print, f"{name}.aggregate mutated the uploads"
    assert new is not sim.server or not any(u.payload.arrays for u in uploads)  # uploads change the server
    # a declared mean is consistent with the folded path by construction: a method overriding aggregate while
    # declaring mean_aggregation is refused at build (tests/test_mean_seam.py)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_resume_from_a_checkpoint_gives_the_uninterrupted_metrics(tmp_path, name):
    cfg = build_config(tiny_config(name, rounds=3))
    run_experiment(cfg, tmp_path / "whole")

    def stop_after_two(sim, record):
        if sim.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", on_round=stop_after_two)
    assert len(metrics_of(tmp_path / "cut")) == 2
    run_experiment(cfg, tmp_path / "cut", resume=True)
    assert metrics_of(tmp_path / "cut") == metrics_of(tmp_path / "whole")


def _qualifying_modes(name: str) -> list[tuple[str, dict]]:
    """Every registered executor kind the algorithm qualifies for, in this process and in workers (the
    sequential kind in this process is the reference)."""
    from fedskew.engine.modes import EXECUTORS
    from fedskew.settings import EngineSection

    modes = []
    for mode in EXECUTORS.names():
        kind = EXECUTORS.get(mode)(EngineSection())
        if kind.supports(ALGORITHMS.get(name)):
            modes.append((kind.pooled_name, {"mode": mode, "workers": 2}))
            if mode != "sequential":
                modes.append((kind.name, {"mode": mode}))
    return modes


@pytest.mark.parametrize(
    ("name", "mode", "engine"), [(n, m, e) for n in NAMES for m, e in _qualifying_modes(n)]
)
@pytest.mark.slow
def test_every_engine_mode_gives_the_sequential_numbers(name, mode, engine, caplog):
    seq = build_simulation(build_config(tiny_config(name)))
    other = build_simulation(build_config(tiny_config(name, **engine)))
    try:
        with caplog.at_level("WARNING", logger="fedskew.engine"):
            for _ in range(2):
                a, b = seq.run_round().record, other.run_round().record
                for key in ("accuracy", "loss", "train_loss"):
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7, nan_ok=True), (mode, key)
        assert other.executor.name == mode and "sequentially" not in caplog.text  # no silent fallback
        for key, value in seq.server.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert torch.allclose(value, other.server[key], rtol=1e-5, atol=1e-6), key
    finally:
        other.close()


HETERO = [n for n in NAMES if ALGORITHMS.get(n).heterogeneous_models]
#: method options a federation of different hidden widths needs: LG-FedAvg's default global layers (the
#: authors' top ones) include the hidden -> embedding layer, whose shape follows the width (refused, one line)
HETERO_PARAMS: dict[str, dict[str, Any]] = {"lgfedavg": {"global_part": "head"}}


@pytest.mark.parametrize("name", HETERO)
def test_heterogeneous_models_train_together(name):
    cfg = tiny_config(name, rounds=2)
    cfg["algorithm"].update(HETERO_PARAMS.get(name, {}))
    cfg["model"]["per_client"] = {"0-1": {"hidden": 24}, "2-3": {"hidden": 40}}
    sim = build_simulation(build_config(cfg))
    shapes = {
        tuple(sim.executor.runtime.models.model_for(c).state_dict()["body.1.weight"].shape) for c in (0, 2, 4)
    }
    assert len(shapes) == 3  # three architectures really in play
    for _ in range(2):
        record = sim.run_round().record
        assert record["rejected"] == 0
    trained = [c for c in sim.states.trained() if "weights" in sim.client_state(c)]
    assert trained and all(
        sim.client_state(c)["weights"]["body.1.weight"].shape
        == sim.executor.runtime.models.model_for(c).state_dict()["body.1.weight"].shape
        for c in trained
    )


class _ScratchWriter(Algorithm):
    """Test-only: caches into scratch lazily from the loss, which the contract forbids."""

    vectorizable = True

    def local_loss(self, step, batch):
        if "anchor" not in step.scratch:
            step.scratch["anchor"] = step.payload.model_state()
        return super().local_loss(step, batch)


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_writing_into_scratch_outside_init_scratch_fails_loudly(mode):
    with ALGORITHMS.restored():  # the test method leaves no name behind (`fedskew list` tests read them)
        ALGORITHMS.register("_scratch_writer")(_ScratchWriter)
        cfg = tiny_config("fedavg", rounds=1, mode=mode) | {"algorithm": {"name": "_scratch_writer"}}
        sim = build_simulation(build_config(cfg))
        with pytest.raises(ContractError, match="scratch is read-only outside init_scratch"):
            sim.run_round()
    assert sim.round == 0  # nothing committed
