"""DP-FedAvg against someone who reads the run's files (issue 50): the attacks, and what a DP run writes.

The adversary knows the code, the config (seed included), every metrics record, the summary, the
checkpoints and the released global models. With seed-derived noise (``privacy.randomness:
reproducible``) each attack below recovers the exact clipped sum of the round's updates, which is the
control that the attack is real; with the default secret randomness it is no closer than the noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.stats
import torch
from torch import Tensor

from fedskew.algorithms.base import RoundInfo, Upload
from fedskew.algorithms.security import accounting, robust
from fedskew.algorithms.security.config import NOT_PRIVATE
from fedskew.algorithms.security.randomness import secret_normal
from fedskew.algorithms.security.secured import DP_RELEASED, Layout
from fedskew.engine.assembly import client_data, initial_server
from fedskew.engine.client import train_client
from fedskew.engine.runtime import ClientRuntime
from fedskew.engine.sampling import client_schedule
from fedskew.errors import ConfigError
from fedskew.experiment.build import build_algorithm, build_data
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from fedskew.settings import PrivacySection
from tests.test_contract import tiny_config
from tests.test_security import hand_made

NOISE_KEY = 0xD9  # the server's noise stream of a reproducible run (fedskew.algorithms.security.secured)
Z, CLIP = 1.5, 1.0
#: every field a central DP run under the global protocol may write, each justified: the noised global
#: model's scores on the server's own test set, the accounting, the clip norm (a function of the noisy count),
#: counts fixed by the model's shape and the sample, timings
ALLOWED = {
    "round", "accuracy", "accuracy_std", "loss", "epsilon", "epsilon_rdp", "epsilon_pld", "dp_clip",
    "bytes_up", "bytes_down", "round_bytes_up", "round_bytes_down", "round_params_up", "round_params_down",
    "seconds", "seconds_train", "seconds_eval", "skipped", "dropped",
}  # fmt: skip


def dp_config(randomness: str = "secret", z: float = Z, **privacy: Any) -> dict[str, Any]:
    raw = tiny_config("fedavg", rounds=2)
    raw["client"]["fraction"] = 1.0
    raw["data"]["num_clients"] = 5
    raw["privacy"] = {"mechanism": "central", "clip": CLIP, "noise_multiplier": z, "delta": 1e-5,
                      "randomness": randomness, **privacy}  # fmt: skip
    return raw


def released(raw: dict[str, Any]) -> tuple[Tensor, Tensor, int]:
    """One round of central DP on hand-made uploads: (m · the released change, the true clipped sum, m),
    flat in the mechanism's order."""
    sim = build_simulation(build_config(raw))
    server, uploads = hand_made(sim, [0.3, -0.2, 0.5, 2.0, -1.0])
    broadcast = sim.algorithm.broadcast(server, RoundInfo(1, None, raw["seed"]))
    layout = Layout.of(uploads[0], broadcast)
    update = sim.algorithm.aggregate(server, uploads, RoundInfo(1, None, raw["seed"]))
    after = layout.deltas(
        [Upload(0, 1, sim.algorithm.broadcast(update.state, RoundInfo(2, None, raw["seed"])))]
    )
    clipped, _ = robust.clip_rows(layout.deltas(uploads), CLIP)
    m = len(uploads)
    return m * after[0].double(), clipped.sum(0).double(), m


def replayed_noise(d: int, seed: int, round_: int = 1) -> Tensor:
    """The noise a reproducible run adds in ``round_``, recomputed from the published seed."""
    return torch.randn(d, generator=RoundInfo(round_, None, seed).generator(NOISE_KEY)).double()


def test_seed_replay_recovers_the_clipped_sum_only_without_secret_noise() -> None:
    for randomness, recovered_exactly in (("reproducible", True), ("secret", False)):
        raw = dp_config(randomness)
        total, truth, _ = released(raw)
        scale = Z * 2 * CLIP * math.sqrt(truth.numel())  # the norm of the noise vector
        guess = total - Z * 2 * CLIP * replayed_noise(truth.numel(), raw["seed"])
        error = float((guess - truth).norm())
        if recovered_exactly:
            assert error < 1e-4 * scale  # the control: the attack works on seed-derived noise
        else:
            assert error > 0.5 * scale


def test_two_releases_with_different_noise_multipliers_do_not_cancel() -> None:
    """An ε sweep on one seed: z₁·R₂ − z₂·R₁ cancels a shared noise vector and leaves the clipped sum."""
    for randomness, cancels in (("reproducible", True), ("secret", False)):
        (r1, truth, _), (r2, _, _) = (
            released(dp_config(randomness, z=1.0)),
            released(dp_config(randomness, z=3.0)),
        )
        guess = (3.0 * r1 - 1.0 * r2) / (3.0 - 1.0)
        error = float((guess - truth).norm())
        assert (error < 1e-3 * float(truth.norm())) == cancels, error


def test_brute_force_over_small_seeds_finds_nothing() -> None:
    raw = dp_config("secret")
    total, truth, _ = released(raw)
    d = truth.numel()
    scale = Z * 2 * CLIP * math.sqrt(d)
    best = min(float((total - Z * 2 * CLIP * replayed_noise(d, s) - truth).norm()) for s in range(500))
    assert best > 0.5 * scale
    found = dp_config("reproducible")  # the control: the same search finds a reproducible run's seed
    found["seed"] = 123
    total, truth, _ = released(found)
    assert min(float((total - Z * 2 * CLIP * replayed_noise(d, s) - truth).norm()) for s in range(500)) < 1e-3


def test_secret_noise_is_standard_normal_and_never_repeats() -> None:
    a, b = secret_normal(200_000, torch.float64), secret_normal(200_000, torch.float64)
    assert scipy.stats.kstest(a.numpy(), "norm").pvalue > 1e-6
    assert abs(float(a.mean())) < 0.02 and abs(float(a.std()) - 1.0) < 0.02
    assert not torch.equal(a, b)


def test_the_client_sample_of_a_dp_run_is_secret_and_otherwise_paired() -> None:
    secret = PrivacySection(mechanism="central", noise_multiplier=1.0, delta=1e-5)
    reproducible = secret.model_copy(update={"randomness": "reproducible"})
    none = PrivacySection()
    draw = [np.stack(client_schedule(100, 0.1, 20, 7, secret)) for _ in range(2)]
    assert not np.array_equal(*draw)
    assert all(len(set(row.tolist())) == 10 for row in draw[0])  # without replacement
    assert np.array_equal(
        client_schedule(100, 0.1, 20, 7, reproducible), client_schedule(100, 0.1, 20, 7, none)
    )
    poisson = secret.model_copy(update={"sampling": "poisson", "adjacency": "add_remove"})
    sizes = [len(row) for row in client_schedule(1000, 0.1, 50, 7, poisson)]
    assert 80 < np.mean(sizes) < 120 and len(set(sizes)) > 1  # each client with q = 0.1


def test_two_runs_with_one_config_release_different_models(tmp_path: Path) -> None:
    raw = dp_config("secret")
    first = run_experiment(build_config(raw), tmp_path / "a")
    second = run_experiment(build_config(raw), tmp_path / "b")
    assert first["final"]["loss"] != second["final"]["loss"]
    again = [run_experiment(build_config(dp_config("reproducible")), tmp_path / k) for k in ("c", "d")]
    assert again[0]["final"] == again[1]["final"]


def test_a_reproducible_run_says_it_is_not_private(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    summary = run_experiment(build_config(dp_config("reproducible")), tmp_path)
    assert summary["privacy"]["guarantee"] == NOT_PRIVATE and "epsilon" not in summary["final"]
    assert "not private" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("epsilon" not in r for r in records)


def test_a_dp_run_writes_nothing_unnoised_about_client_data(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every field of every record against the allow-list; the summary holds only those and the accounting."""
    raw = dp_config("secret", adaptive={"count_noise": 2.0})
    raw["data"]["val_fraction"] = 0.2  # validation scores on client samples: withheld
    caplog.set_level("INFO")
    summary = run_experiment(build_config(raw), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in records for k in r}
    assert keys <= ALLOWED, keys - ALLOWED
    assert {"train_loss", "dp_unclipped", "val_accuracy"}.isdisjoint(keys) and "withheld" in caplog.text
    assert set(summary["final"]) <= ALLOWED and "best_val" not in summary
    assert DP_RELEASED <= ALLOWED  # the code's list holds nothing this one refuses
    # the rest of summary.json: the run's settings, its size and times, and the accounting
    assert set(summary) == {
        "final", "rounds", "wall_seconds", "bytes_up", "bytes_down", "seconds", "algorithm", "dataset",
        "model", "seed", "protocol", "skipped_rounds", "version", "privacy", "status",
        "rounds_without_update", "nonfinite_rounds", "provenance",
    }  # fmt: skip
    privacy = summary["privacy"]
    assert set(privacy) == {"mechanism", "randomness", "sampling", "adjacency", "accountant", "delta",
                            "noise_multiplier", "clip", "guarantee", "epsilon_rdp", "rdp_note", "epsilon_pld",
                            "pld_note"}  # fmt: skip
    assert privacy["adjacency"] == "replace_one" and privacy["guarantee"].startswith("(")
    assert privacy["epsilon_rdp"] == pytest.approx(summary["final"]["epsilon"])


def test_resume_keeps_the_committed_rounds_and_draws_fresh_noise_after(tmp_path: Path) -> None:
    raw = dp_config("secret")
    raw["rounds"] = 4

    def stop_after_two(sim: Any, record: Any) -> None:
        if sim.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(raw), tmp_path, on_round=stop_after_two)
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(kept) == 2
    run_experiment(build_config(raw), tmp_path, resume=True)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == kept and len(lines) == 4
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert not any("generator" in str(k) or "noise" in str(k) for k in checkpoint)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": {"name": "fednova"}}, "aggregates per-client scalars"),
        ({"eval": {"protocol": "personalized", "every": 1}}, "eval.protocol=personalized"),
        ({"privacy": {"adjacency": "add_remove"}}, "privacy.accountant=rdp"),
    ],
)
def test_what_would_leak_is_refused_in_one_line(change: dict[str, Any], message: str) -> None:
    raw = dp_config()
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if key == "privacy" else value
    with pytest.raises(ConfigError, match=message) as err:
        build_config(raw)
    assert "\n" not in str(err.value)


def test_local_dp_uploads_carry_no_sample_count_loss_or_scalars() -> None:
    """What a node sends an untrusted server (``train_client`` is what a Flower node runs): the noised
    arrays, a count of 1, no loss, no method scalars."""
    raw = dp_config()
    raw["privacy"]["mechanism"] = "local"
    cfg = build_config(raw)
    data = build_data(cfg)
    algorithm, models = build_algorithm(cfg, data)
    rt = ClientRuntime(algorithm, client_data(data, models.device), models, cfg.client, cfg.seed, cfg.rounds,
                       models.device)  # fmt: skip
    server = initial_server(algorithm, models, cfg.seed)
    out = train_client(rt, 0, 1, algorithm.broadcast(server, RoundInfo(1, 0, cfg.seed)), rt.initial_state(0))
    assert out.upload is not None and out.upload.num_samples == 1 and math.isnan(out.loss)
    assert not out.upload.payload.metrics and not out.upload.payload.config


def test_add_remove_adjacency_adds_noise_in_units_of_c() -> None:
    """Sensitivity C (one client added or removed), not 2C: the replayed noise of a reproducible run at
    z·C recovers the clipped sum exactly."""
    raw = dp_config("reproducible", sampling="poisson", adjacency="add_remove", accountant="pld")
    total, truth, _ = released(raw)
    guess = total - Z * 1 * CLIP * replayed_noise(truth.numel(), raw["seed"])
    assert float((guess - truth).norm()) < 1e-4 * Z * CLIP * math.sqrt(truth.numel())


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_poisson_run_reports_pld_beside_rdp(tmp_path: Path, mode: str) -> None:
    raw = dp_config("secret", sampling="poisson", adjacency="add_remove", accountant="pld")
    raw["client"]["fraction"] = 0.6  # q = 3/5
    raw["engine"] = {**raw.get("engine", {}), "mode": mode}
    summary = run_experiment(build_config(raw), tmp_path)
    privacy = summary["privacy"]
    want = accounting.epsilon(5, 3, Z, 2, 1e-5, accountant="pld", sampling="poisson", adjacency="add_remove")
    assert privacy["epsilon_pld"] == pytest.approx(want, rel=1e-6)
    # the per-round curve composes round by round, the summary's value all rounds at once; secret Poisson
    # sampling may draw nobody in the last round (0.4^5 ≈ 1%), which is then skipped and records no ε
    if 2 not in summary["skipped_rounds"]:
        assert summary["final"]["epsilon"] == pytest.approx(want, rel=1e-6)
    assert privacy["epsilon_pld"] < privacy["epsilon_rdp"] and "add" in privacy["pld_note"]


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["local", "central"])
def test_dp_flower_replies_carry_no_client_statistics(tmp_path: Path, mechanism: str) -> None:
    """Every train reply a node sends the server of a DP run, field by field: the arrays (noised under local
    DP; clipped and noised by the trusted server under central DP), a count of 1, no loss, no scalars."""
    pytest.importorskip("flwr")
    from tests.flower_loopback import LoopbackGrid
    from tests.test_flower import on_flower

    raw = dp_config()
    raw["privacy"]["mechanism"] = mechanism
    raw["engine"] = {**raw.get("engine", {}), "nodes": 2}
    grid, seen = LoopbackGrid(2), []

    def record(reply: Any) -> Any:  # the loopback grid's hook on every reply; passes it on unchanged
        seen.append(reply)
        return reply

    grid.faults = {0: record, 1: record}
    on_flower(raw, tmp_path, grid)
    trains = [m.content for m in seen if m.metadata.message_type == "train" and m.has_content()]
    assert trains
    for content in trains:
        job = dict(content.config_records["job"])
        assert set(job["samples"]) == {1} and all(math.isnan(v) for v in job["loss"])
        payload_keys = [k for k in content.config_records if k != "job"] + list(content.metric_records)
        assert all(not (content.config_records.get(k) or content.metric_records.get(k)) for k in payload_keys)
        timing = {k for k in job if k.startswith(("seconds", "time_"))}  # the node's clock, not its data
        assert set(job) - timing == {"accepted", "loss", "samples"}
