"""The vision-language data pipeline: a federation's images -> frozen-backbone features, plus the cache's
synthetic set and the class text embeddings (CacheFL, Algorithm 1 lines 1–4 and 11–12).

:func:`vision_language_data` replaces the images of a :class:`FederatedData` by L2-normalised backbone
features (computed once and cached on disk in :func:`feature_cache`, under the cache root: the data root is
only read) and attaches, in ``dataset.meta["assets"]``, the tensors a vision-language method is built from
(the engine hands them to the algorithm as ``Context.assets``):

* ``cache_x`` ``[N·K, C]``: normalised features of the generator's K images per class, class-major (the
  cache keys W1ᵀ of Eq. 3), and ``cache_y`` ``[N·K]`` their labels (W2 of Eq. 4 as indices);
* ``text`` ``[N, C]``: normalised class embeddings W_text (Eq. 5). From the backbone's text encoder on
  ``template.format(class name)`` when it has one (or on a named set of ``templates``, ensembled:
  :mod:`fedskew.models.clip_templates`), else from the **generated-prototype text head**: the normalised
  mean feature of a second, independent draw of the generator's images of each class. That head stands in
  for CLIP's text encoder with an image-only backbone; it is not a text encoder.

With ``augment_views: V > 0`` each cache key is the normalised mean of the raw features of V seeded random
resized crops + flips of its image (Tip-Adapter's augmented cache, :mod:`fedskew.models.clip_augment`);
V = 0 (default) keeps CacheFL's plain keys.

Only training rows some client holds (train or validation) are encoded; other rows stay zero (few-shot
protocols use 16 images per class out of 60,000). The partition depends on labels only, so it is the same
as on the raw images.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.data.cache import derived_dir, load_saved, save_atomic
from fedskew.data.federated import FederatedData
from fedskew.data.generators import generate
from fedskew.errors import ConfigError
from fedskew.models.backbones import BACKBONES, Backbone
from fedskew.models.base import MODELS, FedModel
from fedskew.models.clip_augment import Augment, augment_view
from fedskew.models.clip_templates import DEFAULT_TEMPLATE, ensemble_embeddings, resolve_templates
from fedskew.seeding import derive_seed

log = logging.getLogger("fedskew.models")

TEXT_HEADS = ("auto", "encoder", "prototypes")
_PROTO_TAG = 0x7E47  # seed key of the prototype head's draw, independent of the cache's images


@dataclasses.dataclass(frozen=True)
class VisionLanguageSpec:
    """What builds the features and assets (the ``data.vision_language`` config section)."""

    backbone: str
    backbone_options: dict[str, Any]
    generator: str
    generator_options: dict[str, Any]
    shots: int = 16  # K synthetic images per class
    pool: int | None = None  # images drawn per class; the cache takes the first K (nested caches)
    template: str = DEFAULT_TEMPLATE
    templates: str | list[str] | None = None  # a named set (ensemble, coop:<dataset>) or a list; see template
    augment_views: int = 0  # V: Tip-Adapter's augmented cache keys (0: CacheFL's plain keys)
    text_head: str = "auto"
    seed: int = 0  # the generator's seed: one fixed synthetic set per dataset, whatever the run's seed
    image_size: int | None = None  # generator resolution; default the backbone's input size
    cache: bool = True  # keep features on disk in feature_cache(root) (the cache root, not the data root)


def normalize(x: Tensor) -> Tensor:
    return F.normalize(x.float(), dim=-1)


def _digest(images: Tensor) -> str:
    return hashlib.sha1(images.contiguous().numpy().tobytes()).hexdigest()


def feature_cache(root: Path) -> Path:
    """Where the features of data root ``root``'s images are kept: its cache folder (keyed by the root's
    resolved path, under ``$FEDSKEW_CACHE``), never the data root itself."""
    return derived_dir(root, "features")


def encode_cached(
    backbone: Backbone,
    images: Tensor,
    split: str,
    rows: Tensor | None,
    cache_dir: Path | None,
    augment: Augment | None = None,
) -> Tensor:
    """``backbone.encode_images`` of ``images`` (with ``augment``: the mean raw features of its views,
    :func:`encode_views`), read from / written to ``cache_dir`` when the backbone has a fingerprint (the key
    covers the backbone, the split, the image bytes and the augmentation). An unreadable cache file is
    re-encoded; an unwritable ``cache_dir`` only disables the cache."""
    fp = backbone.fingerprint()
    if cache_dir is None or fp is None or images.shape[0] == 0:
        return _encode(backbone, images, split, rows, augment)
    key_fields = {"backbone": fp, "split": split, "images": _digest(images)}
    if augment is not None:
        key_fields["augment"] = dataclasses.asdict(augment)
    key = json.dumps(key_fields, sort_keys=True)
    path = cache_dir / f"{fp['name']}-{split}-{hashlib.sha1(key.encode()).hexdigest()[:20]}.pt"
    hit = load_saved(path)
    if isinstance(hit, Tensor) and hit.dim() == 2 and hit.shape[0] == images.shape[0]:
        return hit
    feats = _encode(backbone, images, split, rows, augment)
    if save_atomic(path, feats):
        log.info("cached %s features of %d images in %s", split, images.shape[0], path)
    return feats


def encode_views(
    backbone: Backbone, images: Tensor, split: str, rows: Tensor | None, augment: Augment
) -> Tensor:
    """Mean over ``augment.views`` seeded augmented views of the raw (not normalised) image features
    (Tip-Adapter's cache keys before their L2 normalisation)."""
    feats = [  # one whole-batch view at a time
        _encode(backbone, augment_view(images, augment.size, augment.seed, v), split, rows, None)
        for v in range(augment.views)
    ]
    return torch.stack(feats).mean(0)


def _encode(
    backbone: Backbone, images: Tensor, split: str, rows: Tensor | None, augment: Augment | None
) -> Tensor:
    if augment is not None:
        return encode_views(backbone, images, split, rows, augment)
    with torch.no_grad():
        return backbone.encode_images(images, split, rows).float().cpu()


def synthetic_set(
    spec: VisionLanguageSpec, names: list[str], size: int, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The generator's first ``shots`` images per class of a pool of ``pool`` per class (class-major), their
    labels and their rows in the pool."""
    pool = spec.pool or spec.shots
    if pool < spec.shots:
        raise ConfigError(f"data.vision_language.pool ({pool}) must be >= shots ({spec.shots})")
    out = generate(spec.generator, names, pool, seed, size, **spec.generator_options)
    rows = torch.nonzero((torch.arange(pool) < spec.shots).repeat(len(names))).flatten()
    return out.images[rows], out.labels[rows], rows


def text_embeddings(
    spec: VisionLanguageSpec, backbone: Backbone, names: list[str], size: int, cache_dir: Path | None
) -> Tensor:
    """W_text ``[N, C]`` (normalised): the text encoder, or the generated-prototype head (module doc)."""
    if spec.text_head not in TEXT_HEADS:
        raise ConfigError(
            f"data.vision_language.text_head: '{spec.text_head}'; allowed: {', '.join(TEXT_HEADS)}"
        )
    use_encoder = spec.text_head == "encoder" or (
        spec.text_head == "auto" and backbone.encode_texts is not None
    )
    if use_encoder:
        if backbone.encode_texts is None:
            raise ConfigError(f"backbone '{spec.backbone}' has no text encoder; use text_head: prototypes")
        encode, templates = backbone.encode_texts, resolve_templates(spec.template, spec.templates)
        with torch.no_grad():
            return ensemble_embeddings(lambda prompts: encode(prompts).cpu(), templates, names)
    # the whole pool per class, so that varying K (the cache's share of the pool) leaves W_text fixed
    whole_pool = dataclasses.replace(spec, shots=spec.pool or spec.shots)
    images, labels, rows = synthetic_set(whole_pool, names, size, derive_seed(spec.seed, _PROTO_TAG))
    feats = normalize(encode_cached(backbone, images, "prototypes", rows, cache_dir))
    sums = torch.zeros(len(names), feats.shape[1]).index_add_(0, labels, feats)
    return normalize(sums)


def vision_language_data(fed: FederatedData, spec: VisionLanguageSpec, root: Path) -> FederatedData:
    """``fed`` with images replaced by normalised backbone features and the assets attached (module doc)."""
    backbone = BACKBONES.get(spec.backbone)(root, **spec.backbone_options)
    ds = fed.dataset
    cache_dir = feature_cache(root) if spec.cache else None
    size = spec.image_size or backbone.image_size
    names = ds.class_names
    used = [*fed.train_idx, *(fed.val_idx or [])]
    rows = torch.unique(torch.cat(used)) if used else torch.zeros(0, dtype=torch.int64)
    train = torch.zeros(ds.x_train.shape[0], backbone.embed_dim)
    train[rows] = normalize(encode_cached(backbone, ds.x_train[rows], "train", rows, cache_dir))
    test = normalize(encode_cached(backbone, ds.x_test, "test", None, cache_dir))
    syn_images, syn_labels, syn_rows = synthetic_set(spec, names, size, spec.seed)
    augment = Augment(spec.augment_views, spec.seed, backbone.image_size) if spec.augment_views > 0 else None
    cache_x = normalize(encode_cached(backbone, syn_images, "synthetic", syn_rows, cache_dir, augment))
    text = text_embeddings(spec, backbone, names, size, cache_dir)
    assets: dict[str, Any] = {"cache_x": cache_x, "cache_y": syn_labels, "text": text}
    if hasattr(backbone, "prompt_encoder"):  # a text tower: prompt learning can run through it
        assets["prompt_encoder"] = functools.partial(backbone.prompt_encoder, names)
    meta = {
        **ds.meta,
        "assets": assets,
        "vision_language": {"backbone": spec.backbone, "generator": spec.generator},
    }
    features = dataclasses.replace(ds, x_train=train, x_test=test, mean=(0.0,), std=(1.0,), meta=meta)
    return dataclasses.replace(fed, dataset=features)


class Identity(FedModel):
    """The input itself: the model of methods whose frozen encoder ran once in the data pipeline."""

    def __init__(self, in_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.embed_dim = int(torch.tensor(in_shape).prod())

    def features(self, x: Tensor) -> Tensor:
        return x.flatten(1)

    def head(self, z: Tensor) -> Tensor:
        return z


@MODELS.register("identity")
def identity(in_shape: tuple[int, ...], num_classes: int) -> Identity:
    """No parameters: the input features themselves (vision-language methods on backbone features)."""
    return Identity(tuple(in_shape))
