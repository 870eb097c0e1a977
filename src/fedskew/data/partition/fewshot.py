"""The few-shot protocol of federated CLIP adaptation (CacheFL, Yi et al. 2025, §4.1 and Appendix B.1).

CacheFL follows CoOp / Tip-Adapter: the training set is ``K`` (16) real images per class
(:func:`few_shot_indices`), then split over the clients by one of three rules. ``iid_divmod`` deals every
class's shots out as evenly as possible, the paper's own example (16 shots over 10 clients: clients 1–4
get one image per class, clients 5–10 two); ``class_chunks`` is its "extreme non-IID" split, each client
owning a distinct contiguous block of classes; the Dirichlet rule is the existing ``dirichlet`` scheme.
"""

from __future__ import annotations

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition.core import assign_counts, check_labels, class_blocks, make_rng, need, to_parts
from fedskew.errors import DataError


def few_shot_indices(labels: np.ndarray, shots: int, num_classes: int, seed: int) -> np.ndarray:
    """Sorted indices of ``shots`` samples of every class, drawn uniformly without replacement.

    Each class's samples are put in a seeded random order and the first ``shots`` are taken, so for one
    seed the sets are nested (the 4-shot set is inside the 16-shot set). A class with fewer than ``shots``
    samples is a :class:`DataError` naming it.
    """
    y = check_labels(labels, 1, num_classes, "shots")
    if shots < 1:
        raise DataError(f"shots must be >= 1, got {shots}")
    order, start, sizes = class_blocks(y, num_classes, make_rng(seed))
    short = np.flatnonzero(sizes < shots)
    if short.size:
        c = int(short[0])
        raise DataError(f"shots={shots}: class {c} has only {sizes[c]} training samples; lower shots")
    take = order[np.repeat(start, shots) + np.tile(np.arange(shots), num_classes)]
    return np.sort(take).astype(np.int64)


@PARTITIONERS.register("iid_divmod")
def iid_divmod(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
) -> list[np.ndarray]:
    """IID by class (CacheFL, Appendix B.1): class c's n_c samples are dealt as ``q, r = divmod(n_c, N)``.

    Client j (0-indexed) gets ``q + 1`` random samples of class c if ``j >= N - r``, else ``q``; with 16
    shots and 10 clients that is [1, 1, 1, 1, 2, 2, 2, 2, 2, 2] per class, the paper's example. Every
    client holds every class when n_c >= N; every sample is used.
    """
    y = check_labels(labels, num_clients, num_classes, "iid_divmod")
    q, r = np.divmod(np.bincount(y, minlength=num_classes), num_clients)
    extra = np.arange(num_clients)[:, None] >= num_clients - r[None, :]  # [N, C]
    counts = (q[None, :] + extra).astype(np.int64)
    return to_parts(assign_counts(y, counts, make_rng(seed)), num_clients)


@PARTITIONERS.register("class_chunks")
def class_chunks(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Disjoint classes (CacheFL's extreme non-IID, "pat"): client j owns the j-th contiguous class chunk.

    The class list 0..C-1 is cut into N chunks with ``np.array_split`` (the first ``C mod N`` chunks are
    one class longer) and client j receives every sample of the classes in chunk j: 100 classes over 10
    clients gives 10 classes each, EuroSAT's 10 classes one each. Needs N <= C; no randomness (``seed`` is
    unused); every sample is used.
    """
    y = check_labels(labels, num_clients, num_classes, "class_chunks")
    need(
        num_clients <= num_classes,
        "class_chunks",
        f"{num_clients} clients need at least as many classes, got {num_classes}",
    )
    owner_of_class = np.repeat(
        np.arange(num_clients), [len(c) for c in np.array_split(np.arange(num_classes), num_clients)]
    )
    return to_parts(owner_of_class[y], num_clients)
