"""Which activation (GELU or QuickGELU) a CLIP checkpoint needs, and whether the architecture has it.

OpenAI's CLIP models (RN50 included: CacheFL's encoder, Yi et al. 2025 §4.1) were trained with QuickGELU,
``x * sigmoid(1.702 x)``; open_clip's plain architecture names (``RN50``, ``ViT-B-32``) build ``nn.GELU`` and
the ``-quickgelu`` names QuickGELU. Both have the same parameters, so a state dict loads silently into the
wrong activation and the text features (and a ViT's image features) drift. The weights' activation is
taken from what declares it:

* ``pretrained: <tag>``: the tag's ``quick_gelu`` in open_clip's pretrained registry, for the architecture
  named by ``model`` (its base name, without ``-quickgelu``);
* ``quick_gelu: true|false``: stated explicitly;
* the checkpoint itself, when it is a dict ``{"state_dict": ..., "quick_gelu": bool}``.

Declarations must agree. When the weights' activation differs from the architecture's, the backbone is
refused (``activation_mismatch: refuse``, the default) or built with the weights' activation
(``activation_mismatch: correct``). Undeclared weights are refused when every registered pretrained tag of
the architecture was trained with the other activation (plain ``RN50``: all of openai, yfcc15m, cc12m are
QuickGELU), since such weights almost surely need it.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from fedskew.errors import ConfigError
from fedskew.models.clip_compat import import_open_clip

log = logging.getLogger("fedskew.models")

MISMATCH = ("refuse", "correct")
_SUFFIX = "-quickgelu"


def activation_name(quick_gelu: bool) -> str:
    return "QuickGELU" if quick_gelu else "GELU"


def base_name(model: str) -> str:
    """The architecture's name without open_clip's ``-quickgelu`` suffix (its pretrained-registry key)."""
    return model.removesuffix(_SUFFIX)


def registry_activations(model: str) -> dict[str, bool]:
    """``{tag: quick_gelu}`` of every pretrained tag open_clip registers for ``model``'s base name."""
    oc = import_open_clip()
    base = base_name(model)
    tags = oc.list_pretrained_tags_by_model(base)
    return {t: bool(oc.get_pretrained_cfg(base, t).get("quick_gelu", False)) for t in tags}


def architecture_quick_gelu(model: str | None, model_config: dict[str, Any] | None) -> bool:
    """Whether the architecture as named (or configured) builds QuickGELU."""
    if model_config is not None:
        return bool(model_config.get("quick_gelu", False))
    return bool((import_open_clip().get_model_config(model) or {}).get("quick_gelu", False))


def declared_quick_gelu(
    model: str | None, pretrained: str | None, quick_gelu: bool | None, stored: bool | None
) -> bool | None:
    """The weights' activation as declared by ``pretrained``, ``quick_gelu`` and the checkpoint's own
    ``quick_gelu`` entry (``None``: undeclared); declarations that disagree are refused."""
    sources: dict[str, bool] = {}
    if pretrained is not None:
        if model is None:
            raise ConfigError(
                "backbone 'open_clip': pretrained needs model (an open_clip architecture name whose "
                "registered tags it looks up); with model_config, declare quick_gelu: true|false instead"
            )
        tags = registry_activations(model)
        tag = pretrained.lower().replace("-", "_")
        if tag not in tags:
            raise ConfigError(
                f"backbone 'open_clip': pretrained {pretrained!r} is not a registered tag of "
                f"{base_name(model)}; allowed: {', '.join(tags) or '(none registered)'}"
            )
        sources[f"pretrained: {pretrained}"] = tags[tag]
    if quick_gelu is not None:
        sources[f"quick_gelu: {str(quick_gelu).lower()}"] = bool(quick_gelu)
    if stored is not None:
        sources[f"the checkpoint's quick_gelu: {str(stored).lower()}"] = stored
    if len(set(sources.values())) > 1:
        raise ConfigError(f"backbone 'open_clip': conflicting activation declarations: {', '.join(sources)}")
    return next(iter(sources.values()), None)


def needed_quick_gelu(
    model: str | None, model_config: dict[str, Any] | None, declared: bool | None, mismatch: str
) -> bool:
    """The activation to build: the architecture's when it fits the weights, else the weights' (with
    ``mismatch == "correct"``); refusals in one line name the architecture, both activations and the fix."""
    if mismatch not in MISMATCH:
        raise ConfigError(
            f"backbone 'open_clip': activation_mismatch {mismatch!r}; allowed: {', '.join(MISMATCH)}"
        )
    arch = architecture_quick_gelu(model, model_config)
    name = model or "model_config"
    if declared is None:
        tags = registry_activations(model) if model is not None else {}
        if tags and set(tags.values()) == {not arch}:
            raise ConfigError(
                f"backbone 'open_clip': architecture '{name}' builds {activation_name(arch)} but every "
                f"registered pretrained weight of it ({', '.join(tags)}) needs {activation_name(not arch)}; "
                "declare the weights' activation (pretrained: <tag> or quick_gelu: true|false) or "
                f"{_fix(model, not arch)}"
            )
        return arch
    if declared != arch and mismatch == "refuse":
        raise ConfigError(
            f"backbone 'open_clip': architecture '{name}' builds {activation_name(arch)} but the weights "
            f"need {activation_name(declared)}; {_fix(model, declared)} (or activation_mismatch: correct)"
        )
    if declared != arch:
        log.info("open_clip: building '%s' with %s to match its weights", name, activation_name(declared))
    return declared


def _fix(model: str | None, quick_gelu: bool) -> str:
    if model is None:
        return f"set model_config.quick_gelu: {str(quick_gelu).lower()}"
    return f"use model: {base_name(model) + _SUFFIX if quick_gelu else base_name(model)}"


def build_with_activation(
    model: str | None, model_config: dict[str, Any] | None, quick_gelu: bool
) -> nn.Module:
    """The architecture (random weights, nothing downloaded) built with the given activation."""
    oc = import_open_clip()
    if model_config is not None:
        return oc.model.CLIP(**{**model_config, "quick_gelu": quick_gelu})
    assert model is not None
    if quick_gelu == architecture_quick_gelu(model, None):
        return oc.create_model(model, pretrained=None)
    if quick_gelu:
        return oc.create_model(model, pretrained=None, force_quick_gelu=True)
    base = base_name(model)
    if base == model or base not in oc.list_models() or architecture_quick_gelu(base, None):
        raise ConfigError(
            f"backbone 'open_clip': no GELU variant of '{model}' is registered; use another model"
        )
    return oc.create_model(base, pretrained=None)


def built_activation(net: nn.Module) -> str:
    """``quick_gelu`` when the built network holds a QuickGELU module, else ``gelu`` (feature-cache key)."""
    quick = import_open_clip().transformer.QuickGELU
    return "quick_gelu" if any(isinstance(m, quick) for m in net.modules()) else "gelu"
