"""summary.json's ``compute`` (issue 52): client steps and samples, declared extra and evaluation-time work,
hand-checked on tiny digits federations, equal across engine modes and runtimes, and across a resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms import finetune as finetune_module
from fedskew.algorithms.base import Algorithm, Payload, RoundInfo
from fedskew.algorithms.work import DeclaresEvalWork, Work, epochs_work
from fedskew.engine.replies import check_reply
from fedskew.errors import FedskewError
from fedskew.experiment.build import build_data
from fedskew.experiment.config import build_config
from fedskew.experiment.report import find_runs, group_runs
from fedskew.experiment.report_tables import markdown_table
from fedskew.experiment.runner import run_experiment
from fedskew.update_rules import SGD
from tests.conftest import digits_config

B, E, R = 16, 2, 2


def config(name: str = "fedavg", **over: Any) -> dict[str, Any]:
    """4 IID digits clients, every client every round, batch B, E epochs, R rounds, evaluated each round."""
    cfg = digits_config(
        rounds=R,
        algorithm={"name": name},
        data={"dataset": "digits", "num_clients": 4, "partition": {"name": "iid"}},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        client={"epochs": E, "batch_size": B, "lr": 0.05, "momentum": 0.5, "fraction": 1.0},
        engine={"mode": "sequential", "workers": 1},
        checkpoint={"every": 1},
    )
    if ALGORITHMS.get(name).personalized_eval:
        cfg["eval"] = {"protocol": "personalized", "every": 1}
    cfg.update(over)
    return cfg


def compute_of(raw: dict[str, Any], out: Path, **kw: Any) -> dict[str, Any]:
    return run_experiment(build_config(raw), out, **kw)["compute"]


def batches(n: int, b: int) -> int:
    """The engine's rule written out: ceil(n / b) batches, less a trailing batch of one sample (b > 1)."""
    return math.ceil(n / b) - (1 if b > 1 and n % b == 1 else 0)


def sizes(raw: dict[str, Any]) -> list[int]:
    return [int(i.numel()) for i in build_data(build_config(raw)).train_idx]


def test_client_steps_and_samples_are_the_hand_count(tmp_path):
    raw = config()
    n = sizes(raw)
    got = compute_of(raw, tmp_path)
    assert got["client_steps"] == R * E * sum(batches(k, B) for k in n)
    assert got["client_samples"] == R * E * sum(k - (k % B == 1) for k in n)
    assert got["eval_finetune_steps"] == 0 and got["extra"] == {} and got["evaluations"] == R
    assert got["total_steps"] == got["client_steps"]


def test_the_engine_drops_a_trailing_single_sample_batch_and_counts_so():
    assert epochs_work(3, 33, 16) == Work(3 * 2, 3 * 32)  # 16 + 16, the 33rd sample dropped
    assert epochs_work(1, 34, 16) == Work(3, 34) and epochs_work(1, 1, 16) == Work(1, 1)
    assert epochs_work(2, 0, 16) == Work()


def test_fedavg_ft_counts_its_evaluation_fine_tuning_as_it_runs(tmp_path, monkeypatch):
    """Declared = hand count = the SGD updates the fine-tuning really makes (a counting update rule)."""
    made = []

    class Counting(SGD):
        def step(self) -> None:
            made.append(1)
            super().step()

    monkeypatch.setattr(finetune_module, "SGD", Counting)
    e = 3
    raw = config("fedavg_ft", algorithm={"name": "fedavg_ft", "finetune_epochs": e})
    n = sizes(raw)
    got = compute_of(raw, tmp_path)
    assert got["eval_finetune_steps"] == R * e * sum(batches(k, B) for k in n)  # every client has test data
    assert got["eval_finetune_steps"] == len(made)
    assert got["total_steps"] == got["client_steps"] + got["eval_finetune_steps"]


def test_a_stale_fine_tuning_is_extra_work_of_the_round_not_evaluation_work(tmp_path):
    raw = config("fedavg_ft", algorithm={"name": "fedavg_ft", "finetune_epochs": 1, "eval_finetune": "stale"})
    n = sizes(raw)
    got = compute_of(raw, tmp_path)
    assert got["eval_finetune_steps"] == 0
    assert got["extra"] == {
        "stale_finetune": {"steps": R * sum(batches(k, B) for k in n), "samples": R * sum(n)}
    }


def test_per_fedavg_takes_one_test_time_step_per_client_and_evaluation(tmp_path):
    got = compute_of(config("perfedavg"), tmp_path)
    assert (got["eval_finetune_steps"], got["eval_finetune_samples"]) == (R * 4, R * 4 * B)


@pytest.mark.parametrize("name", ["fedrep", "ditto", "pfedme"])
def test_a_method_with_extra_local_work_counts_more_than_fedavg(name, tmp_path):
    """Adversarial: extra epochs inside the loop (FedRep's head epochs, Ditto's personal model) are client
    steps; pFedMe's K inner steps per batch, outside it, are named extra work."""
    fedavg = compute_of(config(), tmp_path / "fedavg")
    raw = config(name)
    if name == "pfedme":
        raw["eval"] = {"protocol": "global", "every": 1}
    got = compute_of(raw, tmp_path / name)
    assert got["total_steps"] > fedavg["total_steps"]
    if name == "pfedme":
        k = ALGORITHMS.get("pfedme").Params().K
        assert got["client_steps"] == fedavg["client_steps"]
        assert got["extra"]["inner_steps"]["steps"] == k * got["client_steps"]
    elif name == "ditto":  # default: both copies stepped on the same batches, one update of both
        assert got["client_steps"] == fedavg["client_steps"]
        assert got["extra"]["personal_model"]["steps"] == got["client_steps"]
    else:
        assert got["client_steps"] > fedavg["client_steps"]


def test_ditto_personal_epochs_beyond_the_global_ones_are_loop_steps(tmp_path):
    raw = config("ditto", algorithm={"name": "ditto", "personal_epochs": E + 1})
    n = sizes(raw)
    got = compute_of(raw, tmp_path)
    assert got["client_steps"] == R * (E + 1) * sum(batches(k, B) for k in n)
    assert got["extra"]["personal_model"]["steps"] == R * E * sum(batches(k, B) for k in n)


def test_every_method_that_adapts_at_evaluation_declares_its_work():
    """A method that trains in adapt_for_eval without declaring it would report no evaluation work."""
    adapting = [
        n for n in ALGORITHMS.names() if ALGORITHMS.get(n).adapt_for_eval is not Algorithm.adapt_for_eval
    ]
    assert {"fedavg_ft", "fedbabu", "perfedavg"} <= set(adapting)
    assert [n for n in adapting if not issubclass(ALGORITHMS.get(n), DeclaresEvalWork)] == []


@pytest.mark.parametrize(("mode", "workers"), [("vectorized", 1), ("sequential", 2)])
def test_engine_modes_report_the_same_compute(mode, workers, tmp_path):
    raw = config("fedavg_ft", algorithm={"name": "fedavg_ft", "finetune_epochs": 1})
    want = compute_of(raw, tmp_path / "sequential")
    got = compute_of({**raw, "engine": {"mode": mode, "workers": workers}}, tmp_path / f"{mode}{workers}")
    assert got == want


def test_flower_simulation_reports_the_embedded_compute(tmp_path):
    pytest.importorskip("flwr")
    from fedskew.flower.server import serve
    from tests.flower_loopback import LoopbackGrid

    raw = config("fedavg_ft", algorithm={"name": "fedavg_ft", "finetune_epochs": 1})
    raw["engine"] = {**raw["engine"], "nodes": 2}
    want = compute_of({**raw, "engine": {**raw["engine"], "runtime": "embedded"}}, tmp_path / "e")
    cfg = build_config({**raw, "engine": {**raw["engine"], "runtime": "flower-simulation"}})
    serve(LoopbackGrid(2), cfg, tmp_path / "f", resume=False, force=False)
    assert json.loads((tmp_path / "f" / "summary.json").read_text())["compute"] == want


def test_a_resumed_run_reports_the_uninterrupted_compute(tmp_path):
    raw = config("fedavg_ft", algorithm={"name": "fedavg_ft", "finetune_epochs": 1}, rounds=3)
    want = compute_of(raw, tmp_path / "whole")

    def stop(sim: Any, record: Any) -> None:
        if sim.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(raw), tmp_path / "cut", on_round=stop)
    assert compute_of(raw, tmp_path / "cut", resume=True) == want


def test_a_checkpoint_with_a_forged_compute_entry_is_one_line(tmp_path):
    """Adversarial: the digest passes (anyone can recompute it) but a negative count is refused."""
    from fedskew.experiment.results import CHECKPOINT_FILE, DIGEST_KEY, tree_digest

    raw = config()
    out = tmp_path / "run"
    run_experiment(build_config({**raw, "rounds": 1}), out)
    path = out / CHECKPOINT_FILE
    sd = torch.load(path, weights_only=True)
    sd["compute"]["client"] = [-5, 0]
    sd[DIGEST_KEY] = tree_digest(sd)
    torch.save(sd, path)
    with pytest.raises(FedskewError, match="layout fedskew writes") as err:
        run_experiment(build_config(raw), out, resume=True)
    assert "\n" not in str(err.value)


def test_a_node_reply_with_forged_step_counts_is_refused():
    """Adversarial: a node's steps are a diagnostic the server cannot verify, but it must be counts."""
    raw = config()
    cfg = build_config(raw)
    from fedskew.experiment.build import build_algorithm

    alg, _ = build_algorithm(cfg, build_data(cfg))
    n0 = int(alg.ctx.client_sizes[0])
    job = {"accepted": [0], "loss": [0.5], "samples": [n0], "steps": [-3], "passes": [10]}
    payload = Payload(arrays={"x": torch.zeros(1)})
    checked = check_reply(alg, RoundInfo(1, None, 0), [0], job, lambda c: payload, {0: payload})
    assert "steps" in checked.refused[0] and not checked.accepted
    job = {**job, "steps": [3, 4]}
    assert (
        "one entry per accepted client"
        in check_reply(alg, RoundInfo(1, None, 0), [0], job, lambda c: payload, {0: payload}).refused[0]
    )


def test_the_report_table_shows_client_and_fine_tuning_steps(tmp_path):
    compute_of(config(), tmp_path / "runs" / "a")
    compute_of(
        config("fedavg_ft", algorithm={"name": "fedavg_ft", "finetune_epochs": 1}), tmp_path / "runs" / "b"
    )
    table = markdown_table(group_runs(find_runs([tmp_path / "runs"])))
    header = table.splitlines()[0]
    assert header.endswith("| client steps | eval fine-tune steps |")
    summaries = {
        json.loads((tmp_path / "runs" / k / "summary.json").read_text())["algorithm"]: k for k in ("a", "b")
    }
    ft = json.loads((tmp_path / "runs" / summaries["fedavg_ft"] / "summary.json").read_text())["compute"]
    row = next(line for line in table.splitlines() if line.startswith("| fedavg_ft "))
    assert row.endswith(f"| {ft['client_steps']} | {ft['eval_finetune_steps']} |")
