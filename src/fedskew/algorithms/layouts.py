"""What a client's upload holds: the layout a server checks an untrusted reply against (issue 51, item 2).

An :class:`UploadLayout` names every array an honest upload carries, with its dtype and shape, and the
``config`` and ``metrics`` names, where the method's server reads them. A dimension is an ``int`` (that
size) or a ``str``: a size the upload fixes (the classes a client holds, a clustering's prototypes), the
same wherever that name recurs in one upload, and at most ``limits[name]`` when given. Integer arrays may
bound their values (class ids in ``[0, C)``, counts >= 1), so what the aggregation indexes with is checked.

Where it comes from (:func:`expected_layout`): a method whose upload is not its broadcast's arrays declares
it with ``upload_layout(broadcast, info)`` (:class:`DeclaresUploads`), a function of the broadcast's layout
(never its values), the round and the client; any other method uploads exactly the arrays it was sent
(FedAvg and 32 more of the 47 built-in methods; 14 declare theirs). The engine's own uploads satisfy their
layout in every runtime (tests/test_flower.py runs every method through the Flower server, which checks
them); a Flower server refuses any other reply (:mod:`fedskew.engine.replies`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from fedskew.algorithms.base import Context
from fedskew.algorithms.messages import Payload
from fedskew.algorithms.steps import RoundInfo

#: a dimension: a fixed size, or the name of a size the upload fixes (the same wherever it recurs)
Dim = int | str


@dataclass(frozen=True)
class ArraySpec:
    """One array of an upload: its dtype, its shape and, for ids and counts, the range of its values."""

    shape: tuple[Dim, ...]
    dtype: torch.dtype
    low: int | None = None
    high: int | None = None  # inclusive

    @classmethod
    def like(cls, t: Tensor) -> ArraySpec:
        return cls(tuple(t.shape), t.dtype)

    def __str__(self) -> str:
        return f"[{', '.join(str(d) for d in self.shape)}] {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class UploadLayout:
    """Every array of an honest upload (``arrays``), upper bounds of its named sizes (``limits``) and, for a
    method whose server reads them, the exact names of its ``config`` and ``metrics`` values (``None``: any
    names; the server reads none of them)."""

    arrays: Mapping[str, ArraySpec]
    config: frozenset[str] | None = None
    metrics: frozenset[str] | None = None
    limits: Mapping[str, int] = field(default_factory=dict)


@runtime_checkable
class DeclaresUploads(Protocol):
    """A method whose upload is not the arrays it was sent: it says what it uploads."""

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The layout of client ``info.cid``'s upload in round ``info.round``, given its ``broadcast``."""
        ...


def specs_of(
    arrays: Mapping[str, Tensor], keep: Callable[[str], bool] | None = None, prefix: str = ""
) -> dict[str, ArraySpec]:
    """The exact specs of ``arrays`` (those ``keep`` accepts), their names prefixed with ``prefix``."""
    return {prefix + k: ArraySpec.like(v) for k, v in arrays.items() if keep is None or keep(k)}


def expected_layout(algorithm: object, broadcast: Payload, info: RoundInfo) -> UploadLayout:
    """What client ``info.cid`` uploads after receiving ``broadcast``: the method's declaration, else
    exactly the broadcast's arrays (names, shapes, dtypes)."""
    if isinstance(algorithm, DeclaresUploads):
        return algorithm.upload_layout(broadcast, info)
    return UploadLayout(specs_of(broadcast.arrays))


def class_rows(
    num_classes: int,
    rows: str = "k",
    dtype: torch.dtype = torch.float32,
    names: tuple[str, str] = ("classes", "counts"),
    **tables: tuple[Dim, ...],
) -> dict[str, ArraySpec]:
    """Per-class statistics of the classes a client holds (:func:`fedskew.algorithms.protos.pack`): class
    ids (``names[0]``, ``[rows]`` in ``[0, C)``), their sample counts (``names[1]``, ``[rows]``, >= 1; ``""``:
    none) and ``tables`` of ``dtype`` whose first dimension is ``rows`` (``protos=(d,)``: ``[rows, d]``)."""
    specs = {names[0]: ArraySpec((rows,), torch.int64, 0, num_classes - 1)}
    if names[1]:
        specs[names[1]] = ArraySpec((rows,), torch.int64, 1)
    specs.update({name: ArraySpec((rows, *dims), dtype) for name, dims in tables.items()})
    return specs


# ------------------------------------------------------------------------- model templates, cached
_TEMPLATES: dict[int, tuple[Context, dict[Hashable, nn.Module]]] = {}


def template(ctx: Context, cid: int | None) -> nn.Module:
    """Client ``cid``'s model template (``Context.model_template``), built once per architecture and
    context: the server checks every upload of every round against it. Read it; never train it."""
    held = _TEMPLATES.get(id(ctx))
    if held is None or held[0] is not ctx:
        _TEMPLATES.clear()  # one run's context at a time (the object is held, so its id is not reused)
        held = _TEMPLATES[id(ctx)] = (ctx, {})
    key = ctx.arch_key(cid)
    if key not in held[1]:
        held[1][key] = ctx.model_template(cid)
    return held[1][key]
