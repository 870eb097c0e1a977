"""CacheFL's offline tools: the α/β grid search on a validation split, and feature files.

:func:`search_alpha_beta` follows Tip-Adapter's search (Zhang et al. 2022, which CacheFL's "grid search"
for α and β follows; CacheFL Appendix B.2): β_i = 0.1 + i (β_max − 0.1)/200, i = 0..199, and
α_j = 0.1 + j (α_max − 0.1)/20, j = 0..19, scored by the accuracy of Eq. (7) on the clients' **validation**
samples (``data.val_fraction > 0``, or ``data.val_shots`` with ``data.shots``), never on the test split.
The keys are the initial synthetic cache, or with ``trained=True`` the keys after a full federated run
of the config.

:func:`posthoc_search` re-chooses a finished run's head hyper-parameters on its validation split with the
trained head (Tip-Adapter-F's order: train with the initial α/β, then search α/β again with the fine-tuned
cache; Zhang et al. 2022, §3.2). CacheFL: the same α/β grid over the trained keys W1. AdapterFL: the
residual ratio ρ ∈ {0, 0.05, …, 1} over the trained adapter (CLIP-Adapter's mixing). The test accuracy of
the choice is reported beside it; the test split never takes part in the choice.

:func:`export_features` writes a config's vision-language features as a file the ``features`` backbone
loads: ``train`` (rows no client holds are zero), ``test``, ``synthetic`` and ``text``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.algorithms.cachefl import affinity
from fedskew.algorithms.clip_baselines import AdapterModel
from fedskew.errors import ConfigError
from fedskew.experiment.config import Config, load_config
from fedskew.experiment.results import CONFIG_FILE, load_checkpoint
from fedskew.experiment.runner import build_data, build_simulation


def tip_adapter_grid(alpha_max: float, beta_max: float) -> tuple[Tensor, Tensor]:
    """Tip-Adapter's search grid: 20 α values in [0.1, α_max) and 200 β values in [0.1, β_max)."""
    alphas = 0.1 + torch.arange(20, dtype=torch.float64) * (alpha_max - 0.1) / 20
    betas = 0.1 + torch.arange(200, dtype=torch.float64) * (beta_max - 0.1) / 200
    return alphas, betas


def grid_accuracy(
    f: Tensor,
    y: Tensor,
    text: Tensor,
    keys: Tensor,
    labels: Tensor,
    alphas: Tensor,
    betas: Tensor,
    scale: float,
) -> Tensor:
    """``[len(betas), len(alphas)]`` accuracies of Eq. (7) on features ``f`` with labels ``y``."""
    f, text, keys = f.double(), text.double(), keys.double()
    values = F.one_hot(labels.long(), text.shape[0]).double()
    zero = scale * f @ text.T  # [V, N]
    out = torch.empty(len(betas), len(alphas), dtype=torch.float64)
    for i, beta in enumerate(betas.tolist()):  # one [V, N·K] kernel per β; every α at once
        cache = affinity(f, keys, beta) @ values
        logits = zero[None] + alphas[:, None, None] * cache[None]
        out[i] = (logits.argmax(-1) == y[None]).double().mean(1)
    return out


def search_alpha_beta(
    cfg: Config, alpha_max: float = 10.0, beta_max: float = 10.0, trained: bool = False
) -> dict[str, Any]:
    """The (α, β) of Tip-Adapter's grid with the best validation accuracy (first best in grid order)."""
    has_val = cfg.data.val_fraction > 0 or cfg.data.val_shots is not None
    if not has_val or cfg.data.vision_language is None:
        raise ConfigError(
            "the α/β search needs data.vision_language and a validation split: "
            "set data.val_fraction > 0 or data.val_shots (with data.shots)"
        )
    fed = build_data(cfg)
    assets = fed.dataset.meta["assets"]
    val = torch.cat(fed.val_idx)
    keys = assets["cache_x"]
    if trained:
        sim = build_simulation(cfg, fed)
        while sim.round < cfg.rounds:
            sim.run_round()
        sim.close()
        keys = sim.server["weights"]["model.keys"].cpu()
    scale = float(cfg.algorithm.hyper().get("logit_scale", 100.0))
    alphas, betas = tip_adapter_grid(alpha_max, beta_max)
    x, y = fed.dataset.x_train[val], fed.dataset.y_train[val]
    acc = grid_accuracy(x, y, assets["text"], keys, assets["cache_y"], alphas, betas, scale)
    best = int(acc.argmax())
    i, j = divmod(best, len(alphas))
    return {
        "alpha": round(float(alphas[j]), 6),
        "beta": round(float(betas[i]), 6),
        "val_accuracy": float(acc[i, j]),
        "val_samples": int(val.numel()),
        "keys": "trained" if trained else "initial",
        "grid": {"alpha_max": alpha_max, "beta_max": beta_max, "alphas": 20, "betas": 200},
    }


def _cachefl_grid(
    weights: dict[str, Tensor], assets: dict[str, Any], hp: dict[str, Any], x: Tensor, y: Tensor
) -> tuple[list[dict[str, float]], Tensor]:
    """Candidates (α, β) of Tip-Adapter's grid (``hp["grid"]``: only these) and their accuracies on (x, y)."""
    alphas, betas = tip_adapter_grid(float(hp["alpha_max"]), float(hp["beta_max"]))
    if "only" in hp:
        alphas, betas = (torch.tensor([float(hp["only"][k])], dtype=torch.float64) for k in ("alpha", "beta"))
    scale = float(hp.get("logit_scale", 100.0))
    acc = grid_accuracy(x, y, assets["text"], weights["model.keys"], assets["cache_y"], alphas, betas, scale)
    grid = [{"alpha": round(float(a), 6), "beta": round(float(b), 6)} for b in betas for a in alphas]
    return grid, acc.flatten()


def _adapter_grid(
    weights: dict[str, Tensor], assets: dict[str, Any], hp: dict[str, Any], x: Tensor, y: Tensor
) -> tuple[list[dict[str, float]], Tensor]:
    """Candidates ρ ∈ {0, 0.05, …, 1} of AdapterFL's residual ratio (``hp["only"]``: that one) and their
    accuracies on (x, y)."""
    ratios = [float(hp["only"]["ratio"])] if "only" in hp else [round(0.05 * i, 2) for i in range(21)]
    text = assets["text"]
    head = AdapterModel(text, int(hp.get("reduction", 4)), 0.0, float(hp.get("logit_scale", 100.0)), 0)
    head.adapter.load_state_dict({k.removeprefix("model.adapter."): v for k, v in weights.items()})
    with torch.no_grad():
        f = x.float()
        adapted = head.adapter(f)
        acc = [((F.normalize(r * adapted + (1 - r) * f, dim=-1) @ text.T).argmax(1) == y).double().mean()
               for r in ratios]  # fmt: skip
    return [{"ratio": r} for r in ratios], torch.stack(acc)


#: algorithm -> the grid of its head hyper-parameters searched after training
POSTHOC_GRIDS = {"cachefl": _cachefl_grid, "adapterfl": _adapter_grid}


def posthoc_search(run: Path, alpha_max: float = 10.0, beta_max: float = 10.0) -> dict[str, Any]:
    """A finished run's head hyper-parameters re-chosen on its validation split with the trained head (module
    doc), the first best candidate in grid order; the test accuracy of the choice beside it."""
    cfg = load_config(run / CONFIG_FILE)
    grid_of = POSTHOC_GRIDS.get(cfg.algorithm.name)
    ckpt = load_checkpoint(run)
    if grid_of is None or ckpt is None or ckpt["round"] < cfg.rounds:
        raise ConfigError(
            f"posthoc search needs a finished run of {', '.join(POSTHOC_GRIDS)} with its checkpoint: {run}"
        )
    fed = build_data(cfg)
    val = torch.cat(fed.val_idx)
    ds, assets = fed.dataset, fed.dataset.meta["assets"]
    hp = {**cfg.algorithm.hyper(), "alpha_max": alpha_max, "beta_max": beta_max}
    weights = {k: v.cpu() for k, v in ckpt["server"]["weights"].items()}
    grid, val_acc = grid_of(weights, assets, hp, ds.x_train[val], ds.y_train[val])
    best = int(val_acc.argmax())
    _, test_acc = grid_of(weights, assets, {**hp, "only": grid[best]}, ds.x_test, ds.y_test)
    return {
        "algorithm": cfg.algorithm.name,
        "seed": cfg.seed,
        "choice": grid[best],
        "val_accuracy": float(val_acc[best]),
        "accuracy": float(test_acc[0]),
        "candidates": len(grid),
        "val_samples": int(val.numel()),
    }


def export_features(cfg: Config, out: Path) -> Path:
    """The config's vision-language features as a ``.pt`` file for the ``features`` backbone."""
    if cfg.data.vision_language is None:
        raise ConfigError("fedskew features needs config key 'data.vision_language' (backbone, generator)")
    ds = build_data(cfg).dataset
    assets = ds.meta["assets"]
    arrays = {"train": ds.x_train, "test": ds.x_test, "synthetic": assets["cache_x"], "text": assets["text"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.float().contiguous() for k, v in arrays.items()}, out)
    return out
