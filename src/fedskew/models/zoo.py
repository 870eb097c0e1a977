"""The model zoo: the papers' networks as ``head(features(x))`` with the head under ``classifier.``.

Each factory has the signature ``factory(in_shape, num_classes, **options) -> FedModel``. Options are
keyword-only and typed; they are validated on every call (pydantic ``validate_call``), so an unknown or
out-of-range option is a one-line :class:`~fedskew.errors.ConfigError` that lists the allowed options.
Flatten sizes come from a dry run on ``in_shape``, so a name works on digits (1x8x8), MNIST (1x28x28),
FEMNIST (1x128x128) and CIFAR (3x32x32) wherever its pooling allows; too-small inputs are a ConfigError.
Parameter counts on the papers' inputs are pinned in ``tests/test_models.py`` and ``docs/models.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationError, validate_call
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.models.base import MODELS, FedModel
from fedskew.registry import check_options

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Prob = Annotated[float, Field(ge=0.0, lt=1.0)]
Norm = Literal["batch", "group"]


# ------------------------------------------------------------------------------------------ plumbing
def _model(name: str) -> Callable[[Callable[..., FedModel]], Callable[..., FedModel]]:
    """Register ``fn`` under ``name``; type-check its options and turn bad ones into ConfigError.

    The wrapper keeps ``fn``'s signature (``__wrapped__``) so that config validation, which inspects it,
    sees the real option names.
    """

    def deco(fn: Callable[..., FedModel]) -> Callable[..., FedModel]:
        checked = validate_call(fn)

        @functools.wraps(fn)
        def factory(in_shape: tuple[int, ...], num_classes: int, **options: Any) -> FedModel:
            check_options(fn, options, f"model '{name}': unknown option '{{key}}'", skip=2)
            try:
                return checked(tuple(in_shape), num_classes, **options)
            except ValidationError as err:
                e = err.errors()[0]
                where = ".".join(str(p) for p in e["loc"])
                raise ConfigError(
                    f"model '{name}' option '{where}': {e['msg']} (got {e.get('input')!r})"
                ) from None

        MODELS.register(name)(factory)
        return factory

    return deco


def _need_image(in_shape: tuple[int, ...], name: str) -> None:
    if len(in_shape) != 3:
        raise ConfigError(f"model '{name}' needs 3-d inputs (C, H, W); got shape {tuple(in_shape)}")


def _flat_dim(body: nn.Module, in_shape: tuple[int, ...], name: str, hint: str = "") -> int:
    """Output size of ``body`` on one zero input (a dry run: no shape arithmetic to get wrong)."""
    was = body.training
    body.eval()
    try:
        with torch.no_grad():
            n = int(body(torch.zeros(1, *in_shape)).numel())
    except RuntimeError as err:  # conv/pool output size < 1
        reason = str(err).splitlines()[0]
        raise ConfigError(
            f"model '{name}' cannot take inputs of shape {tuple(in_shape)}{hint}: {reason}"
        ) from None
    finally:
        body.train(was)
    return n


class SplitModel(FedModel):
    """A model given as ``body`` (input -> embedding) and ``classifier`` (embedding -> logits)."""

    def __init__(self, body: nn.Module, classifier: nn.Module, embed_dim: int, normalize: bool = False):
        super().__init__()
        self.body = body
        self.classifier = classifier
        self.embed_dim = embed_dim
        self.normalize = normalize

    def features(self, x: Tensor) -> Tensor:
        z = self.body(x)
        return F.normalize(z, dim=1) if self.normalize else z

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


# ------------------------------------------------------------------------------------ small models
@_model("mlp_mpfedcl")
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
    paper; FedPCL's head does it, see docs/decisions.md, "MP-FedCL: embedding normalisation");
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


@_model("cnn_fedproto")
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
    _need_image(in_shape, "cnn_fedproto")
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
    flat = _flat_dim(conv, in_shape, "cnn_fedproto", " (padding=2 fits 8x8 inputs)")
    body = nn.Sequential(conv, nn.Linear(flat, embed_dim), nn.ReLU())
    # FedProto's code ends in log_softmax; we return logits and the loss applies it (same NLL).
    head = nn.Sequential(nn.Dropout(dropout), nn.Linear(embed_dim, num_classes))
    return SplitModel(body, head, embed_dim)


@_model("cnn_mnist")
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
    docs/decisions.md, "FedSKC: EMNIST CNN").
    """
    _need_image(in_shape, "cnn_mnist")
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], 32, 5, padding=padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_dim(conv, in_shape, "cnn_mnist")
    body = nn.Sequential(conv, nn.Dropout(dropout1), nn.Linear(flat, 512), nn.ReLU())
    head = nn.Sequential(nn.Dropout(dropout2), nn.Linear(512, num_classes))
    return SplitModel(body, head, 512)


@_model("cnn_cifar")
def cnn_cifar(
    in_shape: tuple[int, ...], num_classes: int, *, dropout1: Prob = 0.25, dropout2: Prob = 0.5
) -> FedModel:
    """FedEnt's CIFAR10-CNN (FedEnt §6.1.2): 3x (3x3 conv 'same' + pool), FC 512 | FC C; 586,250 params.

    The paper gives three convs and a 4x4x64 flatten but no widths; 32/64/64 channels and dropout
    0.25/0.5 are our choice (docs/decisions.md, "FedEnt: model details the paper leaves open").
    """
    _need_image(in_shape, "cnn_cifar")
    layers: list[nn.Module] = []
    c = in_shape[0]
    for width in (32, 64, 64):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c = width
    conv = nn.Sequential(*layers, nn.Flatten())
    flat = _flat_dim(conv, in_shape, "cnn_cifar")
    body = nn.Sequential(conv, nn.Dropout(dropout1), nn.Linear(flat, 512), nn.ReLU())
    head = nn.Sequential(nn.Dropout(dropout2), nn.Linear(512, num_classes))
    return SplitModel(body, head, 512)


@_model("lenet5")
def lenet5(in_shape: tuple[int, ...], num_classes: int, *, padding: NonNegInt | None = None) -> FedModel:
    """LeNet-5 (LeCun et al. 1998; FedEnt's EMNIST-L net, FedEnt §6.1.2): 6@5x5, 16@5x5, 120, 84 | C.

    ``padding`` pads the first conv; by default just enough to give it its native 32x32 frame (2 on MNIST's
    28x28, 0 on CIFAR), so the net and its 61,706 parameters (10 classes) are the same on any input up to
    32x32. The embedding is the 84-d layer.
    """
    _need_image(in_shape, "lenet5")
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
    flat = _flat_dim(conv, in_shape, "lenet5")
    body = nn.Sequential(conv, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
    return SplitModel(body, nn.Linear(84, num_classes), 84)


@_model("vgg11")
def vgg11(
    in_shape: tuple[int, ...], num_classes: int, *, batch_norm: bool = True, dropout: Prob = 0.5
) -> FedModel:
    """VGG-11 for 32x32 inputs (Simonyan & Zisserman 2015), FedEnt's CIFAR-100 net (FedEnt §6.1.2).

    Convs [64,M,128,M,256,256,M,512,512,M,512,512,M] (3x3, pad 1, + BN by default) -> 1x1x512, then the
    common CIFAR classifier Dropout-FC512-ReLU-Dropout-FC512-ReLU (the 512-d embedding) | FC C.
    ``batch_norm=False`` makes every state entry a trained weight, which suits FedEnt's norm-based entropy
    term; the FedEnt configs use it (docs/decisions.md, "FedEnt: model details the paper leaves open").
    """
    _need_image(in_shape, "vgg11")
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
    flat = _flat_dim(conv, in_shape, "vgg11")
    body = nn.Sequential(
        conv, nn.Dropout(dropout), nn.Linear(flat, 512), nn.ReLU(), nn.Dropout(dropout), nn.Linear(512, 512)
    )
    body.append(nn.ReLU())
    return SplitModel(body, nn.Linear(512, num_classes), 512)


# -------------------------------------------------------------------------------------------- ResNets
def _norm_layer(norm: str, groups: int) -> Callable[[int], nn.Module]:
    """``norm`` -> a ``channels -> module`` factory. GroupNorm avoids BatchNorm's non-IID statistics
    problem in FL (Hsieh et al. 2020, who use 2 groups)."""
    table: dict[str, Callable[[int], nn.Module]] = {
        "batch": nn.BatchNorm2d,
        "group": lambda ch: nn.GroupNorm(groups, ch),
    }
    return table[norm]


class BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2016): two 3x3 convs; 1x1 conv + norm shortcut when shapes change.

    Attribute names follow torchvision (``conv1, bn1, conv2, bn2, downsample``) so its weights load by key.
    """

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # not in-place: safe under torch.func transforms
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class ResNet(FedModel):
    """A BasicBlock ResNet; ``features`` is the globally average-pooled last stage.

    Layout and names match torchvision (``conv1, bn1, maxpool, layer1..layerN``) except that the linear
    head is ``classifier`` instead of ``fc``: rename ``fc.*`` (or drop it) to load torchvision weights.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        stem_kernel: int,
        stem_stride: int,
        pool_stride: int | None,
        widths: tuple[int, ...],
        blocks: tuple[int, ...],
        norm: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], stem_kernel, stem_stride, stem_kernel // 2, bias=False)
        self.bn1 = norm(widths[0])
        self.maxpool: nn.Module = nn.Identity() if pool_stride is None else nn.MaxPool2d(3, pool_stride, 1)
        cin = widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks, strict=True)):
            stride = 1 if i == 0 else 2
            stage = [BasicBlock(cin, width, stride, norm)]
            stage += [BasicBlock(width, width, 1, norm) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
            cin = width
        self.num_stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, num_classes)
        self.embed_dim = cin
        # Kaiming fan-out = FedSKC's normal(0, sqrt(2 / (k*k*out))) and torchvision's init.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def stem(self, x: Tensor) -> Tensor:
        return self.maxpool(F.relu(self.bn1(self.conv1(x))))

    def features(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return torch.flatten(self.avgpool(x), 1)

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


def _check_groups(name: str, norm: str, groups: int, min_width: int) -> None:
    # every stage width is min_width * 2^k, so dividing the first one is enough
    if norm == "group" and min_width % groups:
        raise ConfigError(
            f"model '{name}' option 'norm_groups': {groups} does not divide the stem width {min_width}"
        )


@_model("resnet8")
def resnet8(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    width: PosInt = 64,
    norm: Norm = "batch",
    norm_groups: PosInt = 2,
) -> FedModel:
    """FedSKC's ResNet-8: 3x3 stem, 3 stages x 1 BasicBlock, widths 64/128/256, BN.

    The paper names ResNet-8 without details (docs/decisions.md, "FedSKC: ResNet-8 architecture").
    1,227,594 parameters on CIFAR-10 with the public code's width 64 (``ResNet_cifar(8, scaling=4)``);
    ``width=16`` is the classic 16/32/64 net. Embedding: the pooled ``4*width``-d last stage.
    """
    _need_image(in_shape, "resnet8")
    _check_groups("resnet8", norm, norm_groups, width)
    return ResNet(
        in_shape[0],
        num_classes,
        stem_kernel=3,
        stem_stride=1,
        pool_stride=None,
        widths=(width, 2 * width, 4 * width),
        blocks=(1, 1, 1),
        norm=_norm_layer(norm, norm_groups),
    )


@_model("resnet18")
def resnet18(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    stem: Literal["cifar", "imagenet"] = "cifar",
    conv1_stride: PosInt | None = None,
    pool_stride: PosInt | None = None,
    norm: Norm = "batch",
    norm_groups: PosInt = 2,
) -> FedModel:
    """ResNet-18 (BasicBlock [2,2,2,2], He et al. 2016) with a 'cifar' or 'imagenet' stem; 512-d embedding.

    ``stem='cifar'``: 3x3 conv stride 1, no max-pool (11,173,962 params, 10 classes). ``stem='imagenet'``:
    torchvision's 7x7 conv stride ``conv1_stride`` (default 2) + 3x3 max-pool stride ``pool_stride``
    (default 2), 11,181,642 params: FedProto's CIFAR net, whose FedProto-mh clients use (1, 4) (the
    authors' code; the paper says only that the strides differ across clients).
    """
    _need_image(in_shape, "resnet18")
    _check_groups("resnet18", norm, norm_groups, 64)
    if stem == "cifar" and (conv1_stride is not None or pool_stride is not None):
        raise ConfigError("model 'resnet18': options conv1_stride and pool_stride need stem='imagenet'")
    imagenet = stem == "imagenet"
    return ResNet(
        in_shape[0],
        num_classes,
        stem_kernel=7 if imagenet else 3,
        stem_stride=(conv1_stride or 2) if imagenet else 1,
        pool_stride=(pool_stride or 2) if imagenet else None,
        widths=(64, 128, 256, 512),
        blocks=(2, 2, 2, 2),
        norm=_norm_layer(norm, norm_groups),
    )
