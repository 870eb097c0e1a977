"""FedBN's digit network (Li, Jiang, Zhang, Kamp, Dou 2021, "FedBN: Federated Learning on Non-IID Features
via Local Batch Normalization", ICLR; the ``DigitModel`` of its public code, Appendix C.1 of the paper).

Three 5x5 convolutions (64, 64, 128 channels, 'same' padding) each followed by BatchNorm and ReLU, max-pool
after the first two, then FC 2048 -> BN -> ReLU -> FC 512 -> BN -> ReLU | FC C. Every hidden layer has a
BatchNorm layer, which is the point of FedBN: those layers stay local. The widths are options so that a
CPU run can shrink the net (the layout, and so which layers FedBN keeps local, stays the same).
"""

from __future__ import annotations

from torch import nn

from fedskew.models.base import FedModel
from fedskew.models.zoo import PosInt, SplitModel, _flat_dim, _model, _need_image


@_model("cnn_fedbn")
def cnn_fedbn(
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    conv_channels: tuple[PosInt, PosInt, PosInt] = (64, 64, 128),
    fc_widths: tuple[PosInt, PosInt] = (2048, 512),
    batch_norm: bool = True,
) -> FedModel:
    """FedBN's ``DigitModel``: conv-BN-ReLU x3 (pool after two), FC-BN-ReLU x2 | FC C; 28x28 inputs give
    128·7·7 = 6,272 flattened features (14,219,210 parameters on 3x28x28, 10 classes). ``batch_norm=False``
    drops every BatchNorm layer (the same net for methods that average everything)."""
    _need_image(in_shape, "cnn_fedbn")
    c1, c2, c3 = conv_channels

    def norm2d(c: int) -> nn.Module:
        return nn.BatchNorm2d(c) if batch_norm else nn.Identity()

    def norm1d(c: int) -> nn.Module:
        return nn.BatchNorm1d(c) if batch_norm else nn.Identity()

    conv = nn.Sequential(
        nn.Conv2d(in_shape[0], c1, 5, padding=2),
        norm2d(c1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2),
        norm2d(c2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c2, c3, 5, padding=2),
        norm2d(c3),
        nn.ReLU(),
        nn.Flatten(),
    )
    flat = _flat_dim(conv, in_shape, "cnn_fedbn")
    f1, f2 = fc_widths
    body = nn.Sequential(
        conv, nn.Linear(flat, f1), norm1d(f1), nn.ReLU(), nn.Linear(f1, f2), norm1d(f2), nn.ReLU()
    )
    return SplitModel(body, nn.Linear(f2, num_classes), f2)
