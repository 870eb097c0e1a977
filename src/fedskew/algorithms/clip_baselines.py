"""The CLIP baselines of CacheFL's Tables 1–2 (Yi et al. 2025, §4.1) on backbone features.

* ``zeroshot``: zero-shot CLIP, ``s · f W_textᵀ`` (Eq. 5 with the logit scale), nothing trained or sent.
* ``adapterfl``: adapter tuning + FL. The paper gives "two fully connected layers and two ReLU layers,
  integrated into the image encoder" and no sizes; as CLIP-Adapter (Gao et al. 2021) the adapter is a
  bottleneck on the image embedding, ``A(f) = ReLU(W₂ ReLU(W₁ f))`` with ``C → C/reduction → C``, mixed
  residually ``f' = ρ A(f) + (1 − ρ) f`` (ρ: CLIP-Adapter's ratio, 0.2) and classified zero-shot by
  ``s · normalise(f') W_textᵀ``. Only the adapter is trained and averaged (FedAvg, n_k weights).
* ``promptfl``: prompt tuning + FL (Guo et al. 2023) as CoOp (Zhou et al. 2022): p = 16 context vectors in
  the text encoder's token-embedding space, shared by all classes, class name at the end
  (``[SOS] ctx_1 … ctx_p <class>. [EOS]``); W_text = normalise(TextEncoder(prompts)); only the context is
  trained and averaged. It back-propagates through the frozen text transformer every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import ALGORITHMS, HyperParams
from fedskew.algorithms.vision_language import TextHead, UntrainedMethod, VisionLanguageMethod, vl_assets
from fedskew.errors import ConfigError
from fedskew.search_space import tunable
from fedskew.seeding import derive_seed

if TYPE_CHECKING:
    from fedskew.models.backbones.open_clip_backbone import PromptTextEncoder

_ADAPTER_INIT_KEY = 0xADA9  # the adapter's initial weights: from the run's seed, the same on every process
_PROMPT_INIT_KEY = 0xC00F  # the context vectors' initial values


class ZeroShotParams(HyperParams):
    logit_scale: float = Field(100.0, gt=0.0, description="s on the cosine logits (CLIP's 100)")


@ALGORITHMS.register("zeroshot")
class ZeroShot(UntrainedMethod):
    """Zero-shot CLIP (CacheFL Table 1, "CLIP"): class embeddings only, no training, nothing sent."""

    Params = ZeroShotParams
    p: ZeroShotParams

    def build_head(self) -> nn.Module:
        (text,) = vl_assets(self.ctx.assets, self.name, "text")
        return TextHead(text, self.p.logit_scale)


class AdapterModel(nn.Module):
    """CLIP-Adapter head: bottleneck ``C → C/r → C`` with two ReLUs, residual ratio ρ, zero-shot head."""

    text: Tensor

    def __init__(self, text: Tensor, reduction: int, ratio: float, scale: float, seed: int) -> None:
        super().__init__()
        dim = text.shape[1]
        hidden = max(1, dim // reduction)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.adapter = nn.Sequential(
                nn.Linear(dim, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, dim, bias=False), nn.ReLU()
            )
        self.register_buffer("text", text.clone())
        self.ratio, self.scale = ratio, scale

    def forward(self, f: Tensor) -> Tensor:
        mixed = self.ratio * self.adapter(f) + (1.0 - self.ratio) * f
        return self.scale * F.normalize(mixed, dim=-1) @ self.text.T


@ALGORITHMS.register("adapterfl")
class AdapterFL(VisionLanguageMethod):
    """AdapterFL (CacheFL Table 1): a CLIP-Adapter bottleneck on the image features, trained and averaged."""

    class Params(ZeroShotParams):
        reduction: int = Field(4, ge=1, description="bottleneck reduction C/r (CLIP-Adapter: 4, 1024→256)")
        ratio: float = tunable(
            0.2,
            low=0.0,
            high=1.0,
            ge=0.0,
            le=1.0,
            description="residual ratio ρ (CLIP-Adapter's 0.2; search: fedskew, the whole range; 0 is "
            "zero-shot CLIP)",
        )

    p: Params

    def build_head(self) -> nn.Module:
        (text,) = vl_assets(self.ctx.assets, self.name, "text")
        seed = derive_seed(self.ctx.seed, _ADAPTER_INIT_KEY)
        return AdapterModel(text, self.p.reduction, self.p.ratio, self.p.logit_scale, seed)

    def trained(self, name: str) -> bool:
        return name.startswith("adapter.")


class PromptModel(nn.Module):
    """CoOp head: the context ``ctx`` (trained) through the frozen text tower gives W_text (Eq. 5)."""

    def __init__(self, encoder: PromptTextEncoder, n_ctx: int, scale: float, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ctx = nn.Parameter(0.02 * torch.randn(n_ctx, encoder.width, generator=g))  # CoOp's init std
        self.encoder, self.scale = encoder, scale

    def class_embeddings(self) -> Tensor:
        return F.normalize(self.encoder(self.ctx), dim=-1)

    def forward(self, f: Tensor) -> Tensor:
        return self.scale * f @ self.class_embeddings().T


@ALGORITHMS.register("promptfl")
class PromptFL(VisionLanguageMethod):
    """PromptFL (Guo et al. 2023; CacheFL Table 1): CoOp context vectors learned and averaged, text tower
    frozen; needs a backbone with a text transformer (``open_clip``)."""

    class Params(ZeroShotParams):
        n_ctx: int = Field(16, ge=1, description="p learnable context tokens (CacheFL §4.1: 16 × 512)")

    p: Params

    def build_head(self) -> nn.Module:
        if "prompt_encoder" not in self.ctx.assets:
            raise ConfigError(
                f"algorithm '{self.name}' learns prompts in a text encoder: data.vision_language.backbone "
                "must have a text tower (open_clip, random_clip)"
            )
        encoder = self.ctx.assets["prompt_encoder"](self.p.n_ctx)
        return PromptModel(
            encoder, self.p.n_ctx, self.p.logit_scale, derive_seed(self.ctx.seed, _PROMPT_INIT_KEY)
        )

    def trained(self, name: str) -> bool:
        return name == "ctx"
