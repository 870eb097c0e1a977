"""CacheFL's α/β grid search (Tip-Adapter's grid, validation split only) and ``fedskew features`` files."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedskew.errors import ConfigError
from fedskew.experiment.cachefl_tools import (
    export_features,
    grid_accuracy,
    search_alpha_beta,
    tip_adapter_grid,
)
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data


def digits_vl(**data) -> dict:
    return {
        "data": {
            "dataset": "digits",
            "num_clients": 3,
            "partition": {"name": "iid"},
            "train_limit": 90,
            "vision_language": {
                "backbone": {"name": "random_cnn", "options": {"embed_dim": 12}},
                "generator": {"name": "procedural"},
                "shots": 2,
                "cache": False,
            },
            **data,
        },
        "model": {"name": "identity"},
        "algorithm": {"name": "cachefl"},
        "rounds": 2,
    }


def test_the_grid_is_tip_adapters():
    alphas, betas = tip_adapter_grid(alpha_max=2.1, beta_max=20.1)
    assert len(alphas) == 20 and len(betas) == 200
    assert alphas[0] == pytest.approx(0.1) and alphas[1] == pytest.approx(0.2) and alphas[-1] < 2.1
    assert betas[0] == pytest.approx(0.1) and betas[1] == pytest.approx(0.2)


def test_grid_accuracy_is_the_accuracy_of_eq7_at_each_point():
    g = torch.Generator().manual_seed(0)
    f, text = (
        F.normalize(torch.randn(30, 8, generator=g), dim=1),
        F.normalize(torch.randn(3, 8, generator=g), dim=1),
    )
    keys, labels = F.normalize(torch.randn(6, 8, generator=g), dim=1), torch.tensor([0, 0, 1, 1, 2, 2])
    y = torch.randint(0, 3, (30,), generator=g)
    alphas, betas = (
        torch.tensor([0.0, 1.0, 50.0], dtype=torch.float64),
        torch.tensor([0.5, 4.0], dtype=torch.float64),
    )
    acc = grid_accuracy(f, y, text, keys, labels, alphas, betas, 100.0)
    for i, b in enumerate(betas.tolist()):
        for j, a in enumerate(alphas.tolist()):
            logits = 100 * f @ text.T + a * torch.exp(-b * (1 - f @ keys.T)) @ F.one_hot(labels, 3).float()
            assert acc[i, j] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert acc[0, 0] == acc[1, 0]  # α = 0: zero-shot whatever β


def test_the_search_uses_a_validation_split_and_refuses_without_one():
    with pytest.raises(ConfigError, match="val_fraction"):
        search_alpha_beta(build_config(digits_vl()))
    result = search_alpha_beta(build_config(digits_vl(val_fraction=0.3)), alpha_max=3.0, beta_max=5.0)
    alphas, betas = tip_adapter_grid(3.0, 5.0)
    assert any(abs(result["alpha"] - a) < 1e-5 for a in alphas.tolist())
    assert any(abs(result["beta"] - b) < 1e-5 for b in betas.tolist())
    assert result["val_samples"] > 0 and 0.0 <= result["val_accuracy"] <= 1.0


def test_the_search_accepts_a_few_shot_validation_split():
    cfg = digits_vl(shots=4, val_shots=2)
    del cfg["data"]["train_limit"]
    result = search_alpha_beta(build_config(cfg), alpha_max=3.0, beta_max=5.0)
    # at most val_shots per class x the 10 digit classes (dealt like each client's training mix)
    assert 0 < result["val_samples"] <= 2 * 10 and 0.0 <= result["val_accuracy"] <= 1.0


def test_exported_features_reload_through_the_features_backbone(tmp_path):
    cfg = build_config(digits_vl())
    path = export_features(cfg, tmp_path / "digits.pt")
    direct = build_data(cfg).dataset
    reloaded_cfg = digits_vl()
    reloaded_cfg["data"]["vision_language"]["backbone"] = {"name": "features", "options": {"path": str(path)}}
    reloaded = build_data(build_config(reloaded_cfg)).dataset
    assert torch.allclose(reloaded.x_test, direct.x_test, atol=1e-6)
    assert torch.allclose(reloaded.x_train, direct.x_train, atol=1e-6)
    for key in ("cache_x", "text"):
        assert torch.allclose(reloaded.meta["assets"][key], direct.meta["assets"][key], atol=1e-6)


def finished_run(tmp_path, algorithm: dict, **data):
    from fedskew.experiment.runner import run_experiment

    raw = digits_vl(val_fraction=0.3, **data)
    raw["algorithm"] = algorithm
    raw["client"] = {"lr": 0.5, "batch_size": 8}
    out = tmp_path / "runs" / "name" / "seed0"
    run_experiment(build_config(raw), out)
    return out, build_config(raw)


def test_posthoc_rechooses_alpha_beta_on_validation_with_the_trained_keys(tmp_path):
    import json

    from fedskew.experiment.cachefl_tools import posthoc_search

    run, cfg = finished_run(tmp_path, {"name": "cachefl", "alpha": 1.0, "beta": 1.0})
    result = posthoc_search(run, alpha_max=3.0, beta_max=5.0)
    fed = build_data(cfg)
    assets, ds = fed.dataset.meta["assets"], fed.dataset
    keys = torch.load(run / "checkpoint.pt", weights_only=False)["server"]["weights"]["model.keys"]
    assert not torch.allclose(keys, assets["cache_x"])  # trained keys, not the initial cache
    val = torch.cat(fed.val_idx)
    alphas, betas = tip_adapter_grid(3.0, 5.0)
    grid = grid_accuracy(
        ds.x_train[val], ds.y_train[val], assets["text"], keys, assets["cache_y"], alphas, betas, 100.0
    )
    assert result["val_accuracy"] == pytest.approx(float(grid.max()))
    i, j = divmod(int(grid.argmax()), len(alphas))
    assert result["choice"] == {"alpha": round(float(alphas[j]), 6), "beta": round(float(betas[i]), 6)}
    # the test accuracy reported is Eq. (7)'s at the chosen point, with the trained keys
    a, b = result["choice"]["alpha"], result["choice"]["beta"]
    logits = (
        100 * ds.x_test @ assets["text"].T
        + a * torch.exp(-b * (1 - ds.x_test @ keys.T)) @ F.one_hot(assets["cache_y"], ds.num_classes).float()
    )
    assert result["accuracy"] == pytest.approx(
        float((logits.argmax(1) == ds.y_test).float().mean()), abs=1e-4
    )
    json.dumps(result)  # the CLI writes it as JSON


def test_posthoc_rechooses_adapterfls_ratio_and_refuses_other_methods(tmp_path):
    from fedskew.experiment.cachefl_tools import posthoc_search

    run, _ = finished_run(tmp_path, {"name": "adapterfl", "reduction": 2})
    result = posthoc_search(run)
    assert result["candidates"] == 21 and 0.0 <= result["choice"]["ratio"] <= 1.0
    zero, _ = finished_run(tmp_path / "z", {"name": "zeroshot"})
    with pytest.raises(ConfigError, match="posthoc search needs a finished run"):
        posthoc_search(zero)


def test_keys_drift_is_logged_per_round_and_is_the_relative_frobenius_change(tmp_path):
    import json

    run, cfg = finished_run(tmp_path, {"name": "cachefl", "alpha": 1.0, "beta": 1.0})
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    keys = torch.load(run / "checkpoint.pt", weights_only=False)["server"]["weights"]["model.keys"].double()
    initial = build_data(cfg).dataset.meta["assets"]["cache_x"].double()
    assert last["keys_drift"] == pytest.approx(float((keys - initial).norm() / initial.norm()), rel=1e-6)
    assert last["keys_drift"] > 0 and last["keys_norm"] == pytest.approx(float(keys.norm(dim=1).mean()))


def test_generator_seed_run_draws_a_new_synthetic_set_per_run_seed():
    fixed = [build_data(build_config({**digits_vl(), "seed": s})).dataset.meta["assets"] for s in (0, 1)]
    assert torch.equal(fixed[0]["cache_x"], fixed[1]["cache_x"])  # one set per dataset (the default)
    per_run = []
    for s in (0, 1):
        raw = {**digits_vl(), "seed": s}
        raw["data"]["vision_language"]["seed"] = "run"
        per_run.append(build_data(build_config(raw)).dataset.meta["assets"])
    assert torch.equal(per_run[0]["cache_x"], fixed[0]["cache_x"])  # run seed 0 = generator seed 0
    assert not torch.equal(per_run[1]["cache_x"], per_run[0]["cache_x"])
