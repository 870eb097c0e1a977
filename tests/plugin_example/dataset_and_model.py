"""A dataset and a model from a user's folder: ``tiny_blobs`` (4 Gaussian classes in 8 dimensions, drawn
from a fixed seed: nothing read or downloaded) and ``tiny_mlp`` (one hidden layer)."""

import math

import torch
from torch import nn

from fedskew.data.base import DATASETS, Dataset
from fedskew.models.base import MODELS, FedModel


@DATASETS.register("tiny_blobs")
def tiny_blobs(root, samples: int = 400):
    """Four Gaussian blobs in 8 dimensions (train and test drawn from one fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(4, 8, generator=gen)

    def draw(n):
        y = torch.arange(n) % 4
        return centres[y] + torch.randn(n, 8, generator=gen), y

    (x, y), (tx, ty) = draw(samples), draw(samples // 4)
    return Dataset("tiny_blobs", x, y, tx, ty, 4)


class TinyMLP(FedModel):
    def __init__(self, in_dim: int, num_classes: int, hidden: int) -> None:
        super().__init__()
        self.embed_dim = hidden
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_dim, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x):
        return self.body(x)

    def head(self, z):
        return self.classifier(z)


@MODELS.register("tiny_mlp")
def tiny_mlp(in_shape, num_classes, hidden: int = 16):
    """An MLP with one hidden layer."""
    return TinyMLP(math.prod(in_shape), num_classes, hidden)
