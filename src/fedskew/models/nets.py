"""The model zoo. Every model is ``head(features(x))``; head parameters live under ``classifier.``.

Flatten sizes are computed from ``in_shape`` with a dry run, so each model works on digits (1x8x8),
MNIST (1x28x28), FEMNIST (1x128x128) and CIFAR (3x32x32) inputs where its pooling allows.
Parameter counts on the papers' inputs are tested in ``tests/test_models.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.models.base import MODELS, FedModel


def _flat_dim(body: nn.Module, in_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        was = body.training
        body.eval()
        n = int(body(torch.zeros(1, *in_shape)).numel())
        body.train(was)
    return n


def _need_rank(in_shape: tuple[int, ...], rank: int, name: str) -> None:
    if len(in_shape) != rank:
        raise ConfigError(f"model '{name}' needs {rank}-d inputs (C, H, W); got shape {tuple(in_shape)}")


class _Sequential(FedModel):
    """A model given as body (-> embedding) and classifier modules."""

    def __init__(self, body: nn.Module, classifier: nn.Module, embed_dim: int) -> None:
        super().__init__()
        self.body = body
        self.classifier = classifier
        self.embed_dim = embed_dim

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


@MODELS.register("mlp_mpfedcl")
def mlp_mpfedcl(
    in_shape: tuple[int, ...], num_classes: int, *, hidden: int = 512, head_hidden: int = 256
) -> FedModel:
    """MP-FedCL's MLP: features 784-512-512 (ReLU), head 512-256-C; 798,474 parameters on MNIST."""
    d = 1
    for s in in_shape:
        d *= s
    body = nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
    head = nn.Sequential(nn.Linear(hidden, head_hidden), nn.ReLU(), nn.Linear(head_hidden, num_classes))
    return _Sequential(body, head, hidden)


@MODELS.register("cnn_fedproto")
def cnn_fedproto(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    conv2_channels: int = 20,
    conv1_kernel: int = 5,
    embed_dim: int = 50,
    dropout: float = 0.5,
) -> FedModel:
    """FedProto's MNIST/FEMNIST CNN (spec §4.4): conv 10, conv c + Dropout2d, fc -> 50-d prototype space."""
    _need_rank(in_shape, 3, "cnn_fedproto")
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], 10, conv1_kernel),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Conv2d(10, conv2_channels, 5),
        nn.Dropout2d(dropout),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Flatten(),
    )
    flat = _flat_dim(conv, in_shape)
    body = nn.Sequential(conv, nn.Linear(flat, embed_dim), nn.ReLU())
    head = nn.Sequential(nn.Dropout(dropout), nn.Linear(embed_dim, num_classes))
    return _Sequential(body, head, embed_dim)


@MODELS.register("cnn_mnist")
def cnn_mnist(
    in_shape: tuple[int, ...], num_classes: int, *, dropout1: float = 0.25, dropout2: float = 0.5
) -> FedModel:
    """The FedAvg paper's MNIST CNN (FedEnt's MNIST-CNN, spec fedent §5): 1,663,370 parameters on MNIST."""
    _need_rank(in_shape, 3, "cnn_mnist")
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_dim(conv, in_shape)
    body = nn.Sequential(conv, nn.Dropout(dropout1), nn.Linear(flat, 512), nn.ReLU())
    head = nn.Sequential(nn.Dropout(dropout2), nn.Linear(512, num_classes))
    return _Sequential(body, head, 512)


@MODELS.register("cnn_cifar")
def cnn_cifar(
    in_shape: tuple[int, ...], num_classes: int, *, dropout1: float = 0.25, dropout2: float = 0.5
) -> FedModel:
    """FedEnt's CIFAR10-CNN (spec fedent §5, channels 32/64/64 as recommended): 586,250 params on CIFAR-10."""
    _need_rank(in_shape, 3, "cnn_cifar")
    layers: list[nn.Module] = []
    c = in_shape[0]
    for width in (32, 64, 64):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c = width
    conv = nn.Sequential(*layers, nn.Flatten())
    flat = _flat_dim(conv, in_shape)
    body = nn.Sequential(conv, nn.Dropout(dropout1), nn.Linear(flat, 512), nn.ReLU())
    head = nn.Sequential(nn.Dropout(dropout2), nn.Linear(512, num_classes))
    return _Sequential(body, head, 512)


@MODELS.register("lenet5")
def lenet5(in_shape: tuple[int, ...], num_classes: int) -> FedModel:
    """LeNet-5 (LeCun et al. 1998; FedEnt's EMNIST-L variant): 6@5x5 (pad 2), 16@5x5, 120, 84 | C."""
    _need_rank(in_shape, 3, "lenet5")
    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_dim(conv, in_shape)
    body = nn.Sequential(conv, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
    return _Sequential(body, nn.Linear(84, num_classes), 84)


# ---------------------------------------------------------------------------- ResNets
def _norm(kind: str, channels: int) -> nn.Module:
    factories: dict[str, Callable[[int], nn.Module]] = {
        "batch": nn.BatchNorm2d,
        "group": lambda ch: nn.GroupNorm(min(32, ch // 2) if ch >= 4 else 1, ch),
    }
    if kind not in factories:
        raise ConfigError(f"model option norm='{kind}' unknown; allowed: {', '.join(factories)}")
    return factories[kind](channels)


class BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2016): two 3x3 convs with a projection shortcut when shapes change."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(FedModel):
    """A ResNet with a configurable stem; features are the globally pooled last stage."""

    def __init__(
        self,
        stem: nn.Module,
        stem_out: int,
        widths: tuple[int, ...],
        blocks: tuple[int, ...],
        strides: tuple[int, ...],
        num_classes: int,
        norm: str,
    ) -> None:
        super().__init__()
        self.stem = stem
        stages: list[nn.Module] = []
        cin = stem_out
        for width, n, stride in zip(widths, blocks, strides, strict=True):
            layers = [BasicBlock(cin, width, stride, norm)]
            layers += [BasicBlock(width, width, 1, norm) for _ in range(n - 1)]
            stages.append(nn.Sequential(*layers))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, num_classes)
        self.embed_dim = cin
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def features(self, x: Tensor) -> Tensor:
        return torch.flatten(self.pool(self.stages(self.stem(x))), 1)

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


@MODELS.register("resnet8")
def resnet8(in_shape: tuple[int, ...], num_classes: int, *, width: int = 64, norm: str = "batch") -> FedModel:
    """FedSKC's ResNet-8 (spec fedskc X1): 3x3 stem, 3 stages of one BasicBlock, widths 64/128/256."""
    _need_rank(in_shape, 3, "resnet8")
    stem = nn.Sequential(nn.Conv2d(in_shape[0], width, 3, 1, 1, bias=False), _norm(norm, width), nn.ReLU())
    return ResNet(stem, width, (width, 2 * width, 4 * width), (1, 1, 1), (1, 2, 2), num_classes, norm)


@MODELS.register("resnet18")
def resnet18(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    stem: str = "cifar",
    conv1_stride: int = 2,
    pool_stride: int = 2,
    norm: str = "batch",
) -> FedModel:
    """ResNet-18 (BasicBlock [2,2,2,2]) with a 'cifar' or 'imagenet' stem; 11,181,642 params (imagenet, 10).

    ``stem='cifar'``: 3x3 conv, no pool. ``stem='imagenet'``: 7x7 conv stride ``conv1_stride`` + max-pool
    stride ``pool_stride``: FedProto's (2, 2) and its heterogeneous (1, 4) variant (spec fedproto §4.4).
    """
    _need_rank(in_shape, 3, "resnet18")
    c = in_shape[0]
    stems: dict[str, Callable[[], nn.Module]] = {
        "cifar": lambda: nn.Sequential(nn.Conv2d(c, 64, 3, 1, 1, bias=False), _norm(norm, 64), nn.ReLU()),
        "imagenet": lambda: nn.Sequential(
            nn.Conv2d(c, 64, 7, conv1_stride, 3, bias=False),
            _norm(norm, 64),
            nn.ReLU(),
            nn.MaxPool2d(3, pool_stride, 1),
        ),
    }
    if stem not in stems:
        raise ConfigError(f"model option stem='{stem}' unknown; allowed: {', '.join(stems)}")
    return ResNet(stems[stem](), 64, (64, 128, 256, 512), (2, 2, 2, 2), (1, 2, 2, 2), num_classes, norm)


@MODELS.register("vgg11")
def vgg11(
    in_shape: tuple[int, ...], num_classes: int, *, batch_norm: bool = True, dropout: float = 0.5
) -> FedModel:
    """VGG-11 for 32x32 inputs (Simonyan & Zisserman; spec fedent's CIFAR variant): 512-512 classifier."""
    _need_rank(in_shape, 3, "vgg11")
    layers: list[nn.Module] = []
    c = in_shape[0]
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        layers += [nn.Conv2d(c, int(v), 3, padding=1)]
        layers += [nn.BatchNorm2d(int(v))] if batch_norm else []
        layers += [nn.ReLU(inplace=True)]
        c = int(v)
    conv = nn.Sequential(*layers, nn.Flatten())
    flat = _flat_dim(conv, in_shape)
    body = nn.Sequential(conv, nn.Dropout(dropout), nn.Linear(flat, 512), nn.ReLU(), nn.Dropout(dropout))
    body.append(nn.Linear(512, 512))
    body.append(nn.ReLU())
    return _Sequential(body, nn.Linear(512, num_classes), 512)
