"""Frozen pre-trained encoders: features computed once per run (MP-FedCL Table II, FedPCL's setting).

MP-FedCL trains and communicates only a 133,898-parameter MLP head on top of a ResNet-18 that is never
updated (Table II counts only the head). A frozen encoder in eval mode is a fixed function of the input, so
with no augmentation its features can be computed once, before training: ``data.frozen_encoder`` replaces
the dataset's images by ``encoder.features(x)`` and the model becomes the head alone (e.g. ``mlp_mpfedcl``
with ``encoder: false``). Nothing of the encoder is trained, uploaded or broadcast.

The weights come from a local file (a ``state_dict``; torchvision's ResNet-18 key names load directly);
a relative path is resolved against the data root. A missing file or mismatching keys are one-line errors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedskew.data.base import Dataset
from fedskew.errors import ConfigError
from fedskew.models.base import MODELS, FedModel, embed_in_chunks

HEAD_PREFIXES = ("fc.", "classifier.")  # the encoder's own classifier is not part of the features


def load_frozen_encoder(
    name: str, in_shape: tuple[int, ...], weights: Path, options: dict[str, Any] | None = None
) -> FedModel:
    """Model ``name`` with the encoder weights of ``weights`` (classifier ignored), frozen, in eval mode."""
    if not weights.is_file():
        raise ConfigError(f"data.frozen_encoder.weights: file not found: {weights} (a {name} state_dict)")
    model = MODELS.get(name)(in_shape, 10, **(options or {}))
    raw = torch.load(weights, map_location="cpu", weights_only=True)
    state = raw.get("state_dict", raw) if isinstance(raw, dict) else raw
    if not isinstance(state, dict):
        raise ConfigError(f"data.frozen_encoder.weights: {weights} does not hold a state_dict")
    state = {k.removeprefix("module."): v for k, v in state.items() if not k.startswith(HEAD_PREFIXES)}
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(HEAD_PREFIXES)}
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or extra or wrong:
        first = (missing or extra or wrong)[0]
        raise ConfigError(
            f"data.frozen_encoder.weights: {weights} does not match model '{name}': {len(missing)} missing, "
            f"{len(extra)} unexpected, {len(wrong)} mis-shaped entries (first: {first})"
        )
    model.load_state_dict(state, strict=False)
    model.requires_grad_(False)
    return model.eval()


def encode(encoder: FedModel, dataset: Dataset, x: Tensor, batch_size: int, device: str) -> Tensor:
    """``encoder.features`` of every sample of ``x`` (normalised as the dataset defines), on ``device``."""
    encoder = encoder.to(device)
    if x.shape[0] == 0:
        return torch.zeros(0, int(getattr(encoder, "embed_dim", 0)))
    return embed_in_chunks(
        lambda b: encoder.features(dataset.to_float(b.to(device))).float().cpu(), x, batch_size
    )


def frozen_features(
    dataset: Dataset,
    name: str,
    weights: Path,
    options: dict[str, Any] | None = None,
    batch_size: int = 256,
    device: str = "cpu",
) -> Dataset:
    """The dataset with its images replaced by the frozen encoder's features (float32 ``[N, d]``)."""
    encoder = load_frozen_encoder(name, dataset.in_shape, weights, options)
    return dataclasses.replace(
        dataset,
        x_train=encode(encoder, dataset, dataset.x_train, batch_size, device),
        x_test=encode(encoder, dataset, dataset.x_test, batch_size, device),
        mean=(0.0,),
        std=(1.0,),
        meta={**dataset.meta, "frozen_encoder": {"name": name, "weights": str(weights)}},
    )
