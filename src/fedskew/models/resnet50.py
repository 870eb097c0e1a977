"""ResNet-50 (He et al. 2016, "Deep Residual Learning for Image Recognition", Table 1): bottleneck blocks
[3, 4, 6, 3] behind the ImageNet stem, written from the paper (no torchvision).

CacheFL's FedAvg and FedProx baselines train it from scratch (Yi et al. 2025, Section 4.1, Table 1: "ResNet-50
trained from scratch", 500 rounds). Layout and attribute names follow torchvision's ``resnet50`` (``conv1,
bn1, layer1..layer4`` with ``conv1..conv3, bn1..bn3, downsample`` blocks, stride on the 3x3 convolution:
"ResNet v1.5"), so its parameter count is torchvision's 25,557,032 for 1000 classes; the linear head is
``classifier`` instead of ``fc``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.models.base import FedModel
from fedskew.models.zoo import Norm, PosInt, _model

#: bottleneck output width = EXPANSION x its inner width (He et al. 2016, Table 1)
EXPANSION = 4


def norm_factory(norm: str, groups: int) -> Callable[[int], nn.Module]:
    """``batch`` (BatchNorm) or ``group`` (GroupNorm with ``groups`` groups, robust to non-IID batches)."""
    table: dict[str, Callable[[int], nn.Module]] = {
        "batch": nn.BatchNorm2d,
        "group": lambda ch: nn.GroupNorm(groups, ch),
    }
    return table[norm]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by :data:`EXPANSION`, each with a norm; identity
    shortcut, or a strided 1x1 conv + norm when the shape changes (He et al. 2016, Fig. 5 right, option B)."""

    def __init__(self, cin: int, width: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        cout = width * EXPANSION
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = norm(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = norm(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = norm(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # not in-place: safe under torch.func transforms
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


class BottleneckResNet(FedModel):
    """7x7/2 conv + 3x3/2 max-pool stem, bottleneck stages (first stride 1, then 2); ``features`` is the
    globally average-pooled last stage (2048-d for ResNet-50)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        blocks: tuple[int, ...],
        widths: tuple[int, ...],
        norm: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = norm(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (width, n) in enumerate(zip(widths, blocks, strict=True)):
            stage = [Bottleneck(cin, width, 1 if i == 0 else 2, norm)]
            cin = width * EXPANSION
            stage += [Bottleneck(cin, width, 1, norm) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
        self.num_stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, num_classes)
        self.embed_dim = cin
        for m in self.modules():  # He et al. 2015 (fan-out) init of the convolutions, as torchvision
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def features(self, x: Tensor) -> Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return torch.flatten(self.avgpool(x), 1)

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


@_model("resnet50")
def resnet50(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: Norm = "batch",
    norm_groups: PosInt = 2,
) -> FedModel:
    """ResNet-50 (bottleneck [3,4,6,3], ImageNet stem, 224 px): CacheFL's from-scratch FedAvg/FedProx net.

    25,557,032 parameters for 1000 classes (torchvision's count); 23,712,932 for 100 classes (Caltech101,
    FGVCAircraft): CacheFL Section 4.2's "23.7 million parameters per round" of FedAvg. 2048-d embedding.
    ``norm='group'`` uses GroupNorm with ``norm_groups`` groups instead of BatchNorm. Small inputs run too
    (the stem and stages downsample 32x; e.g. 3x32x32 in tests).
    """
    if len(in_shape) != 3:
        raise ConfigError(f"model 'resnet50' needs 3-d inputs (C, H, W); got shape {tuple(in_shape)}")
    if norm == "group" and 64 % norm_groups:
        raise ConfigError(f"model 'resnet50' option 'norm_groups': {norm_groups} does not divide 64")
    return BottleneckResNet(
        in_shape[0],
        num_classes,
        blocks=(3, 4, 6, 3),
        widths=(64, 128, 256, 512),
        norm=norm_factory(norm, norm_groups),
    )
