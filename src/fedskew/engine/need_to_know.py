"""Class counts on a need-to-know basis: the federation as a node's algorithm context sees it.

An algorithm's context holds every client's class histogram (``Context.class_counts``) and sample count
(``Context.client_sizes``). The server needs them (FedProto's broadcast, FedGen's per-label teacher weights,
the reply caps of :mod:`fedskew.engine.replies`); a node runs only client-side hooks, which for most methods
read nothing of other clients. Each method declares what its client-side hooks read
(``Algorithm.federation_counts``), and a node's context is built from :func:`node_view`:

* ``own``: the node's own clients' histograms and sizes; every other client's row and size is 0;
* ``sizes``: also every client's sample count, no other histogram (FedEnt's θ_i = n_i / n);
* ``classes``: every client's histogram (FedGen's label prior, the federation's class totals).

The levels are ordered: each discloses what the one before it does and more (:func:`covers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from fedskew.engine.assembly import ClientMeta
from fedskew.errors import ConfigError, FedskewError

#: the disclosure levels, from the least to the most
LEVELS: tuple[str, ...] = ("own", "sizes", "classes")


def _keep(values: Tensor, owned: Sequence[int]) -> Tensor:
    """``values`` with every row outside ``owned`` zeroed (a new tensor)."""
    kept = torch.zeros_like(values)
    index = torch.tensor(list(owned), dtype=torch.long)
    kept[index] = values[index]
    return kept


def _own(meta: ClientMeta, owned: Sequence[int]) -> ClientMeta:
    return replace(meta, class_counts=_keep(meta.class_counts, owned), sizes=_keep(meta.client_sizes, owned))


def _sizes(meta: ClientMeta, owned: Sequence[int]) -> ClientMeta:
    return replace(meta, class_counts=_keep(meta.class_counts, owned), sizes=meta.client_sizes.clone())


def _classes(meta: ClientMeta, owned: Sequence[int]) -> ClientMeta:
    return meta


#: level -> the view of a federation's counts that a node owning ``owned`` gets at that level
MASKS: dict[str, Callable[[ClientMeta, Sequence[int]], ClientMeta]] = {
    "own": _own,
    "sizes": _sizes,
    "classes": _classes,
}


def check_level(need: str, what: str = "federation_counts") -> str:
    """``need`` if it is a level; else a one-line error naming ``what`` and the allowed levels."""
    if need not in MASKS:
        raise ConfigError(f"{what}={need!r}: allowed levels are {', '.join(LEVELS)}")
    return need


def covers(given: str, need: str) -> bool:
    """Whether a view at level ``given`` holds everything level ``need`` discloses."""
    return LEVELS.index(check_level(given)) >= LEVELS.index(check_level(need))


def node_view(meta: ClientMeta, owned: Sequence[int], need: str) -> ClientMeta:
    """The :class:`ClientMeta` the algorithm context of a node owning clients ``owned`` is built from: what
    level ``need`` (the method's ``federation_counts``) discloses of ``meta``; shapes, the number of clients
    and the data pipeline's assets are the federation's. An unknown level, or an owned client outside the
    federation, is a one-line error."""
    mask = MASKS[check_level(need)]
    stray = sorted({int(c) for c in owned} - set(range(meta.num_clients)))
    if stray:
        raise FedskewError(f"clients {stray} are not in the federation (clients 0-{meta.num_clients - 1})")
    return mask(meta, sorted({int(c) for c in owned}))
