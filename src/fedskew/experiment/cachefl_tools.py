"""CacheFL's offline tools: the α/β grid search on a validation split, and feature files.

:func:`search_alpha_beta` follows Tip-Adapter's search (Zhang et al. 2022, which CacheFL's "grid search"
for α and β follows; CacheFL Appendix B.2): β_i = 0.1 + i (β_max − 0.1)/200, i = 0..199, and
α_j = 0.1 + j (α_max − 0.1)/20, j = 0..19, scored by the accuracy of Eq. (7) on the clients' **validation**
samples (``data.val_fraction > 0``, or ``data.val_shots`` with ``data.shots``), never on the test split.
The keys are the initial synthetic cache, or with ``trained=True`` the keys after a full federated run
of the config.

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
from fedskew.errors import ConfigError
from fedskew.experiment.config import Config
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
