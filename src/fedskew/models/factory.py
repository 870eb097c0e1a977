"""How a zoo model is declared: the option types, the registering decorator that validates options
(pydantic ``validate_call``: an unknown or out-of-range option is a one-line
:class:`~fedskew.errors.ConfigError` listing the allowed ones), the input checks and dry-run flatten size,
and :class:`SplitModel`. Split from ``zoo.py`` (issue 53): the model modules import this, not each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationError, validate_call
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.models.base import MODELS, FedModel
from fedskew.registry import check_options

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Prob = Annotated[float, Field(ge=0.0, lt=1.0)]
Norm = Literal["batch", "group"]


def registered_model(name: str) -> Callable[[Callable[..., FedModel]], Callable[..., FedModel]]:
    """Register ``fn`` under ``name``; type-check its options and turn bad ones into ConfigError.

    The wrapper keeps ``fn``'s signature (``__wrapped__``) so that config validation, which inspects it,
    sees the real option names.
    """

    def deco(fn: Callable[..., FedModel]) -> Callable[..., FedModel]:
        checked = validate_call(fn)

        @functools.wraps(fn)
        def factory(in_shape: tuple[int, ...], num_classes: int, **options: Any) -> FedModel:
            check_options(fn, options, f"model '{name}': unknown option '{{key}}'", skip=2)
            try:
                return checked(tuple(in_shape), num_classes, **options)
            except ValidationError as err:
                e = err.errors()[0]
                where = ".".join(str(p) for p in e["loc"])
                raise ConfigError(
                    f"model '{name}' option '{where}': {e['msg']} (got {e.get('input')!r})"
                ) from None

        MODELS.register(name)(factory)
        return factory

    return deco


def need_image(in_shape: tuple[int, ...], name: str) -> None:
    if len(in_shape) != 3:
        raise ConfigError(f"model '{name}' needs 3-d inputs (C, H, W); got shape {tuple(in_shape)}")


def flat_dim(body: nn.Module, in_shape: tuple[int, ...], name: str, hint: str = "") -> int:
    """Output size of ``body`` on one zero input (a dry run: no shape arithmetic to get wrong)."""
    was = body.training
    body.eval()
    try:
        with torch.no_grad():
            n = int(body(torch.zeros(1, *in_shape)).numel())
    except RuntimeError as err:  # conv/pool output size < 1
        reason = str(err).splitlines()[0]
        raise ConfigError(
            f"model '{name}' cannot take inputs of shape {tuple(in_shape)}{hint}: {reason}"
        ) from None
    finally:
        body.train(was)
    return n


class SplitModel(FedModel):
    """A model given as ``body`` (input -> embedding) and ``classifier`` (embedding -> logits)."""

    def __init__(self, body: nn.Module, classifier: nn.Module, embed_dim: int, normalize: bool = False):
        super().__init__()
        self.body = body
        self.classifier = classifier
        self.embed_dim = embed_dim
        self.normalize = normalize

    def features(self, x: Tensor) -> Tensor:
        z = self.body(x)
        return F.normalize(z, dim=1) if self.normalize else z

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)
