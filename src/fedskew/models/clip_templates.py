"""Prompt templates of the class text embeddings W_text (CacheFL Eq. 5; CLIP §3.1.4 prompt engineering).

CacheFL (Yi et al. 2025, §3) embeds the single prompt ``"a photo of a [CLASS]"`` (:data:`DEFAULT_TEMPLATE`,
the default). Two published alternatives can be selected with ``data.vision_language.templates``:

* ``coop:<dataset>``: the one hand-written prompt per dataset of CoOp's zero-shot CLIP baseline (Zhou et al.
  2022, "CUSTOM_TEMPLATES"), which Tip-Adapter's dataset loaders use as well, e.g. ``coop:dtd`` ->
  ``"{} texture."``;
* ``ensemble``: the 7 prompts CLIP's ImageNet notebook selected (and Tip-Adapter uses for ImageNet); the
  class embedding is the renormalised mean of the normalised per-prompt text features (CLIP's prompt
  ensembling, :func:`ensemble_embeddings`).

A list of strings (each holding one ``{}``) is also accepted as a custom ensemble.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn.functional as F
from torch import Tensor

from fedskew.errors import ConfigError

#: CacheFL's single prompt (§3, Eq. 5); the default of ``data.vision_language.template``
DEFAULT_TEMPLATE = "a photo of a {}."

#: CoOp's per-dataset zero-shot prompt, keyed by CoOp's dataset config names
COOP_TEMPLATES: dict[str, str] = {
    "caltech101": "a photo of a {}.",
    "dtd": "{} texture.",
    "eurosat": "a centered satellite photo of {}.",
    "fgvc_aircraft": "a photo of a {}, a type of aircraft.",
    "food101": "a photo of {}, a type of food.",
    "imagenet": "a photo of a {}.",
    "oxford_flowers": "a photo of a {}, a type of flower.",
    "oxford_pets": "a photo of a {}, a type of pet.",
    "stanford_cars": "a photo of a {}.",
    "sun397": "a photo of a {}.",
    "ucf101": "a photo of a person doing {}.",
}

#: CLIP's 7 selected ImageNet prompts (CLIP's prompt-engineering notebook; Tip-Adapter's ImageNet template)
ENSEMBLE_TEMPLATES: tuple[str, ...] = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)

#: named sets of ``data.vision_language.templates``
TEMPLATE_SETS: dict[str, tuple[str, ...]] = {
    "ensemble": ENSEMBLE_TEMPLATES,
    **{f"coop:{name}": (template,) for name, template in COOP_TEMPLATES.items()},
}

_KEY = "data.vision_language.templates"


def resolve_templates(template: str, templates: str | Sequence[str] | None) -> list[str]:
    """The prompt templates of a config: ``[template]`` without a named set, else the set's templates.

    ``template`` and ``templates`` are exclusive: a ``template`` other than :data:`DEFAULT_TEMPLATE` together
    with ``templates`` is refused, as are unknown set names and templates without exactly one ``{}``."""
    if templates is None:
        return _checked([template], "data.vision_language.template")
    if template != DEFAULT_TEMPLATE:
        raise ConfigError(
            f"{_KEY} and data.vision_language.template ({template!r}) are exclusive: give a custom template "
            "or a named set, not both"
        )
    if isinstance(templates, str):
        if templates not in TEMPLATE_SETS:
            raise ConfigError(
                f"{_KEY}: unknown set {templates!r}; allowed: {', '.join(TEMPLATE_SETS)} or a list of strings"
            )
        return list(TEMPLATE_SETS[templates])
    if not templates:
        raise ConfigError(f"{_KEY}: an empty list; allowed: {', '.join(TEMPLATE_SETS)} or a list of strings")
    return _checked(list(templates), _KEY)


def _checked(templates: list[str], key: str) -> list[str]:
    bad = [t for t in templates if not isinstance(t, str) or t.count("{}") != 1]
    if bad:
        raise ConfigError(f"{key}: {bad[0]!r} must hold exactly one '{{}}' (the class name)")
    return templates


def ensemble_embeddings(
    encode: Callable[[list[str]], Tensor], templates: Sequence[str], names: Sequence[str]
) -> Tensor:
    """W_text ``[N, C]``: per class, the L2-normalised mean over ``templates`` of the L2-normalised text
    features of ``template.format(class name)`` (CLIP's prompt ensembling; one template: its normalised
    features). ``encode`` embeds all T·N prompts in one call; underscores in names are read as spaces."""
    prompts = [t.format(n.replace("_", " ")) for t in templates for n in names]
    feats = F.normalize(encode(prompts).float(), dim=-1)
    if len(templates) == 1:
        return feats
    return F.normalize(feats.view(len(templates), len(names), -1).mean(0), dim=-1)
