"""``open_clip``: a CLIP model of the ``open_clip`` package, loaded only from a local checkpoint file.

``model`` names an open_clip architecture (``RN50``: CacheFL's CLIP ResNet-50, C = 1024) or
``model_config`` gives its dimensions (``{embed_dim, vision_cfg, text_cfg}``, e.g. a tiny CLIP for tests);
``checkpoint`` is a state-dict file (``.pt``/``.bin``/``.pth``, loaded with ``weights_only=True``; an
open_clip ``open_clip_pytorch_model.bin`` works as is, OpenAI's TorchScript archives must be converted to a
state dict first). Nothing is ever downloaded. The weights' activation (GELU or QuickGELU) is checked against
the architecture's (``pretrained``, ``quick_gelu``, ``activation_mismatch``: :mod:`.clip_activation`).

Images get CLIP's preprocessing by default (``resize: shortest``: the shortest side resized to the vision
tower's size, bicubic, then a centred square crop; :func:`~fedskew.models.backbones.shortest_side`) and
CLIP's mean/std; ``resize: squash`` resizes both sides instead (the aspect ratio is lost). Prompts go
through open_clip's bundled BPE tokenizer.

:class:`PromptTextEncoder` exposes the text tower for prompt learning (CoOp / PromptFL): the class prompts
``"X X … X <class name>."`` are embedded once, and ``forward(ctx)`` replaces the ``n_ctx`` placeholder
embeddings by the learnable context vectors and runs the frozen transformer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.models.backbones import (
    BACKBONES,
    Backbone,
    check_resize,
    file_fingerprint,
    resolve_path,
    to_backbone_input,
)
from fedskew.models.backbones.clip_activation import (
    architecture_quick_gelu,
    build_with_activation,
    built_activation,
    declared_quick_gelu,
    needed_quick_gelu,
)
from fedskew.models.base import embed_in_chunks
from fedskew.models.clip_compat import import_open_clip

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: a tiny CLIP (ViT image tower, one-layer text transformer over CLIP's vocabulary) for tests
TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
#: open_clip's ``CLIP`` (an ``nn.Module``): the package ships no type information, so it is typed ``Any``
CLIPModel = Any


def check_architecture(model: str | None, model_config: dict[str, Any] | None) -> None:
    """One of ``model`` (an open_clip architecture name) or ``model_config``, else a one-line error."""
    if (model is None) == (model_config is None):
        raise ConfigError("backbone 'open_clip': give exactly one of options.model or options.model_config")
    if model is not None and model not in import_open_clip().list_models():
        raise ConfigError(
            f"backbone 'open_clip': unknown architecture '{model}'; e.g. RN50-quickgelu, RN50, ViT-B-32"
        )


def build_clip(
    model: str | None, model_config: dict[str, Any] | None, quick_gelu: bool | None = None
) -> nn.Module:
    """The open_clip architecture with random weights (no download), with the given activation (``None``:
    the architecture's own)."""
    check_architecture(model, model_config)
    if quick_gelu is None:
        quick_gelu = architecture_quick_gelu(model, model_config)
    return build_with_activation(model, model_config, quick_gelu)


def read_checkpoint(path: Path) -> tuple[dict[str, Tensor], bool | None]:
    """The state dict of a local file (``module.`` prefixes dropped) and its ``quick_gelu`` entry when the
    file is a dict ``{"state_dict": ..., "quick_gelu": bool}`` (else ``None``)."""
    if not path.is_file():
        raise ConfigError(f"backbone 'open_clip': checkpoint not found: {path} (a local state-dict file)")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # TorchScript archives and pickles with code are refused
        reason = str(err).splitlines()[0]
        raise ConfigError(f"backbone 'open_clip': {path} is not a plain state dict ({reason})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"backbone 'open_clip': {path} holds a {type(raw).__name__}, not a state dict")
    stored = raw.get("quick_gelu") if "state_dict" in raw else None
    if stored is not None and not isinstance(stored, bool):
        raise ConfigError(f"backbone 'open_clip': {path}: quick_gelu must be true or false, got {stored!r}")
    state = raw.get("state_dict", raw)
    return {k.removeprefix("module."): v for k, v in state.items()}, stored


def load_state(net: nn.Module, state: dict[str, Tensor], path: Path) -> None:
    try:
        net.load_state_dict(state)
    except RuntimeError as err:
        raise ConfigError(f"backbone 'open_clip': {path} does not match the architecture: {err}") from None


class OpenCLIPBackbone(Backbone):
    """Frozen CLIP image and text towers of open_clip."""

    seed: int | None = None

    def __init__(
        self, net: CLIPModel, checkpoint: Path | None, name: str, batch_size: int, resize: str = "shortest"
    ) -> None:
        self.net = net.requires_grad_(False).eval()
        self.checkpoint, self.name, self.batch_size = checkpoint, name, batch_size
        self.resize, self.activation = check_resize(resize, "open_clip"), built_activation(net)
        self.embed_dim = int(net.text_projection.shape[1])
        size = net.visual.image_size
        self.image_size = int(size[0] if isinstance(size, (tuple, list)) else size)
        # CLIP's BPE tokenizer, bundled with the package
        self.tokenizer = import_open_clip().tokenizer.SimpleTokenizer(context_length=int(net.context_length))

    def encode_images(self, images: Tensor, split: str, rows: Tensor | None = None) -> Tensor:
        def run(b: Tensor) -> Tensor:
            return self.net.encode_image(
                to_backbone_input(b, self.image_size, CLIP_MEAN, CLIP_STD, self.resize)
            )

        return embed_in_chunks(run, images, self.batch_size)

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        with torch.no_grad():
            return self.net.encode_text(self.tokenizer(list(texts)))

    def prompt_encoder(self, class_names: Sequence[str], n_ctx: int) -> PromptTextEncoder:
        return PromptTextEncoder(self.net, self.tokenizer, class_names, n_ctx)

    def fingerprint(self) -> dict:
        source = {"seed": self.seed} if self.checkpoint is None else file_fingerprint(self.checkpoint)
        return {
            "name": "open_clip",
            "arch": self.name,
            "weights": source,
            "activation": self.activation,
            "resize": self.resize,
        }


class PromptTextEncoder(nn.Module):
    """The frozen text tower over ``"X … X <class>."`` prompts whose ``n_ctx`` X embeddings are replaced by
    learnable context vectors (CoOp, Zhou et al. 2022: unified context, class token at the end)."""

    tokens: Tensor
    embedded: Tensor
    positional: Tensor
    projection: Tensor
    attn_mask: Tensor

    def __init__(self, net: CLIPModel, tokenizer: Any, class_names: Sequence[str], n_ctx: int) -> None:
        super().__init__()
        placeholder = " ".join(["X"] * n_ctx)
        tokens = tokenizer([f"{placeholder} {n.replace('_', ' ')}." for n in class_names])
        self.register_buffer("tokens", tokens)
        with torch.no_grad():
            self.register_buffer("embedded", net.token_embedding(tokens).float())  # [N, L, width]
        self.transformer, self.ln_final = net.transformer, net.ln_final
        self.register_buffer("positional", net.positional_embedding.detach().clone())
        self.register_buffer("projection", net.text_projection.detach().clone())
        self.register_buffer("attn_mask", net.attn_mask.clone())
        self.n_ctx, self.width = n_ctx, int(self.embedded.shape[-1])
        self.requires_grad_(False)

    def forward(self, ctx: Tensor) -> Tensor:
        """Text features ``[N, C]`` (not normalised) with context ``ctx [n_ctx, width]``."""
        n = self.embedded.shape[0]
        x = torch.cat(
            [self.embedded[:, :1], ctx.unsqueeze(0).expand(n, -1, -1), self.embedded[:, 1 + self.n_ctx :]], 1
        )
        x = self.transformer(x + self.positional, attn_mask=self.attn_mask)
        x = self.ln_final(x)
        x = x[torch.arange(n, device=x.device), self.tokens.argmax(-1)]  # the end-of-text token
        return x @ self.projection


@BACKBONES.register("random_clip")
def random_clip(
    root: Path,
    *,
    model_config: dict[str, Any] | None = None,
    seed: int = 0,
    batch_size: int = 64,
    resize: Literal["shortest", "squash"] = "shortest",
) -> OpenCLIPBackbone:
    """A tiny open_clip CLIP with seeded random weights (tests and smoke runs; no checkpoint, no download).
    ``model_config`` may set ``quick_gelu``; ``resize`` as for ``open_clip``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_clip(None, model_config or TINY_CLIP)
    backbone = OpenCLIPBackbone(net, None, "random", batch_size, resize)
    backbone.seed = seed
    return backbone


@BACKBONES.register("open_clip")
def open_clip_backbone(
    root: Path,
    *,
    checkpoint: str,
    model: str | None = None,
    model_config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    quick_gelu: bool | None = None,
    activation_mismatch: Literal["refuse", "correct"] = "refuse",
    resize: Literal["shortest", "squash"] = "shortest",
    batch_size: int = 64,
) -> OpenCLIPBackbone:
    """An open_clip CLIP from a local checkpoint (architecture by name or config; never downloads).

    ``pretrained`` (an open_clip tag of ``model``, e.g. ``openai``) and/or ``quick_gelu`` declare the
    weights' activation, as may the checkpoint (:mod:`.clip_activation`); ``activation_mismatch``: ``refuse``
    (default) or ``correct`` (build the architecture with the weights' activation)."""
    path = resolve_path(root, checkpoint)
    check_resize(resize, "open_clip")
    check_architecture(model, model_config)
    state, stored = read_checkpoint(path)
    declared = declared_quick_gelu(model, pretrained, quick_gelu, stored)
    net = build_clip(
        model, model_config, needed_quick_gelu(model, model_config, declared, activation_mismatch)
    )
    load_state(net, state, path)
    return OpenCLIPBackbone(net, path, model or "custom", batch_size, resize)
