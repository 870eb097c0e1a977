"""The BasicBlock ResNets (He et al. 2016): ResNet-8 and ResNet-18, torchvision's layout and names with the
head under ``classifier.``. Split from ``zoo.py`` (issue 53); ``fedskew.models.zoo`` re-exports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.models.base import FedModel
from fedskew.models.factory import Norm, PosInt, need_image, registered_model


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


@registered_model("resnet8")
def resnet8(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    width: PosInt = 64,
    norm: Norm = "batch",
    norm_groups: PosInt = 2,
) -> FedModel:
    """FedSKC's ResNet-8: 3x3 stem, 3 stages x 1 BasicBlock, widths 64/128/256, BN.

    The paper names ResNet-8 without details (docs/methods/fedskc.md, "FedSKC: ResNet-8 architecture").
    1,227,594 parameters on CIFAR-10 with the public code's width 64 (``ResNet_cifar(8, scaling=4)``);
    ``width=16`` is the classic 16/32/64 net. Embedding: the pooled ``4*width``-d last stage.
    """
    need_image(in_shape, "resnet8")
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


@registered_model("resnet18")
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
    need_image(in_shape, "resnet18")
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
