"""Import ``open_clip`` without a working torchvision.

``open_clip`` imports torchvision at module level for two things: ``FrozenBatchNorm2d`` (``utils.py``,
used to freeze a ResNet's BatchNorm) and the PIL transform pipeline (``transform.py``). fedskew needs
neither of the transforms (it preprocesses tensors itself: resize + CLIP mean/std,
:func:`fedskew.models.backbones.to_backbone_input`), and the PyPI torchvision wheel cannot load with every
CPU torch build ("operator torchvision::nms does not exist"). When torchvision is absent or broken,
:func:`import_open_clip` puts a minimal stand-in under ``sys.modules['torchvision']`` for the duration of
the import: :class:`FrozenBatchNorm2d` (implemented here) and the transform names as classes that raise
a clear error when used. The stand-in is removed again after the import, so nothing else sees it.
"""

from __future__ import annotations

import enum
import sys
import types
import warnings
from importlib import metadata
from typing import Any

import torch
from torch import Tensor, nn

from fedskew.errors import ConfigError

TRANSFORM_NAMES = ("Normalize", "Compose", "RandomResizedCrop", "ToTensor", "Resize", "CenterCrop",
                   "ColorJitter", "Grayscale")  # fmt: skip
MESSAGE = "torchvision is not available: fedskew preprocesses image tensors itself (to_backbone_input)"
#: the open-clip-torch release the stand-in and the CLIP tests are run against (``make`` installs it); the
#: stand-in mirrors that release's torchvision imports, so another release is warned about, not refused
TESTED_OPEN_CLIP = "3.3."


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics and affine parameters (all buffers), as torchvision's."""

    weight: Tensor
    bias: Tensor
    running_mean: Tensor
    running_var: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        state_dict.pop(prefix + "num_batches_tracked", None)  # a BatchNorm2d's counter has no use here
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def _unavailable(name: str) -> type:
    def init(self: object, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"torchvision.transforms.{name}: {MESSAGE}")

    return type(name, (), {"__init__": init})


class _UnavailableModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{self.__name__}.{name}: {MESSAGE}")

        return fail


def stand_in_modules() -> dict[str, types.ModuleType]:
    """The minimal ``torchvision`` modules open_clip imports from."""
    root = types.ModuleType("torchvision")
    ops, misc = types.ModuleType("torchvision.ops"), types.ModuleType("torchvision.ops.misc")
    transforms = types.ModuleType("torchvision.transforms")
    functional = _UnavailableModule("torchvision.transforms.functional")
    misc.FrozenBatchNorm2d = FrozenBatchNorm2d  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    for name in TRANSFORM_NAMES:
        setattr(transforms, name, _unavailable(name))
    root.ops, ops.misc, root.transforms, transforms.functional = ops, misc, transforms, functional  # type: ignore[attr-defined]
    return {m.__name__: m for m in (root, ops, misc, transforms, functional)}


def torchvision_works() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a wheel built for another torch (RuntimeError at import)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def import_open_clip() -> types.ModuleType:
    """``import open_clip``, through the torchvision stand-in when torchvision cannot be imported."""
    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]
    if torchvision_works():
        return _import()
    shims = stand_in_modules()
    sys.modules.update(shims)
    try:
        return _import()
    finally:
        for name in shims:
            sys.modules.pop(name, None)


def _import() -> types.ModuleType:
    try:
        import open_clip
    except ImportError as err:
        raise ConfigError(
            f"backbone 'open_clip' needs the open-clip-torch package (pip install 'fedskew[clip]'): {err}"
        ) from None
    version = metadata.version("open-clip-torch")
    if not version.startswith(TESTED_OPEN_CLIP):
        warnings.warn(
            f"open-clip-torch {version} is untested with fedskew (tested: {TESTED_OPEN_CLIP}x)", stacklevel=3
        )
    return open_clip
