"""Model contract: every model is ``head(features(x))``.

``features(x) -> z`` is the embedding a prototype lives in; ``head(z) -> logits``. Heterogeneous
variants of one model share the embedding size, so prototypes stay comparable across clients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from fedskew.registry import Registry

#: name -> ``factory(in_shape: tuple, num_classes: int, **options) -> FedModel``
MODELS: Registry = Registry("model")


class FedModel(nn.Module):
    """Base class: subclasses define ``features`` and ``head`` (and ``embed_dim``).

    Parameter names of the head start with ``head_prefix`` so that algorithms with personal heads
    (FedPer, FedRep) can split body and head by name.
    """

    embed_dim: int
    head_prefix: str = "classifier."

    def features(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def head(self, z: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))

    def is_head(self, name: str) -> bool:
        """Whether a parameter / state-dict entry belongs to the head."""
        return name.startswith(self.head_prefix)


class HeadView(nn.Module):
    """``model.head`` as a module's forward, so ``torch.func.functional_call`` can substitute head weights
    (FedGen's ensemble of clients' heads, CCVR's head re-training)."""

    def __init__(self, model: FedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, z: Tensor) -> Tensor:
        return self.model.head(z)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def embed_in_chunks(embed: Callable[[Tensor], Tensor], x: Tensor, batch_size: int = 1024) -> Tensor:
    """``embed`` applied to ``x`` in chunks of ``batch_size`` rows, without autograd, concatenated (a
    client without samples gets ``embed`` of its empty batch: ``[0, d]``)."""
    if x.shape[0] == 0:
        return embed(x)
    return torch.cat([embed(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])
