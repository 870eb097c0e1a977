"""CLIP fidelity of the vision-language pipeline: the QuickGELU guard of the ``open_clip`` backbone, CLIP's
shortest-side + centre-crop preprocessing, Tip-Adapter's augmented cache keys and the prompt templates, on
a tiny random CLIP (and open_clip's registry for RN50)."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fedskew.data.base import DATASETS
from fedskew.data.federated import build_federated
from fedskew.data.images import cached_images
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.models.backbones.open_clip_backbone import TINY_CLIP

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None, reason="needs the [clip] extra (open-clip-torch)"
)

TINY = TINY_CLIP
PROMPTS = ["a photo of a cat.", "a photo of a dog."]


def images(n: int = 3, h: int = 32, w: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def backbone(name: str, root, **options):
    from fedskew.models.backbones import BACKBONES

    return BACKBONES.get(name)(root, **options)


# --- 1. the QuickGELU guard ---------------------------------------------------------------------------------


def clip_net(quick_gelu: bool, state=None):
    from fedskew.models.clip_compat import import_open_clip

    torch.manual_seed(0)
    net = import_open_clip().model.CLIP(**TINY, quick_gelu=quick_gelu).eval()
    if state is not None:
        net.load_state_dict(state)
    return net


@pytest.fixture(scope="module")
def quick_weights(tmp_path_factory):
    """A QuickGELU-trained tiny CLIP: its state dict, a file declaring it, and a plain state-dict file."""
    state = clip_net(True).state_dict()
    folder = tmp_path_factory.mktemp("weights")
    torch.save({"state_dict": state, "quick_gelu": True}, folder / "declared.pt")
    torch.save(state, folder / "plain.pt")
    return state, folder


def test_quick_gelu_weights_are_refused_by_a_gelu_architecture(quick_weights):
    _, folder = quick_weights
    with pytest.raises(ConfigError, match=r"builds GELU but the weights need QuickGELU; set model_config"):
        backbone("open_clip", folder, checkpoint="declared.pt", model_config=TINY)
    with pytest.raises(ConfigError, match="weights need QuickGELU"):  # declared by the option instead
        backbone("open_clip", folder, checkpoint="plain.pt", model_config=TINY, quick_gelu=True)
    with pytest.raises(ConfigError, match="conflicting activation declarations"):
        backbone("open_clip", folder, checkpoint="declared.pt", model_config=TINY, quick_gelu=False)
    with pytest.raises(ConfigError, match="activation_mismatch 'fix'; allowed: refuse, correct"):
        backbone("open_clip", folder, checkpoint="declared.pt", model_config=TINY, activation_mismatch="fix")


def test_correct_builds_the_weights_activation_and_matches_a_quick_gelu_model(quick_weights):
    state, folder = quick_weights
    fixed = backbone(
        "open_clip", folder, checkpoint="declared.pt", model_config=TINY, activation_mismatch="correct"
    )
    quick, gelu = clip_net(True, state), clip_net(False, state)
    x = images()
    from fedskew.models.backbones import to_backbone_input
    from fedskew.models.backbones.open_clip_backbone import CLIP_MEAN, CLIP_STD

    pixels = to_backbone_input(x, 32, CLIP_MEAN, CLIP_STD)
    with torch.no_grad():
        tokens = fixed.tokenizer(PROMPTS)
        text, image = fixed.encode_texts(PROMPTS), fixed.encode_images(x, "test")
        assert torch.allclose(text, quick.encode_text(tokens), atol=1e-5)
        assert torch.allclose(image, quick.encode_image(pixels), atol=1e-5)
        assert not torch.allclose(text, gelu.encode_text(tokens), atol=1e-3)
        assert not torch.allclose(image, gelu.encode_image(pixels), atol=1e-3)


def test_a_matching_declaration_loads_and_the_activation_keys_the_feature_cache(quick_weights):
    _, folder = quick_weights
    quick_arch = {**TINY, "quick_gelu": True}
    a = backbone("open_clip", folder, checkpoint="declared.pt", model_config=quick_arch)
    b = backbone("open_clip", folder, checkpoint="plain.pt", model_config=quick_arch, quick_gelu=True)
    c = backbone("open_clip", folder, checkpoint="plain.pt", model_config=TINY)  # undeclared: taken as is
    assert a.fingerprint()["activation"] == b.fingerprint()["activation"] == "quick_gelu"
    assert c.fingerprint()["activation"] == "gelu"
    assert torch.allclose(a.encode_texts(PROMPTS), b.encode_texts(PROMPTS))


def test_open_clips_registry_decides_rn50_without_loading_weights():
    from fedskew.models.backbones.clip_activation import (
        declared_quick_gelu,
        needed_quick_gelu,
        registry_activations,
    )

    assert registry_activations("RN50") == {"openai": True, "yfcc15m": True, "cc12m": True}
    assert declared_quick_gelu("RN50-quickgelu", "openai", None, None) is True
    assert needed_quick_gelu("RN50-quickgelu", None, True, "refuse") is True
    with pytest.raises(
        ConfigError, match=r"'RN50' builds GELU but every registered .* use model: RN50-quickgelu"
    ):
        needed_quick_gelu("RN50", None, None, "refuse")  # undeclared plain RN50
    with pytest.raises(ConfigError, match="use model: RN50-quickgelu"):
        needed_quick_gelu("RN50", None, declared_quick_gelu("RN50", "openai", None, None), "refuse")
    assert needed_quick_gelu("RN50", None, True, "correct") is True
    assert needed_quick_gelu("ViT-B-32", None, None, "refuse") is False  # its tags disagree: no refusal
    with pytest.raises(ConfigError, match="not a registered tag of RN50; allowed: openai, yfcc15m, cc12m"):
        declared_quick_gelu("RN50", "laion2b", None, None)
    with pytest.raises(ConfigError, match="pretrained needs model"):
        declared_quick_gelu(None, "openai", None, None)


def test_correcting_rn50_builds_quick_gelu():
    from fedskew.models.backbones.clip_activation import built_activation
    from fedskew.models.backbones.open_clip_backbone import build_clip

    assert built_activation(build_clip("RN50", None)) == "gelu"
    assert built_activation(build_clip("RN50", None, quick_gelu=True)) == "quick_gelu"


# --- 2. CLIP preprocessing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("h", "w", "new", "crop"), [(20, 33, (16, 26), (0, 5)), (40, 22, (29, 16), (6, 0))])
def test_shortest_side_resize_and_centre_crop_match_a_hand_built_reference(h, w, new, crop):
    from fedskew.models.backbones import to_backbone_input

    x = images(2, h, w)
    ref = F.interpolate(x.float() / 255, size=new, mode="bicubic", antialias=True, align_corners=False)
    ref = ref.clamp(0, 1)[
        :, :, crop[0] : crop[0] + 16, crop[1] : crop[1] + 16
    ]  # int(16·33/20) = 26, (26-16)/2
    out = to_backbone_input(x, 16, (0.0,) * 3, (1.0,) * 3, "shortest")
    assert out.shape == (2, 3, 16, 16) and torch.allclose(out, ref, atol=1e-6)
    squash = to_backbone_input(x, 16, (0.0,) * 3, (1.0,) * 3, "squash")
    assert (out - squash).abs().max() > 0.05
    square = images(2, 24, 24)
    assert torch.equal(
        to_backbone_input(square, 16, (0.0,) * 3, (1.0,) * 3, "shortest"),
        to_backbone_input(square, 16, (0.0,) * 3, (1.0,) * 3),
    )


def test_clip_backbones_crop_by_default_and_squash_on_request(tmp_path):
    x = images(2, 32, 48)
    default, squash = backbone("random_clip", tmp_path), backbone("random_clip", tmp_path, resize="squash")
    crop = x[:, :, :, 8:40]  # the short side already has the input size: the centre crop alone
    assert torch.allclose(default.encode_images(x, "test"), squash.encode_images(crop, "test"), atol=1e-5)
    assert not torch.allclose(default.encode_images(x, "test"), squash.encode_images(x, "test"), atol=1e-3)
    assert default.fingerprint() != squash.fingerprint()
    with pytest.raises(ConfigError, match="resize 'crop'; allowed: squash, shortest"):
        backbone("random_clip", tmp_path, resize="crop")


def test_decoding_with_resize_shortest_keeps_the_aspect_and_crops_the_centre(tmp_path):
    stripes = np.zeros((32, 64, 3), dtype=np.uint8)  # red | green | blue columns, 16 | 32 | 16 wide
    stripes[:, :16, 0], stripes[:, 16:48, 1], stripes[:, 48:, 2] = 255, 255, 255
    Image.fromarray(stripes).save(tmp_path / "a.png")
    crop, _ = cached_images([tmp_path / "a.png"], 16, "RGB", None, "t", resize="shortest")
    squash, _ = cached_images([tmp_path / "a.png"], 16, "RGB", None, "t")
    assert crop.shape == squash.shape == (1, 3, 16, 16)
    inner = crop[0, :, :, 2:-2].int()  # the green middle (bicubic blends the outermost columns)
    assert inner[1].min() >= 250 and inner[0].max() <= 5 and inner[2].max() <= 5
    assert squash[0, 0, :, 0].min() >= 250  # squash keeps the red stripe
    with pytest.raises(ConfigError, match="resize must be one of squash, shortest"):
        cached_images([tmp_path / "a.png"], 16, "RGB", None, "t", resize="fit")


# --- 3. augmented cache keys --------------------------------------------------------------------------------


def test_resized_crops_match_pils_crop_and_resize_and_boxes_follow_random_resized_crop():
    from fedskew.models.clip_augment import crop_boxes, resized_crops

    x = images(3, 40, 40)
    box = torch.tensor([[2, 3, 30, 25], [0, 0, 40, 40], [5, 7, 12, 14]])
    for size in (16, 56):  # boxes shrunk (antialiased) and enlarged
        out = resized_crops(x, box, torch.tensor([False, False, True]), size)
        for i, (t, left, h, w) in enumerate(box.tolist()):  # three hand-picked boxes, not a sample loop
            pil = Image.fromarray(x[i].permute(1, 2, 0).numpy()).crop((left, t, left + w, t + h))
            ref = torch.from_numpy(np.array(pil.resize((size, size), Image.Resampling.BICUBIC))).permute(
                2, 0, 1
            )
            ref = ref.flip(-1) if i == 2 else ref
            assert (out[i].int() - ref.int()).abs().max() <= 1
    same = resized_crops(x, torch.tensor([[0, 0, 40, 40]] * 3), torch.tensor([True, False, False]), 40)
    assert torch.equal(same[0], x[0].flip(-1)) and torch.equal(same[1:], x[1:])  # whole images, 1:1
    boxes = crop_boxes(500, 40, 30, torch.Generator().manual_seed(0))
    top, left, h, w = boxes.unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 40).all() and (left + w <= 30).all()
    share, aspect = (h * w).float() / 1200, w.float() / h
    assert share.min() > 0.45 and share.max() <= 1.0 and aspect.min() > 0.7 and aspect.max() < 1.4


def test_augmented_views_are_seeded_and_the_key_is_the_mean_of_the_encoded_views(tmp_path):
    from fedskew.models.clip_augment import Augment, augment_view
    from fedskew.models.vision_language import encode_cached

    x, clip = images(4), backbone("random_clip", tmp_path)
    assert torch.equal(augment_view(x, 32, 7, 0), augment_view(x, 32, 7, 0))
    assert not torch.equal(augment_view(x, 32, 7, 0), augment_view(x, 32, 7, 1))
    assert not torch.equal(augment_view(x, 32, 7, 0), augment_view(x, 32, 8, 0))
    views = torch.stack([clip.encode_images(augment_view(x, 32, 7, v), "synthetic") for v in range(3)])
    mean = encode_cached(clip, x, "synthetic", None, None, Augment(3, 7, 32))
    assert torch.allclose(mean, views.mean(0), atol=1e-6)
    cached = encode_cached(clip, x, "synthetic", None, tmp_path, Augment(3, 7, 32))
    plain = encode_cached(clip, x, "synthetic", None, tmp_path)
    assert torch.allclose(cached, mean, atol=1e-6) and len(list(tmp_path.iterdir())) == 2
    assert not torch.allclose(plain, mean, atol=1e-3)


def test_augment_views_zero_keeps_the_plain_keys_and_v_changes_them(tmp_path, monkeypatch):
    from fedskew.models.vision_language import (
        VisionLanguageSpec,
        normalize,
        synthetic_set,
        vision_language_data,
    )

    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    fed = build_federated(DATASETS.get("digits")(None), 2, {"name": "iid"}, seed=0, train_limit=20)
    spec = VisionLanguageSpec("random_clip", {}, "procedural", {}, shots=2, cache=False)
    keys = {
        v: vision_language_data(fed, dataclasses.replace(spec, augment_views=v), tmp_path).dataset.meta[
            "assets"
        ]
        for v in (0, 2)
    }
    syn, _, _ = synthetic_set(spec, fed.dataset.class_names, 32, 0)
    plain = normalize(backbone("random_clip", tmp_path).encode_images(syn, "synthetic"))
    assert torch.allclose(keys[0]["cache_x"], plain, atol=1e-6)
    assert not torch.allclose(keys[2]["cache_x"], plain, atol=1e-3)
    assert torch.allclose(keys[2]["cache_x"].norm(dim=1), torch.ones(20))
    assert torch.equal(keys[0]["text"], keys[2]["text"])


# --- 4. prompt templates ------------------------------------------------------------------------------------


def text(tmp_path, **kw) -> torch.Tensor:
    from fedskew.models.vision_language import VisionLanguageSpec, text_embeddings

    spec = VisionLanguageSpec("random_clip", {}, "procedural", {}, **kw)
    return text_embeddings(spec, backbone("random_clip", tmp_path), ["cat", "sea_lion", "car"], 32, None)


def test_the_ensemble_is_the_normalised_mean_of_the_single_template_embeddings(tmp_path):
    from fedskew.models.clip_templates import COOP_TEMPLATES, ENSEMBLE_TEMPLATES

    singles = torch.stack([text(tmp_path, template=t) for t in ENSEMBLE_TEMPLATES])
    assert len(ENSEMBLE_TEMPLATES) == 7
    assert torch.allclose(
        text(tmp_path, templates="ensemble"), F.normalize(singles.mean(0), dim=-1), atol=1e-6
    )
    assert torch.allclose(
        text(tmp_path, templates="coop:dtd"), text(tmp_path, template="{} texture."), atol=1e-6
    )
    assert COOP_TEMPLATES["eurosat"] == "a centered satellite photo of {}."
    pair = text(tmp_path, templates=["a photo of a {}.", "art of the {}."])
    assert torch.allclose(pair, F.normalize(singles[5] + text(tmp_path), dim=-1), atol=1e-6)


def test_an_unknown_set_or_two_prompt_sources_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown set 'coop:flowers'; allowed: ensemble, coop:caltech101"):
        text(tmp_path, templates="coop:flowers")
    with pytest.raises(ConfigError, match="exclusive"):
        text(tmp_path, template="a {}.", templates="ensemble")
    with pytest.raises(ConfigError, match="exactly one"):
        text(tmp_path, templates=["a photo."])
    section = {
        "backbone": {"name": "random_clip"},
        "generator": {"name": "procedural"},
        "templates": "imagenet",
    }
    cfg = {
        "data": {"vision_language": section},
        "model": {"name": "identity"},
        "algorithm": {"name": "cachefl"},
    }
    with pytest.raises(
        ConfigError, match=r"data\.vision_language\.templates.*unknown set 'imagenet'; allowed"
    ):
        build_config(cfg)
    section["templates"] = "ensemble"
    assert build_config(cfg).data.vision_language.templates == "ensemble"
