"""CacheFL (Yi, Zhang, Dou, Zhao, Shen 2025, "CacheFL: Efficient Federated Cache Model Fine-Tuning for
Vision-Language Models").

The server builds a Tip-Adapter-style cache from K generated images per class (Eq. 2): keys W1 = their
L2-normalised image features (Eq. 3, trained), values W2 = their one-hot labels (Eq. 4, frozen, sent
once). A feature f is classified by (Eqs. 5–7)

    logits = s · f W_textᵀ + α · exp(−β (1 − f W1)) W2ᵀ

(s: CLIP's logit scale, 100; Eq. 5 prints none). Clients train only W1 with cross-entropy and SGD for E
local epochs (Eq. 8); the server averages the uploaded W1 with weights n_k (Eq. 9). Only W1 travels each
round: C·N·K floats up and down. Here W1 is stored transposed, ``keys [N·K, C]`` (row j = key of synthetic
image j), and W2ᵀ as ``values [N·K, N]``.

Options (defaults first; reasons in docs/decisions.md, "CacheFL" entries): ``logit_scale`` (100);
``renormalize_keys`` (False: keys are not re-normalised after local training, as Tip-Adapter-F);
``aggregation`` (``participants``: n_k / Σ_{k∈S_t} n_k; ``total``: the literal n_k / n with n over all
clients, which shrinks W1 under partial participation). The optimiser is the engine's SGD
(``client.lr``, ``client.momentum``, mean-reduced cross-entropy, state reset every round).
``cachefl_notrain`` is the cache without federated training (Table 2, "w.o. Training").
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew import numerics
from fedskew.algorithms.base import (
    ALGORITHMS,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    model_arrays,
    weighted_average,
)
from fedskew.algorithms.vision_language import (
    UntrainedMethod,
    VisionLanguageMethod,
    vl_assets,
    zero_shot_logits,
)
from fedskew.search_space import tunable


def affinity(f: Tensor, keys: Tensor, beta: float) -> Tensor:
    """Eq. (6)'s kernel ``A = exp(−β (1 − f W1))`` ``[B, N·K]``; for unit vectors it equals
    ``exp(−(β/2) ‖f − w‖²)``."""
    return numerics.exp(-beta * (1.0 - f @ keys.T))


def cache_logits(
    f: Tensor, text: Tensor, keys: Tensor, values: Tensor, alpha: float, beta: float, scale: float
) -> Tensor:
    """Eq. (7): ``s · f W_textᵀ + α · exp(−β (1 − f W1)) W2ᵀ`` ``[B, N]``.

    ``keys`` is W1ᵀ ``[N·K, C]``, ``values`` is W2ᵀ ``[N·K, N]``."""
    return zero_shot_logits(f, text, scale) + alpha * affinity(f, keys, beta) @ values


def cache_gradient(
    f: Tensor, y: Tensor, text: Tensor, keys: Tensor, values: Tensor, alpha: float, beta: float, scale: float
) -> Tensor:
    """Closed-form gradient of the mean cross-entropy w.r.t. the keys (W1ᵀ, ``[N·K, C]``):
    ``α β [(G W2) ⊙ A]ᵀ F`` with ``G = (softmax(Z) − Y) / B``, i.e. the transpose of
    ``∇_{W1} ℒ = α β Fᵀ [(G W2) ⊙ A]`` (from Eqs. 6–8)."""
    a = affinity(f, keys, beta)
    z = zero_shot_logits(f, text, scale) + alpha * a @ values
    g = (z.softmax(1) - F.one_hot(y, text.shape[0]).to(z.dtype)) / f.shape[0]
    return alpha * beta * ((g @ values.T) * a).T @ f


class CacheModel(nn.Module):
    """The cache classifier (Eq. 7): ``keys`` (W1ᵀ) is the only parameter; W2ᵀ and W_text are buffers."""

    values: Tensor
    text: Tensor

    def __init__(self, keys: Tensor, labels: Tensor, text: Tensor, alpha: float, beta: float, scale: float):
        super().__init__()
        self.keys = nn.Parameter(keys.clone())
        self.register_buffer("values", F.one_hot(labels.long(), text.shape[0]).to(keys.dtype))
        self.register_buffer("text", text.clone())
        self.alpha, self.beta, self.scale = alpha, beta, scale

    def forward(self, f: Tensor) -> Tensor:
        return cache_logits(f, self.text, self.keys, self.values, self.alpha, self.beta, self.scale)


class CacheParams(HyperParams):
    alpha: float = tunable(
        1.0,
        low=0.1,
        high=10.0,
        log=True,
        ge=0.0,
        description="α, weight of the cache logits (Eq. 7; per dataset by grid search: Caltech101 3, "
        "DTD 2, ImageNet 0.6, Appendix B.2; search: fedskew, the paper states no grid: [0.1, 10] log spans "
        "its values)",
    )
    beta: float = tunable(
        1.0,
        low=0.1,
        high=10.0,
        log=True,
        gt=0.0,
        description="β, sharpness of the affinity kernel (Eq. 6; 1 in App. B.2, grid-searched per dataset; "
        "search: fedskew, [0.1, 10] log around the paper's 1)",
    )
    logit_scale: float = Field(
        100.0, gt=0.0, description="s on the zero-shot logits (CLIP/Tip-Adapter's 100; Eq. 5 prints none)"
    )


@ALGORITHMS.register("cachefl")
class CacheFL(VisionLanguageMethod):
    """CacheFL (Yi et al. 2025): train and average only the cache keys W1 built from generated images."""

    class Params(CacheParams):
        renormalize_keys: bool = Field(
            False,
            description="L2-normalise the keys after local training (False: Tip-Adapter-F, keys drift)",
        )
        aggregation: Literal["participants", "total"] = Field(
            "participants",
            description="Eq. 9 weights: n_k over the round's participants (sum 1) or the literal n_k / n "
            "with n over all clients (sums < 1 under partial participation)",
        )

    p: Params
    vectorizable: ClassVar[bool] = True

    def build_head(self) -> nn.Module:
        keys, labels, text = vl_assets(self.ctx.assets, self.name, "cache_x", "cache_y", "text")
        return CacheModel(keys, labels, text, self.p.alpha, self.p.beta, self.p.logit_scale)

    def trained(self, name: str) -> bool:
        return name == "keys"

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        out = super().finish_local(step, result)
        if self.p.renormalize_keys:
            out.upload.arrays = {k: F.normalize(v, dim=1) for k, v in out.upload.arrays.items()}
        return out

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """Eq. (9): ``W1 ← Σ_k w_k W1_k`` with ``w_k = n_k / Σ_{S_t} n_j`` (or ``n_k / n``, ``total``)."""
        n = torch.tensor([float(u.num_samples) for u in uploads], dtype=torch.float64)
        total = n.sum() if self.p.aggregation == "participants" else self.ctx.client_sizes.double().sum()
        new = model_arrays(weighted_average([u.payload.model_state() for u in uploads], n / total))
        return ServerUpdate({**server, "weights": new}, self.keys_drift(new))

    def keys_drift(self, weights: State) -> dict[str, float]:
        """Round diagnostics of the averaged keys W1 against the initial synthetic cache W1⁰ (Eq. 3):
        ``keys_drift`` = ‖W1 − W1⁰‖_F / ‖W1⁰‖_F and ``keys_norm`` = the mean row norm of W1 (1 at the start;
        keys are not re-normalised after training unless ``renormalize_keys``)."""
        initial = self.ctx.assets["cache_x"].to(dtype=torch.float64)
        keys = next(v for k, v in weights.items() if k.endswith("keys")).detach().cpu().double()
        drift = float(torch.linalg.norm(keys - initial) / torch.linalg.norm(initial))
        return {"keys_drift": drift, "keys_norm": float(keys.norm(dim=1).mean())}


@ALGORITHMS.register("cachefl_notrain")
class CacheFLNoTrain(UntrainedMethod):
    """CacheFL's initial cache without federated training (Table 2, "w.o. Training")."""

    Params = CacheParams
    p: CacheParams

    def build_head(self) -> nn.Module:
        keys, labels, text = vl_assets(self.ctx.assets, self.name, "cache_x", "cache_y", "text")
        return CacheModel(keys, labels, text, self.p.alpha, self.p.beta, self.p.logit_scale)
