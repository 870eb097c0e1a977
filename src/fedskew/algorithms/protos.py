"""Prototype primitives shared by FedProto, MP-FedCL and FedSKC.

A *prototype table* is a dense tensor ``[C, D]`` (one prototype per class) or ``[C, K, D]`` (K per class,
MP-FedCL) with a boolean mask ``[C]`` / ``[C, K]`` of the entries that exist. Tables are dense so that
aggregation and prediction are single vectorized ops; the mask replaces the reference codes' per-class dicts.
``D`` may be an embedding size (FedProto, MP-FedCL) or the number of classes (FedSKC's logit prototypes).

Everything runs on the tensors' device; nothing loops over samples in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedskew.errors import ConfigError

AGGREGATIONS = ("weighted", "mean")


def class_sums(
    values: Tensor, labels: Tensor, num_classes: int, weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-class sums ``[C, D]`` of ``values [N, D]`` and per-class totals of ``weights`` (counts if None).

    Sums accumulate in float64 so long streams (an epoch of batches) lose nothing.
    """
    d = values.shape[1]
    sums = torch.zeros(num_classes, d, dtype=torch.float64, device=values.device)
    counts = torch.zeros(num_classes, dtype=torch.float64, device=values.device)
    w = torch.ones_like(labels, dtype=torch.float64) if weights is None else weights.double()
    sums.index_add_(0, labels, values.double() * w[:, None])
    counts.index_add_(0, labels, w)
    return sums, counts


def class_means(values: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Local prototypes, FedProto Eq. (3): the mean of ``values`` per class. Returns ``(table [C, D] in
    the dtype of ``values``, counts [C] int64)``; classes without samples have a zero row and count 0."""
    sums, counts = class_sums(values, labels, num_classes)
    means = sums / counts.clamp_min(1)[:, None]
    return means.to(values.dtype), counts.round().long()


@dataclass
class ClassAccumulator:
    """Running per-class sums and counts, fed batch by batch (FedProto collects the last local epoch's
    embeddings as it trains, as Algorithm 1 and the authors' code do)."""

    sums: Tensor  # [C, D] float64
    counts: Tensor  # [C] float64

    @classmethod
    def zeros(cls, num_classes: int, dim: int, device: torch.device | str) -> ClassAccumulator:
        return cls(
            torch.zeros(num_classes, dim, dtype=torch.float64, device=device),
            torch.zeros(num_classes, dtype=torch.float64, device=device),
        )

    def add(self, values: Tensor, labels: Tensor) -> None:
        self.sums.index_add_(0, labels, values.detach().double())
        self.counts.index_add_(0, labels, torch.ones_like(labels, dtype=torch.float64))

    def means(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """``(table [C, D], counts [C] int64)`` as :func:`class_means`."""
        return (self.sums / self.counts.clamp_min(1)[:, None]).to(dtype), self.counts.round().long()


def pack(table: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The rows of ``table`` whose ``counts`` are positive: ``(classes [P] int64, rows [P, ...],
    counts [P] int64)`` — what a client uploads (only the classes it holds, as in FedProto)."""
    classes = torch.nonzero(counts > 0).flatten()
    return classes, table[classes], counts[classes].long()


def aggregate_prototypes(
    classes: Tensor,
    protos: Tensor,
    counts: Tensor,
    num_classes: int,
    mode: str = "weighted",
) -> tuple[Tensor, Tensor]:
    """Per-class aggregation of uploaded prototypes over the clients holding each class (FedProto Eq. 6).

    ``classes [P]``, ``protos [P, ...]``, ``counts [P]`` are the concatenated uploads of all clients (one row
    per (client, class)). ``mode``:

    * ``weighted`` (default): ``C̄_j = Σ_{i∈N_j} |D_ij| / Σ_{i'∈N_j} |D_i'j| · C_ij``;
    * ``mean`` (the authors' code): ``C̄_j = (1/|N_j|) Σ_{i∈N_j} C_ij``.

    Never both factors (the printed Eq. 6 applies both, shrinking C̄_j by |N_j|; see docs/decisions.md,
    "FedProto: Eq. 6 aggregation weights"). Returns
    ``(table [C, ...], present [C] bool)``; a class no client uploaded has a zero row and ``present=False``.
    """
    if mode not in AGGREGATIONS:
        raise ConfigError(f"prototype aggregation '{mode}' unknown; allowed: {', '.join(AGGREGATIONS)}")
    w = counts.double() if mode == "weighted" else torch.ones_like(counts, dtype=torch.float64)
    flat = protos.reshape(protos.shape[0], -1)
    sums, totals = class_sums(flat, classes, num_classes, w)
    present = totals > 0
    table = (sums / totals.clamp_min(1e-300)[:, None]).to(protos.dtype)
    return table.reshape(num_classes, *protos.shape[1:]), present


def squared_distances(x: Tensor, protos: Tensor) -> Tensor:
    """``‖x_n − p_m‖²`` for ``x [N, D]`` and ``protos [M, D]`` as ``[N, M]``, via one matrix product."""
    d = x.pow(2).sum(1, keepdim=True) - 2.0 * x @ protos.T + protos.pow(2).sum(1)[None]
    return d.clamp_min_(0.0)


def nearest_prototype_scores(x: Tensor, table: Tensor, mask: Tensor | None = None) -> Tensor:
    """Class scores ``[N, C]`` for nearest-prototype inference, FedProto Eq. (4): ``−min_k ‖x − p_{c,k}‖²``.

    ``table`` is ``[C, D]`` or ``[C, K, D]`` (the score of a class is that of its nearest prototype).
    ``mask`` (``[C]``, ``[C, K]`` or per-sample ``[N, C]``) excludes entries with score ``−inf`` (FedProto
    restricts a client to its own classes, as its authors' code; +∞ distance instead of the code's sentinel
    100).
    ``argmax`` of the scores is the predicted class; squared distance gives the same argmin as L2 and MSE.
    """
    c = table.shape[0]
    flat = table.reshape(-1, table.shape[-1])
    d = squared_distances(x, flat.to(x.dtype))
    if table.dim() == 3:
        k = table.shape[1]
        d = d.view(-1, c, k)
        if mask is not None and mask.dim() == 2 and mask.shape == (c, k):
            d = d.masked_fill(~mask[None], float("inf"))
            mask = None
        d = d.min(2).values
    scores = -d
    if mask is not None:
        m = mask if mask.dim() == 2 else mask[None]
        scores = scores.masked_fill(~m, float("-inf"))
    return scores


def kmeans(
    x: Tensor,
    k: int,
    iters: int = 50,
    generator: torch.Generator | None = None,
    tol: float = 1e-6,
    init: str = "kmeans++",
) -> tuple[Tensor, Tensor]:
    """Lloyd's k-means (MP-FedCL's multi-prototypes, Eq. 7). Returns ``(centers [k', D], assignment [N])``
    with ``k' = min(k, N)``; an emptied cluster is re-seeded at the farthest point. ``init``: ``kmeans++``
    seeding or ``random`` (k distinct data points, the paper's "randomly selected" centroids); Lloyd stops
    when the centers move less than ``tol`` (squared) or after ``iters`` iterations.

    Deterministic for a given ``generator`` (CPU generator; seeding draws are made on the CPU).
    """
    n = x.shape[0]
    if n == 0:
        raise ValueError("kmeans: no points")
    if init not in ("kmeans++", "random"):
        raise ValueError(f"kmeans: init must be kmeans++ or random, got {init!r}")
    k = min(k, n)
    xd = x.double()
    if init == "random":
        return _lloyd(xd, xd[torch.randperm(n, generator=generator)[:k].to(x.device)], iters, tol, x.dtype)
    first = int(torch.randint(n, (1,), generator=generator))
    centers = [xd[first]]
    closest = squared_distances(xd, xd[first : first + 1])[:, 0]
    for _ in range(1, k):
        total = closest.sum()
        if total <= 0:  # all remaining points coincide with a center
            idx = int(torch.randint(n, (1,), generator=generator))
        else:
            probs = (closest / total).cpu()
            idx = int(torch.multinomial(probs, 1, generator=generator))
        centers.append(xd[idx])
        closest = torch.minimum(closest, squared_distances(xd, xd[idx : idx + 1])[:, 0])
    return _lloyd(xd, torch.stack(centers), iters, tol, x.dtype)


def _lloyd(xd: Tensor, c: Tensor, iters: int, tol: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    k = c.shape[0]
    for _ in range(iters):
        dist = squared_distances(xd, c)
        assign = dist.argmin(1)
        sums, counts = class_sums(xd, assign, k)
        empty = counts == 0
        if empty.any():  # re-seed empty clusters at the points farthest from their centers
            far = dist.gather(1, assign[:, None])[:, 0].argsort(descending=True)[: int(empty.sum())]
            sums[empty] = xd[far]
            counts[empty] = 1.0
        new = sums / counts[:, None]
        shift = float((new - c).pow(2).sum())
        c = new
        if shift <= tol:
            break
    assign = squared_distances(xd, c).argmin(1)
    return c.to(dtype), assign
