"""PFLlib's ``FedAvgCNN``, the 4-layer CNN of its benchmark (TsingZ0/PFLlib,
``system/flcore/trainmodel/models.py`` at commit d832e76; read for issue 52).

conv 5×5 32 (no padding) → ReLU → 2×2 max-pool → conv 5×5 64 (no padding) → ReLU → pool → flatten → FC 512 →
ReLU | FC C. PFLlib's personalized methods split it as ``BaseHeadSplit(model, head=model.fc)``: the head is
the last linear layer alone, the body everything before it, as here (``classifier.`` = PFLlib's ``fc``).
PFLlib hard-codes the flatten size per dataset (``dim=1024`` on 1×28×28, 1600 on 3×32×32); it comes from a
dry run here, which gives the same numbers. 582,026 parameters on Fashion-MNIST (10 classes).
"""

from __future__ import annotations

from torch import nn

from fedskew.models.base import FedModel
from fedskew.models.factory import PosInt, SplitModel, flat_dim, need_image, registered_model


@registered_model("fedavg_cnn")
def fedavg_cnn(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    channels: tuple[PosInt, PosInt] = (32, 64),
    hidden: PosInt = 512,
) -> FedModel:
    """PFLlib's ``FedAvgCNN``: two 5×5 convs (``channels``, no padding) with ReLU and 2×2 max-pool, FC
    ``hidden`` + ReLU (the embedding) | FC C. Biases everywhere, PyTorch's default initialisation (PFLlib
    sets none). 582,026 parameters on 1×28×28 with 10 classes; needs inputs of at least 12×12."""
    need_image(in_shape, "fedavg_cnn")
    c1, c2 = channels
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], c1, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = flat_dim(conv, in_shape, "fedavg_cnn", " (needs at least 12x12)")
    body = nn.Sequential(conv, nn.Linear(flat, hidden), nn.ReLU())
    return SplitModel(body, nn.Linear(hidden, num_classes), hidden)
