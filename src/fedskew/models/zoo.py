"""The model zoo: the papers' networks as ``head(features(x))`` with the head under ``classifier.``.

Each factory has the signature ``factory(in_shape, num_classes, **options) -> FedModel``. Options are
keyword-only and typed; they are validated on every call (pydantic ``validate_call``), so an unknown or
out-of-range option is a one-line :class:`~fedskew.errors.ConfigError` that lists the allowed options.
Flatten sizes come from a dry run on ``in_shape``, so a name works on digits (1x8x8), MNIST (1x28x28),
FEMNIST (1x128x128) and CIFAR (3x32x32) wherever its pooling allows; too-small inputs are a ConfigError.
Parameter counts on the papers' inputs are pinned in ``tests/test_models.py`` and ``docs/models.md``.
"""

from __future__ import annotations

import math

from torch import nn

from fedskew.models.base import FedModel
from fedskew.models.factory import (
    NonNegInt,
    Norm,
    PosInt,
    Prob,
    SplitModel,
    flat_dim,
    need_image,
    registered_model,
)
from fedskew.models.resnets import BasicBlock, ResNet, resnet8, resnet18

#: the names this module had before the split (issue 53), still importable from it
__all__ = ["BasicBlock", "NonNegInt", "Norm", "PosInt", "Prob", "ResNet", "SplitModel", "resnet8", "resnet18"]
#: resnet50.py and fedbn_cnn.py import these under their former private names
_model, _need_image, _flat_dim = registered_model, need_image, flat_dim


# ------------------------------------------------------------------------------------ small models
@registered_model("mlp_mpfedcl")
def mlp_mpfedcl(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden: PosInt = 512,
    embed_dim: PosInt = 256,
    normalize: bool = False,
    relu_logits: bool = False,
    encoder: bool = True,
) -> FedModel:
    """MP-FedCL's MNIST MLP (Table III): FC 784-512-512-256 (ReLU) -> 256-d embedding | FC 256-C.

    798,474 parameters on MNIST (= the paper's Table II). The embedding is the 256-d input of the decision
    layer, as the prototype sizes K*C*256 of Table II imply. ``normalize`` L2-normalises it (not in the
    paper; FedPCL's head does it, see docs/methods/mpfedcl.md, "MP-FedCL: embedding normalisation");
    ``relu_logits`` applies Table III's literal ReLU to the logits. ``encoder=False`` keeps only the MLP
    (FC d-256 | FC 256-C: 133,898 parameters on 512-d inputs), the trained part on top of a frozen ResNet-18
    (``data.frozen_encoder``; Table II counts only these parameters).
    """
    d = math.prod(in_shape)
    fc_encoder = [nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()] if encoder else []
    body = nn.Sequential(nn.Flatten(), *fc_encoder, nn.Linear(hidden if encoder else d, embed_dim), nn.ReLU())
    head: nn.Module = nn.Linear(embed_dim, num_classes)
    if relu_logits:
        head = nn.Sequential(head, nn.ReLU())
    return SplitModel(body, head, embed_dim, normalize)


@registered_model("cnn_fedproto")
def cnn_fedproto(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    conv2_channels: PosInt = 20,
    conv1_kernel: PosInt = 5,
    padding: NonNegInt = 0,
    embed_dim: PosInt = 50,
    dropout: Prob = 0.5,
) -> FedModel:
    """FedProto's MNIST/FEMNIST CNN (authors' code): conv 10, conv c + Dropout2d, fc -> 50-d prototype.

    Parameters: 820 + 1051c on MNIST (21,840 for c = 20); 849,332 on FEMNIST 128x128 with
    ``conv1_kernel=3``. FedProto-mh varies ``conv2_channels`` (18/20/22); the 50-d embedding and the head
    stay the same. ``padding`` (both convs; 0 in the paper) lets the net run on 8x8 digits (``padding=2``).
    """
    need_image(in_shape, "cnn_fedproto")
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], 10, conv1_kernel, padding=padding),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Conv2d(10, conv2_channels, 5, padding=padding),
        nn.Dropout2d(dropout),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Flatten(),
    )
    flat = flat_dim(conv, in_shape, "cnn_fedproto", " (padding=2 fits 8x8 inputs)")
    body = nn.Sequential(conv, nn.Linear(flat, embed_dim), nn.ReLU())
    # FedProto's code ends in log_softmax; we return logits and the loss applies it (same NLL).
    head = nn.Sequential(nn.Dropout(dropout), nn.Linear(embed_dim, num_classes))
    return SplitModel(body, head, embed_dim)


@registered_model("cnn_mnist")
def cnn_mnist(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    dropout1: Prob = 0.25,
    dropout2: Prob = 0.5,
    padding: NonNegInt = 2,
) -> FedModel:
    """The FedAvg paper's MNIST CNN = FedEnt's MNIST-CNN (FedEnt §6.1.2): 1,663,370 params on MNIST.

    5x5 conv 32 ('same') -> 2x2 max-pool -> 5x5 conv 64 -> pool -> FC 512 (the embedding) | FC C. FedEnt
    names two dropout layers without rates; 0.25/0.5 are our choice (docs/decisions.md, "FedEnt: model
    details the paper leaves open"); set both to 0 for the FedAvg paper's literal net. ``padding=0`` with no
    dropout is the EMNIST CNN used for FedSKC, whose paper says only "multi-layers CNN" (FC 1024 -> 512 -> 47;
    docs/methods/fedskc.md, "FedSKC: EMNIST CNN").
    """
    need_image(in_shape, "cnn_mnist")
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], 32, 5, padding=padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = flat_dim(conv, in_shape, "cnn_mnist")
    body = nn.Sequential(conv, nn.Dropout(dropout1), nn.Linear(flat, 512), nn.ReLU())
    head = nn.Sequential(nn.Dropout(dropout2), nn.Linear(512, num_classes))
    return SplitModel(body, head, 512)


@registered_model("cnn_cifar")
def cnn_cifar(
    in_shape: tuple[int, ...], num_classes: int, *, dropout1: Prob = 0.25, dropout2: Prob = 0.5
) -> FedModel:
    """FedEnt's CIFAR10-CNN (FedEnt §6.1.2): 3x (3x3 conv 'same' + pool), FC 512 | FC C; 586,250 params.

    The paper gives three convs and a 4x4x64 flatten but no widths; 32/64/64 channels and dropout
    0.25/0.5 are our choice (docs/methods/fedent.md, "FedEnt: model details the paper leaves open").
    """
    need_image(in_shape, "cnn_cifar")
    layers: list[nn.Module] = []
    c = in_shape[0]
    for width in (32, 64, 64):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c = width
    conv = nn.Sequential(*layers, nn.Flatten())
    flat = flat_dim(conv, in_shape, "cnn_cifar")
    body = nn.Sequential(conv, nn.Dropout(dropout1), nn.Linear(flat, 512), nn.ReLU())
    head = nn.Sequential(nn.Dropout(dropout2), nn.Linear(512, num_classes))
    return SplitModel(body, head, 512)


@registered_model("lenet5")
def lenet5(in_shape: tuple[int, ...], num_classes: int, *, padding: NonNegInt | None = None) -> FedModel:
    """LeNet-5 (LeCun et al. 1998; FedEnt's EMNIST-L net, FedEnt §6.1.2): 6@5x5, 16@5x5, 120, 84 | C.

    ``padding`` pads the first conv; by default just enough to give it its native 32x32 frame (2 on MNIST's
    28x28, 0 on CIFAR), so the net and its 61,706 parameters (10 classes) are the same on any input up to
    32x32. The embedding is the 84-d layer.
    """
    need_image(in_shape, "lenet5")
    if padding is None:
        padding = max(0, math.ceil((32 - min(in_shape[1:])) / 2))
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], 6, 5, padding=padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = flat_dim(conv, in_shape, "lenet5")
    body = nn.Sequential(conv, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
    return SplitModel(body, nn.Linear(84, num_classes), 84)


@registered_model("vgg11")
def vgg11(
    in_shape: tuple[int, ...], num_classes: int, *, batch_norm: bool = True, dropout: Prob = 0.5
) -> FedModel:
    """VGG-11 for 32x32 inputs (Simonyan & Zisserman 2015), FedEnt's CIFAR-100 net (FedEnt §6.1.2).

    Convs [64,M,128,M,256,256,M,512,512,M,512,512,M] (3x3, pad 1, + BN by default) -> 1x1x512, then the
    common CIFAR classifier Dropout-FC512-ReLU-Dropout-FC512-ReLU (the 512-d embedding) | FC C.
    ``batch_norm=False`` makes every state entry a trained weight, which suits FedEnt's norm-based entropy
    term; the FedEnt configs use it (docs/methods/fedent.md, "FedEnt: model details the paper leaves open").
    """
    need_image(in_shape, "vgg11")
    layers: list[nn.Module] = []
    c = in_shape[0]
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        width = int(v)
        layers.append(nn.Conv2d(c, width, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(width))
        layers.append(nn.ReLU())
        c = width
    conv = nn.Sequential(*layers, nn.Flatten())
    flat = flat_dim(conv, in_shape, "vgg11")
    body = nn.Sequential(
        conv, nn.Dropout(dropout), nn.Linear(flat, 512), nn.ReLU(), nn.Dropout(dropout), nn.Linear(512, 512)
    )
    body.append(nn.ReLU())
    return SplitModel(body, nn.Linear(512, num_classes), 512)
