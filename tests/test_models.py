"""Model zoo: parameter counts against the papers, the features/head contract, inputs, option errors."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from fedskew.errors import ConfigError
from fedskew.models import MODELS, count_parameters

EXPECTED_NAMES = {
    "mlp_mpfedcl", "cnn_fedproto", "cnn_mnist", "cnn_cifar", "lenet5", "resnet8", "resnet18", "vgg11",
    "identity", "cnn_fedbn", "resnet50", "fedavg_cnn",
}  # fmt: skip

# (name, input shape, classes, options, parameter count, source of the number)
COUNTS = [
    ("mlp_mpfedcl", (1, 28, 28), 10, {}, 798_474, "MP-FedCL Table II/III: 784-512-512-256-10"),
    ("cnn_fedproto", (1, 28, 28), 10, {}, 21_840, "FedProto CNN: 820 + 1051c, c=20"),
    ("cnn_fedproto", (1, 28, 28), 10, {"conv2_channels": 18}, 19_738, "FedProto-mh c=18"),
    ("cnn_fedproto", (1, 28, 28), 10, {"conv2_channels": 22}, 23_942, "FedProto-mh c=22"),
    ("cnn_fedproto", (1, 128, 128), 62, {"conv1_kernel": 3}, 849_332, "FedProto FEMNIST 3,312 + 42,301c"),
    ("cnn_mnist", (1, 28, 28), 10, {}, 1_663_370, "FedAvg paper CNN / FedEnt MNIST-CNN"),
    ("cnn_cifar", (3, 32, 32), 10, {}, 586_250, "FedEnt CIFAR10-CNN, 32/64/64 channels"),
    ("lenet5", (1, 28, 28), 10, {}, 61_706, "LeNet-5: 156 + 2,416 + 48,120 + 10,164 + 850"),
    ("lenet5", (1, 8, 8), 10, {}, 61_706, "LeNet-5 padded to its 32x32 frame: same net on digits"),
    ("resnet50", (3, 224, 224), 1000, {}, 25_557_032, "He et al. 2016 Table 1 = torchvision's ResNet-50"),
    ("resnet8", (3, 32, 32), 10, {}, 1_227_594, "FedSKC's public code ResNet_cifar(8, scaling=4)"),
    ("resnet18", (3, 32, 32), 10, {"stem": "imagenet"}, 11_181_642, "FedProto ResNet18, ImageNet stem"),
    ("resnet18", (3, 32, 32), 10, {}, 11_181_642 - 64 * 3 * (49 - 9), "CIFAR stem: 3x3 instead of 7x7"),
    ("vgg11", (3, 32, 32), 100, {"batch_norm": False}, 9_797_092, "FedEnt CIFAR-100 VGG-11 (no BN)"),
    ("cnn_fedbn", (3, 28, 28), 10, {}, 14_219_210, "FedBN DigitModel: convs + FC 6,272-2,048-512-10 + BN"),
    ("cnn_fedbn", (3, 28, 28), 10, {"batch_norm": False}, 14_219_210 - 2 * (64 + 64 + 128 + 2048 + 512),
     "FedBN DigitModel without its BN layers"),
    ("vgg11", (3, 32, 32), 100, {}, 9_797_092 + 2 * (64 + 128 + 2 * 256 + 4 * 512), "VGG-11 + BN"),
]


def test_registry_names_are_the_public_ones():
    assert set(MODELS.names()) == EXPECTED_NAMES


@pytest.mark.parametrize(("name", "shape", "classes", "opts", "count", "source"), COUNTS)
def test_parameter_counts_match_the_papers(name, shape, classes, opts, count, source):
    assert count_parameters(MODELS.get(name)(shape, classes, **opts)) == count, source


def test_cnn_fedproto_count_is_linear_in_conv2_channels():
    # FedProto's CNN: 820 + 1051c on MNIST, 3,312 + 42,301c on FEMNIST 128x128
    for c in (1, 7, 20):
        assert (
            count_parameters(MODELS.get("cnn_fedproto")((1, 28, 28), 10, conv2_channels=c)) == 820 + 1051 * c
        )
        femnist = MODELS.get("cnn_fedproto")((1, 128, 128), 62, conv2_channels=c, conv1_kernel=3)
        assert count_parameters(femnist) == 3312 + 42301 * c


# (name, input shape, options, embedding size); the small models also run on digits-sized 1x8x8 input
SHAPES = [
    ("mlp_mpfedcl", (1, 8, 8), {}, 256),
    ("mlp_mpfedcl", (1, 28, 28), {}, 256),
    ("cnn_fedproto", (1, 8, 8), {"padding": 2}, 50),
    ("cnn_fedproto", (1, 28, 28), {"conv2_channels": 18}, 50),
    ("cnn_mnist", (1, 8, 8), {}, 512),
    ("cnn_cifar", (1, 8, 8), {}, 512),
    ("lenet5", (1, 8, 8), {}, 84),
    ("lenet5", (3, 32, 32), {}, 84),
    ("resnet8", (1, 8, 8), {"width": 8}, 32),
    ("resnet8", (3, 32, 32), {"norm": "group"}, 256),
    ("resnet18", (3, 32, 32), {"stem": "imagenet", "conv1_stride": 1, "pool_stride": 4}, 512),
    ("vgg11", (3, 32, 32), {}, 512),
]


@pytest.mark.parametrize(("name", "shape", "opts", "dim"), SHAPES)
def test_head_of_features_is_forward(name, shape, opts, dim):
    torch.manual_seed(0)
    model = MODELS.get(name)(shape, 7, **opts).eval()
    x = torch.randn(3, *shape)
    z = model.features(x)
    assert model.embed_dim == dim
    assert z.shape == (3, dim)
    logits = model(x)
    assert logits.shape == (3, 7)
    assert torch.equal(model.head(z), logits)


@pytest.mark.parametrize(("name", "shape", "opts", "dim"), SHAPES)
def test_is_head_splits_exactly_the_parameters_of_head(name, shape, opts, dim):
    """Gradients of ``head(z)`` reach only ``is_head`` parameters; gradients of ``features`` only the rest."""
    torch.manual_seed(0)
    model = MODELS.get(name)(shape, 7, **opts).train()
    x = torch.randn(4, *shape)
    z = model.features(x)
    model.head(z.detach()).square().sum().backward()
    params = dict(model.named_parameters())
    head = {n for n, p in params.items() if p.grad is not None}
    assert head == {n for n in params if model.is_head(n)}
    assert head and all(n.startswith("classifier.") for n in head)
    model.zero_grad(set_to_none=True)
    z.square().sum().backward()
    body = {n for n, p in params.items() if p.grad is not None}
    assert body == set(params) - head


def test_heterogeneous_fedproto_variants_share_the_prototype_space_and_head():
    models = [MODELS.get("cnn_fedproto")((1, 28, 28), 10, conv2_channels=c) for c in (18, 20, 22)]
    assert {m.embed_dim for m in models} == {50}
    heads = [{n: p.shape for n, p in m.named_parameters() if m.is_head(n)} for m in models]
    assert heads[0] == heads[1] == heads[2]
    bodies = [{n: p.shape for n, p in m.named_parameters() if not m.is_head(n)} for m in models]
    assert bodies[0] != bodies[1] != bodies[2]
    x = torch.randn(2, 1, 28, 28)
    assert all(m.eval().features(x).shape == (2, 50) for m in models)


def test_fedproto_mh_resnet18_strides_change_features_not_shapes():
    torch.manual_seed(0)
    a = MODELS.get("resnet18")((3, 32, 32), 10, stem="imagenet", conv1_stride=1, pool_stride=4).eval()
    b = MODELS.get("resnet18")((3, 32, 32), 10, stem="imagenet").eval()
    b.load_state_dict(a.state_dict())  # same parameter shapes: the difference is only the strides
    x = torch.randn(2, 3, 32, 32)
    assert a.stem(x).shape == b.stem(x).shape == (2, 64, 8, 8)  # 8x8 after the stem either way
    assert not torch.allclose(a.features(x), b.features(x))


def test_resnet_state_dict_uses_torchvision_names():
    # so ImageNet weights load by key (FedProto's CIFAR init, MP-FedCL's encoder), with fc -> classifier
    keys = set(MODELS.get("resnet18")((3, 32, 32), 10, stem="imagenet").state_dict())
    for k in ("conv1.weight", "bn1.running_mean", "layer1.1.conv2.weight", "layer2.0.downsample.0.weight",
              "layer4.0.downsample.1.running_var", "layer4.1.bn2.bias", "classifier.weight"):  # fmt: skip
        assert k in keys
    assert not any(k.startswith("fc.") for k in keys)


def test_group_norm_resnet_has_no_batch_statistics():
    model = MODELS.get("resnet8")((3, 32, 32), 10, norm="group", norm_groups=4)
    assert not list(model.buffers())
    assert all(m.num_groups == 4 for m in model.modules() if isinstance(m, torch.nn.GroupNorm))


def test_mlp_options_normalize_and_relu_logits():
    torch.manual_seed(0)
    model = MODELS.get("mlp_mpfedcl")((1, 8, 8), 10, normalize=True, relu_logits=True)
    x = torch.randn(5, 1, 8, 8)
    assert torch.allclose(model.features(x).norm(dim=1), torch.ones(5))
    assert (model(x) >= 0).all()
    assert count_parameters(model) == count_parameters(MODELS.get("mlp_mpfedcl")((1, 8, 8), 10))


def test_dropout_is_active_in_train_and_off_in_eval():
    torch.manual_seed(0)
    model = MODELS.get("cnn_fedproto")((1, 28, 28), 10)
    x = torch.randn(4, 1, 28, 28)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_small_models_run_under_vmap_over_stacked_clients():
    """The vectorized engine trains many clients at once with ``torch.func``; the models must allow it."""
    torch.manual_seed(0)
    for name, opts in (("mlp_mpfedcl", {}), ("cnn_fedproto", {"padding": 2}), ("lenet5", {})):
        models = [MODELS.get(name)((1, 8, 8), 10, **opts) for _ in range(3)]
        params, buffers = stack_module_state(models)
        x = torch.randn(3, 2, 1, 8, 8)

        def run(p, b, xb, base=models[0]):
            return functional_call(base, (p, b), (xb,))

        models[0].train()  # dropout under vmap needs independent randomness per client
        assert vmap(run, randomness="different")(params, buffers, x).shape == (3, 2, 10)
        for m in models:
            m.eval()
        out = vmap(run)(params, buffers, x)
        assert all(torch.allclose(out[k], models[k](x[k]), atol=1e-6) for k in range(3)), name


BAD = [
    ("cnn_fedproto", (1, 28, 28), {"conv2_chanels": 18}, r"unknown option 'conv2_chanels' \(did you mean "),
    ("lenet5", (1, 28, 28), {"dropout": 0.5}, r"unknown option 'dropout'; allowed: padding$"),
    ("resnet18", (3, 32, 32), {"stem": "vit"}, r"option 'stem': Input should be 'cifar' or 'imagenet'"),
    ("resnet8", (3, 32, 32), {"norm": "layer"}, r"option 'norm': Input should be 'batch' or 'group'"),
    ("resnet8", (3, 32, 32), {"norm": "group", "norm_groups": 3}, r"'norm_groups': 3 does not divide"),
    ("resnet18", (3, 32, 32), {"pool_stride": 4}, r"need stem='imagenet'"),
    ("cnn_fedproto", (1, 28, 28), {"conv2_channels": 0}, r"'conv2_channels': .*greater than or equal to 1"),
    ("cnn_mnist", (1, 28, 28), {"dropout1": 1.0}, r"'dropout1': Input should be less than 1"),
    ("cnn_mnist", (64,), {}, r"needs 3-d inputs \(C, H, W\); got shape \(64,\)"),
    ("cnn_fedproto", (1, 8, 8), {}, r"cannot take inputs of shape \(1, 8, 8\) \(padding=2 fits 8x8 inputs\)"),
    ("vgg11", (3, 8, 8), {}, r"'vgg11' cannot take inputs of shape \(3, 8, 8\)"),
]


@pytest.mark.parametrize(("name", "shape", "opts", "match"), BAD)
def test_bad_options_and_shapes_are_one_line_config_errors(name, shape, opts, match):
    with pytest.raises(ConfigError, match=match) as info:
        MODELS.get(name)(shape, 10, **opts)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_signature_exposes_the_real_options_for_config_validation(name):
    """Config validation reads the factory's signature; the wrapper must not hide it behind ``**options``."""
    sig = inspect.signature(MODELS.get(name))
    params = list(sig.parameters.values())
    assert [p.name for p in params[:2]] == ["in_shape", "num_classes"]
    # no ``**options`` (VAR_KEYWORD): the real option names, keyword-only (``identity`` has none)
    assert all(p.kind is p.KEYWORD_ONLY for p in params[2:])
    assert params[2:] or name == "identity"
