"""Messages between server and clients (contract v4): a :class:`Payload` and a client's :class:`Upload`.

A payload has ``arrays`` (tensors on the wire: counted in ``bytes_up/down`` and ``params_up/down``),
``config`` (small values the receiver needs: counted, 8 bytes each) and ``metrics`` (diagnostics: logged,
never counted); they map one-to-one onto Flower's ``ArrayRecord``, ``ConfigRecord`` and ``MetricRecord``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

#: payload arrays whose names start with this prefix are model state (parameters and buffers)
MODEL_PREFIX = "model."


@dataclass
class Payload:
    """One message: ``arrays`` (named tensors), ``config`` (small values the receiver needs) and ``metrics``
    (diagnostics). Maps onto Flower's ArrayRecord, ConfigRecord and MetricRecord."""

    arrays: dict[str, Tensor] = field(default_factory=dict)
    config: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes on the wire: tensor storage plus 8 bytes per config value (metrics are not counted)."""
        return sum(t.numel() * t.element_size() for t in self.arrays.values()) + 8 * len(self.config)

    def num_params(self) -> int:
        """Communicated floating-point tensor values: the papers' "# communicated parameters" (class ids and
        sample counts sent as integer tensors are metadata and not counted)."""
        return sum(t.numel() for t in self.arrays.values() if t.is_floating_point())

    def prefixed(self, prefix: str) -> dict[str, Tensor]:
        """The arrays whose names start with ``prefix``, with the prefix stripped (no copies)."""
        n = len(prefix)
        return {k[n:]: v for k, v in self.arrays.items() if k.startswith(prefix)}

    def model_state(self) -> dict[str, Tensor]:
        """The model entries, with :data:`MODEL_PREFIX` stripped."""
        return self.prefixed(MODEL_PREFIX)

    def is_finite(self) -> bool:
        """No NaN / Inf in arrays or config. A finite sum implies finite elements (NaN and Inf propagate), so
        one reduction per tensor decides the common case; only a non-finite sum (possibly a float overflow of
        finite values) is checked element by element."""
        floats = [t for t in self.arrays.values() if t.is_floating_point()]
        ok = all(math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all()) for t in floats)
        return ok and all(math.isfinite(v) for v in self.config.values())


@dataclass
class Upload:
    """What the server receives from client ``cid``: its payload and its number of training samples."""

    cid: int
    num_samples: int
    payload: Payload


def model_arrays(state: Mapping[str, Tensor], keys: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """Prefix (cloned) model state entries for a payload, optionally keeping only the keys ``keys`` accepts.

    Cloned: the runtime reuses one model instance across clients, so an upload must not alias it.
    """
    return {MODEL_PREFIX + k: v.detach().clone() for k, v in state.items() if keys is None or keys(k)}


def server_arrays(weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Prefix the server's model weights for a broadcast payload, without copying them.

    A server state is never changed in place (hooks return new values) and no hook changes its payload,
    so every client's payload may share the server's tensors: one copy of the model per client less.
    """
    return {MODEL_PREFIX + k: v for k, v in weights.items()}


def clone_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Detached copies of a model's state entries (personal weights kept in client state)."""
    return {k: v.detach().clone() for k, v in state.items()}
