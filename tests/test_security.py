"""Attacks, robust aggregation and client-level DP around the algorithms: each attack's effect on a tiny
case, the secured aggregation on hand-made uploads (adversarial ones included), DP clipping bounding every
upload and ε equal to the accountant's, the contract's rules, engine modes and Flower with a robust rule and
with DP on, and one-line errors for bad settings."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from fedskew.algorithms.base import RoundInfo, Upload
from fedskew.algorithms.security import accounting, attacks
from fedskew.algorithms.security.secured import CLIP_KEY, secured
from fedskew.errors import ConfigError
from fedskew.experiment import build
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from fedskew.testing import checked, fingerprint
from tests.test_contract import tiny_config

#: settings every suite below runs (robust rules under a model-poisoning attack, DP, data poisoning)
SETTINGS: dict[str, dict[str, Any]] = {
    "krum": {"attack": {"name": "sign_flip", "clients": [1]},
             "defence": {"name": "multi_krum", "byzantine_fraction": 0.15}},
    "median": {"attack": {"name": "alie", "clients": [1, 4]},
               "defence": {"name": "median", "byzantine_fraction": 0.25}},
    # seed-derived noise (not private): these suites compare runs bit for bit (resume, engine modes); the
    # secret default is attacked in tests/test_dp_secret.py
    "dp": {"privacy": {"mechanism": "central", "clip": 0.5, "noise_multiplier": 0.3, "delta": 1e-5,
                       "adaptive": {"count_noise": 2.0}, "randomness": "reproducible"}},
    "dp_local": {"privacy": {"mechanism": "local", "clip": 0.5, "noise_multiplier": 0.05, "delta": 1e-5,
                             "randomness": "reproducible"}},
    "backdoor": {"attack": {"name": "backdoor", "clients": [0, 3], "trigger_size": 2}},
}  # fmt: skip
ALGORITHMS_UNDER_TEST = ("fedavg", "scaffold", "fedadam")


def secured_config(name: str, setting: str, rounds: int = 2, **engine: Any) -> dict[str, Any]:
    cfg = tiny_config(name, rounds=rounds, **engine)
    cfg["client"]["fraction"] = 1.0  # 6 clients a round: multi-Krum assumes f = ⌈0.15 · 6⌉ = 1, m >= 2f + 3
    cfg.update(SETTINGS[setting])
    return cfg


# ---------------------------------------------------------------------------- attacks on tiny cases
def test_label_flipping_and_the_backdoor_touch_only_malicious_batches() -> None:
    y = torch.tensor([0, 3, 9])
    assert attacks.flip_labels(y, 10, torch.tensor(1.0)).tolist() == [9, 6, 0]
    assert attacks.flip_labels(y, 10, torch.tensor(0.0)).tolist() == [0, 3, 9]
    x = torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).view(2, 1, 3, 3)
    px, py = attacks.poison_batch(x, torch.tensor([4, 5]), torch.tensor(1.0), target=7, size=2, share=0.5)
    assert py.tolist() == [7, 5]  # ⌈0.5 · 2⌉ = 1 sample poisoned
    assert px[0, 0, 1:, 1:].eq(17.0).all() and px[0, 0, 0].eq(x[0, 0, 0]).all()  # the batch maximum, 2×2
    assert torch.equal(px[1], x[1])
    hx, hy = attacks.poison_batch(x, torch.tensor([4, 5]), torch.tensor(0.0), target=7, size=2, share=0.5)
    assert torch.equal(hx, x) and hy.tolist() == [4, 5]


def test_update_attacks_on_a_tiny_case() -> None:
    delta = torch.tensor([1.0, -2.0])
    assert attacks.sign_flip(delta, 2.0).tolist() == [-2.0, 4.0]
    assert attacks.scale_update(delta, 10.0).tolist() == [10.0, -20.0]
    noise = attacks.gaussian_update(delta, 3.0, torch.Generator().manual_seed(0))
    assert torch.equal(noise, 3.0 * torch.randn(2, generator=torch.Generator().manual_seed(0)))
    # ALIE (Baruch et al. 2019): n = 10, f = 3 → s = ⌊6⌋ − 3 = 3, z = Φ⁻¹(7/10) = 0.5244
    assert attacks.alie_z(10, 3) == pytest.approx(0.5244005, abs=1e-6)
    honest = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # μ = (2, 0), σ = (1, 0)
    assert attacks.alie(honest, 0.5).tolist() == [1.5, 0.0]


# ---------------------------------------------------------------------------- the secured aggregation
def hand_made(sim: Any, deltas: list[float]) -> tuple[dict[str, Any], list[Upload]]:
    """Uploads whose every model value is the global one plus ``deltas[k]`` (client k, 10 samples each)."""
    server = sim.server
    weights = server["weights"]
    uploads = []
    for k, d in enumerate(deltas):
        arrays = {f"model.{n}": (w + d if w.is_floating_point() else w) for n, w in weights.items()}
        payload = sim.algorithm.broadcast(server, RoundInfo(1, k, 0))
        extra = {n: torch.zeros_like(v) for n, v in payload.arrays.items() if not n.startswith("model.")}
        uploads.append(Upload(k, 10, type(payload)(arrays={**arrays, **extra})))
    return server, uploads


def aggregate(raw: dict[str, Any], deltas: list[float]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The global model's change (one entry, flat) after aggregating hand-made uploads; checks purity."""
    sim = build_simulation(build_config(raw))
    server, uploads = hand_made(sim, deltas)
    before = fingerprint((server, uploads))
    update = sim.algorithm.aggregate(server, uploads, RoundInfo(1, None, raw["seed"]))
    assert fingerprint((server, uploads)) == before  # hooks never change what they were handed
    name = next(n for n, w in server["weights"].items() if w.is_floating_point())
    return (update.state["weights"][name] - server["weights"][name]).flatten(), dict(update.metrics)


@pytest.mark.parametrize(
    ("defence", "expected"),
    [
        ({"name": "median"}, 3.0),  # of 1, 2, 3, 4, 100
        ({"name": "trimmed_mean", "beta": 0.2}, 3.0),  # 2, 3, 4
        # Krum scores with f = 1 (2 neighbours): 5, 2, 2, 5, ~1e4: keeps 2, 3 and 1 (the tie with 4 goes
        # to the lower index), whose mean is 2
        ({"name": "multi_krum", "byzantine_fraction": 0.2, "select": 3}, 2.0),
        ({"name": "geomed", "max_iter": 500}, 3.0),
        ({"name": "mean"}, 22.0),  # the method's own mean: dragged by the outlier
    ],
)
def test_robust_rules_on_hand_made_uploads(defence: dict[str, Any], expected: float) -> None:
    raw = tiny_config("fedavg")
    raw["client"]["fraction"] = 1.0
    raw["data"]["num_clients"] = 5
    raw["defence"] = defence
    change, _ = aggregate(raw, [1.0, 2.0, 3.0, 4.0, 100.0])
    assert change.mean().item() == pytest.approx(expected, abs=2e-3 if defence["name"] == "geomed" else 1e-5)


def test_sign_flipping_clients_are_flipped_before_the_rule() -> None:
    raw = tiny_config("fedavg")
    raw["client"]["fraction"] = 1.0
    raw["data"]["num_clients"] = 5
    raw["attack"] = {"name": "sign_flip", "clients": [4], "scale": 1.0}
    change, _ = aggregate(raw, [1.0, 1.0, 1.0, 1.0, 1.0])
    assert change.mean().item() == pytest.approx(0.6, abs=1e-6)  # (4 · 1 − 1) / 5


def test_central_dp_clips_every_update_and_adds_calibrated_noise() -> None:
    raw = tiny_config("fedavg")
    raw["client"]["fraction"] = 1.0
    raw["data"]["num_clients"] = 5
    raw["privacy"] = {"mechanism": "central", "clip": 1.0, "noise_multiplier": 0.0, "delta": 1e-5}
    sim = build_simulation(build_config(raw))
    d = sum(w.numel() for w in sim.server["weights"].values() if w.is_floating_point())
    per_value = 0.5 / d**0.5  # an update of norm 0.5 (inside C) or 100× that (clipped to norm C = 1)
    change, metrics = aggregate(raw, [per_value, per_value, per_value, 100 * per_value, -100 * per_value])
    expected = (3 * 0.5 + 1.0 - 1.0) / 5 / d**0.5  # Σ clip(Δ_k) / m, every clipped norm ≤ C
    assert change.mean().item() == pytest.approx(expected, rel=1e-5)
    assert metrics["dp_unclipped"] == pytest.approx(3 / 5)
    raw["privacy"]["noise_multiplier"] = 2.0  # noise std on the mean: z · 2C / m = 0.8
    noisy, _ = aggregate(raw, [0.0] * 5)
    assert noisy.std().item() == pytest.approx(0.8, rel=0.1)


def test_adaptive_clipping_moves_the_norm_toward_the_quantile() -> None:
    raw = tiny_config("fedavg", rounds=1)
    raw["client"]["fraction"] = 1.0
    raw["privacy"] = {"mechanism": "central", "clip": 1e-4, "noise_multiplier": 0.1, "delta": 1e-5,
                      "adaptive": {"quantile": 0.5, "lr": 0.2, "count_noise": 0.5}}  # fmt: skip
    sim = build_simulation(build_config(raw))
    sim.run_round()
    # every update is far beyond 1e-4: b̃ ≈ 0, C ← C · e^{−0.2 (b̃ − 0.5)} grows by about e^{0.1}
    assert float(sim.server[CLIP_KEY]) == pytest.approx(1e-4 * 2.718281828**0.1, rel=0.2)


def test_epsilon_of_a_run_equals_the_accountants() -> None:
    raw = tiny_config("fedavg", rounds=3)
    raw["privacy"] = {"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.1, "delta": 1e-5}
    summary = run_experiment(build_config(raw))
    m = round(raw["client"]["fraction"] * raw["data"]["num_clients"])
    assert summary["final"]["epsilon"] == accounting.epsilon(6, m, 1.1, 3, 1e-5)
    target = dict(raw, privacy={**raw["privacy"], "noise_multiplier": None, "target_epsilon": 5.0})
    plan = build.security_of(build_config(target), 10)
    assert plan.epsilons[-1] <= 5.0 and plan.noise == accounting.noise_for_epsilon(5.0, 1e-5, 6, m, 3)


# ---------------------------------------------------------------------------- the suites, secured
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_secured_client_hooks_keep_the_contract(
    setting: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "secured", lambda cls, plan: checked(secured(cls, plan)))
    sim = build_simulation(build_config(secured_config("fedavg", setting, mode=mode)))
    for _ in range(2):
        record = sim.run_round().record
        assert record is not None
        # a DP run withholds the rejected count (a statistic of client data, docs/security.md)
        assert "rejected" not in record if setting.startswith("dp") else record["rejected"] == 0
    assert sim.executor.name == mode


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ALGORITHMS_UNDER_TEST)
def test_secured_runs_resume_exactly_and_agree_across_modes(setting: str, name: str, tmp_path: Any) -> None:
    from tests.test_contract import metrics_of

    cfg = build_config(secured_config(name, setting, rounds=3))
    run_experiment(cfg, tmp_path / "whole")

    def stop_after_two(sim: Any, record: Any) -> None:
        if sim.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", on_round=stop_after_two)
    run_experiment(cfg, tmp_path / "cut", resume=True)
    assert metrics_of(tmp_path / "cut") == metrics_of(tmp_path / "whole")
    seq = build_simulation(cfg)
    vec = build_simulation(build_config(secured_config(name, setting, rounds=3, mode="vectorized")))
    for _ in range(2):
        a, b = seq.run_round().record, vec.run_round().record
        for key in ("accuracy", "loss", "train_loss", "epsilon", "attack_success_rate"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7, nan_ok=True), key
        assert a.keys() == b.keys()


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["krum", "dp", "backdoor"])
def test_secured_runs_agree_on_flower(setting: str, tmp_path: Any) -> None:
    pytest.importorskip("flwr")
    from tests.flower_loopback import LoopbackGrid
    from tests.test_flower import assert_same_metrics, embedded, on_flower

    raw = secured_config("fedavg", setting)
    raw["name"] = f"secured-{setting}"
    raw["engine"]["nodes"] = 3
    here = embedded(raw, tmp_path / "embedded")
    there = on_flower(raw, tmp_path / "flower", LoopbackGrid(3))
    assert_same_metrics(here, there)
    key = {"dp": "dp_clip", "backdoor": "attack_success_rate", "krum": "defence_selected"}[setting]
    assert [r[key] for r in here] == [r[key] for r in there]


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"defence": {"name": "krum", "byzantine_fraction": 0.5}}, "krum tolerates less than 0.5"),
        ({"defence": {"name": "bulyan", "byzantine_fraction": 0.3}}, "needs clients per round m >= 4f + 3"),
        ({"privacy": {"mechanism": "central", "noise_multiplier": 1.0}}, "privacy.delta=None: give δ"),
        ({"privacy": {"mechanism": "central", "clip": 0, "noise_multiplier": 1.0, "delta": 1e-5}},
         "privacy.clip=0.0"),
        ({"privacy": {"mechanism": "local", "noise_multiplier": 1, "delta": 1e-5, "adaptive": {}}},
         "needs privacy.mechanism=central"),
        ({"attack": {"name": "sign_flip"}}, "give attack.fraction in (0, 1] or attack.clients"),
        ({"defence": {"name": "median"}, "algorithm": {"name": "fedproto"},
          "eval": {"protocol": "personalized"}},
         "algorithm 'fedproto' does not aggregate a mean"),
    ],
)  # fmt: skip
def test_bad_security_settings_are_one_line_errors(section: dict[str, Any], message: str) -> None:
    raw = tiny_config("fedavg")
    raw.update(section)
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_bad_security_settings_exit_2_on_the_cli(tmp_path: Any) -> None:
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config("fedavg")))
    for overrides in (
        ["defence.name=krum", "defence.byzantine_fraction=0.6"],
        ["privacy.mechanism=central", "privacy.noise_multiplier=1"],  # no δ
        ["privacy.mechanism=central", "privacy.noise_multiplier=1", "privacy.delta=1e-5", "privacy.clip=-1"],
    ):
        sets = [arg for o in overrides for arg in ("--set", o)]
        res = subprocess.run(
            [sys.executable, "-m", "fedskew.cli", "run", str(config), *sets, "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
