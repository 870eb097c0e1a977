"""Model zoo: parameter counts against the papers, the features/head split, input flexibility."""

from __future__ import annotations

import pytest
import torch

from fedskew.errors import ConfigError
from fedskew.models import MODELS, count_parameters

# (name, input shape, classes, options, parameter count, source)
COUNTS = [
    ("mlp_mpfedcl", (1, 28, 28), 10, {}, 798_474, "MP-FedCL spec: 784-512-512 | 512-256-10"),
    ("cnn_fedproto", (1, 28, 28), 10, {}, 21_840, "FedProto spec §4.4: 820 + 1051c, c=20"),
    ("cnn_fedproto", (1, 28, 28), 10, {"conv2_channels": 18}, 19_738, "FedProto-mh c=18"),
    ("cnn_fedproto", (1, 28, 28), 10, {"conv2_channels": 22}, 23_942, "FedProto-mh c=22"),
    ("cnn_fedproto", (1, 128, 128), 62, {"conv1_kernel": 3}, 849_332, "FedProto FEMNIST 3,312 + 42,301c"),
    ("cnn_mnist", (1, 28, 28), 10, {}, 1_663_370, "FedAvg paper CNN / FedEnt MNIST-CNN"),
    ("cnn_cifar", (3, 32, 32), 10, {}, 586_250, "FedEnt CIFAR10-CNN, recommended 32/64/64 channels"),
    ("lenet5", (1, 28, 28), 10, {}, 61_706, "LeNet-5 with padded first conv"),
    ("resnet18", (3, 32, 32), 10, {"stem": "imagenet"}, 11_181_642, "FedProto spec §4.4 ResNet18"),
]


@pytest.mark.parametrize(("name", "shape", "classes", "opts", "count", "source"), COUNTS)
def test_parameter_counts_match_the_papers(name, shape, classes, opts, count, source):
    assert count_parameters(MODELS.get(name)(shape, classes, **opts)) == count, source


ALL = [
    ("mlp_mpfedcl", (1, 8, 8)),
    ("cnn_mnist", (1, 8, 8)),
    ("lenet5", (1, 28, 28)),
    ("cnn_fedproto", (1, 28, 28)),
    ("cnn_cifar", (3, 32, 32)),
    ("resnet8", (3, 32, 32)),
    ("resnet18", (3, 32, 32)),
    ("vgg11", (3, 32, 32)),
]


@pytest.mark.parametrize(("name", "shape"), ALL)
def test_features_then_head_is_forward_and_head_split(name, shape):
    torch.manual_seed(0)
    model = MODELS.get(name)(shape, 7).eval()
    x = torch.randn(3, *shape)
    z = model.features(x)
    assert z.shape == (3, model.embed_dim)
    assert torch.allclose(model.head(z), model(x))
    assert model(x).shape == (3, 7)
    names = [n for n, _ in model.named_parameters()]
    head = [n for n in names if model.is_head(n)]
    assert head and len(head) < len(names)
    # the head is exactly what maps the embedding to logits
    assert sum(p.numel() for n, p in model.named_parameters() if model.is_head(n)) < count_parameters(model)


def test_heterogeneous_fedproto_variants_share_the_prototype_space():
    dims = {MODELS.get("cnn_fedproto")((1, 28, 28), 10, conv2_channels=c).embed_dim for c in (18, 20, 22)}
    assert dims == {50}


def test_resnet18_fedproto_strides_give_same_feature_size():
    a = MODELS.get("resnet18")((3, 32, 32), 10, stem="imagenet", conv1_stride=1, pool_stride=4).eval()
    b = MODELS.get("resnet18")((3, 32, 32), 10, stem="imagenet").eval()
    x = torch.randn(2, 3, 32, 32)
    assert a.stem(x).shape == b.stem(x).shape == (2, 64, 8, 8)


def test_bad_options_are_clear_errors():
    with pytest.raises(ConfigError, match="stem='vit' unknown; allowed: cifar, imagenet"):
        MODELS.get("resnet18")((3, 32, 32), 10, stem="vit")
    with pytest.raises(ConfigError, match="norm='layer' unknown"):
        MODELS.get("resnet8")((3, 32, 32), 10, norm="layer")
    with pytest.raises(ConfigError, match="needs 3-d inputs"):
        MODELS.get("cnn_mnist")((64,), 10)
