"""Small helpers for the patterns methods repeat: a personal module added to the model, the model in eval
(or train) mode for an auxiliary pass, a frozen module, the "no global model" error.

Why here and not in each method: the same five lines were copied into a dozen modules (nine raised the
"no global model" error by hand, eight saved and restored ``model.training``, three injected a personal copy
with ``add_module``), each copy a place to forget the restore after an exception or to word the error
differently. Each helper does exactly what the copies did, so moving a method onto it changes no number.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

from torch import nn

from fedskew.errors import ConfigError

__all__ = [
    "eval_mode",
    "frozen",
    "frozen_copy",
    "model_mode",
    "no_global_model",
    "personal_module",
    "train_mode",
]

M = TypeVar("M", bound=nn.Module)


@contextmanager
def model_mode(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    """``model`` in train (``training=True``) or eval mode for the block, its previous mode restored after
    (also after an exception): an auxiliary pass never leaves the runtime's model in another mode."""
    was_training = model.training
    model.train(training)
    try:
        yield model
    finally:
        model.train(was_training)


def eval_mode(model: nn.Module) -> AbstractContextManager[nn.Module]:
    """:func:`model_mode` in eval mode: running BatchNorm statistics, no dropout (feature statistics,
    validation losses computed during a client's round)."""
    return model_mode(model, False)


def train_mode(model: nn.Module) -> AbstractContextManager[nn.Module]:
    """:func:`model_mode` in train mode (an auxiliary training loop on copies: batch statistics, dropout)."""
    return model_mode(model, True)


def frozen(module: M) -> M:
    """``module`` in eval mode with every parameter's ``requires_grad`` off (reference networks, teachers,
    a head evaluated functionally): returns the same module."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def frozen_copy(module: M) -> M:
    """:func:`frozen` on a deep copy of ``module`` (the given module is left as it was)."""
    return frozen(copy.deepcopy(module))


def personal_module(model: M, name: str, build: Callable[[M], nn.Module] = copy.deepcopy) -> M:
    """``model`` with a submodule ``name`` added (once: a model that already has one is returned as is),
    built by ``build(model)``: by default a deep copy of the model (Ditto's personal copy v_k, APFL's local
    v), or any module (FedRoD's personalized head). For :meth:`Algorithm.prepare_model`; state-dict entries
    of the added module start with ``name + "."``."""
    if not isinstance(getattr(model, name, None), nn.Module):
        model.add_module(name, build(model))
    return model


def no_global_model(algorithm: str, what: str = "model") -> ConfigError:
    """The one-line error of a method without a global ``what`` asked to evaluate one (``eval_weights`` /
    ``model_weights`` with ``state=None``): the config must ask for the personalized protocol."""
    return ConfigError(f"{algorithm} has no global {what} to evaluate; set eval.protocol=personalized")
