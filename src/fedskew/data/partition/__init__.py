"""Partitioners: pure functions ``(labels, num_clients, seed) -> per-client index arrays``, by family.

Every scheme is registered in :data:`fedskew.data.base.PARTITIONERS` under its public name and has the
signature ``fn(labels, num_clients, seed, *, num_classes, domains=None, **params) -> list[np.ndarray]``.
All ``params`` are keyword-only with defaults (configs are validated against the signature). The result is
``num_clients`` disjoint, sorted ``int64`` arrays of indices into ``labels``; a scheme may leave samples
unused where it says so (``nway_kshot``, ``longtail``, ``dirichlet`` in ``per_client`` mode, ...). The same
``seed`` always gives the same partition, whatever algorithm later trains on it. Infeasible requests raise
:class:`~fedskew.errors.DataError` naming the reason. Background and pictures: ``docs/partitions.md``.

Families: :mod:`.quantity` (iid, quantity), :mod:`.dirichlet` and :mod:`.pathological` (label skew),
:mod:`.domain` (feature skew), :mod:`.fewshot` (the K-shot protocol and its iid / disjoint-class splits),
:mod:`.compose` (long tail ∘ any), :mod:`.splits` (per-client test and
validation splits), :mod:`.pfllib` (PFLlib's pat / dir and its per-client split of a merged pool);
:mod:`.core` holds the shared machinery and :func:`apply_partition`.
"""

from fedskew.data.partition.compose import longtail
from fedskew.data.partition.core import (
    RESERVED,
    apply_partition,
    check_parts,
    child_seed,
    partition_options,
)
from fedskew.data.partition.dirichlet import dirichlet
from fedskew.data.partition.domain import domain
from fedskew.data.partition.fewshot import class_chunks, few_shot_indices, iid_divmod
from fedskew.data.partition.pathological import classes_per_client, nway_kshot, shards
from fedskew.data.partition.pfllib import merged_client_split, pfllib_dir, pfllib_pat, share_split
from fedskew.data.partition.quantity import iid, quantity
from fedskew.data.partition.splits import client_test_split, validation_split

__all__ = [
    "RESERVED",
    "apply_partition",
    "check_parts",
    "child_seed",
    "class_chunks",
    "classes_per_client",
    "client_test_split",
    "dirichlet",
    "domain",
    "few_shot_indices",
    "iid",
    "iid_divmod",
    "longtail",
    "merged_client_split",
    "nway_kshot",
    "partition_options",
    "pfllib_dir",
    "pfllib_pat",
    "quantity",
    "shards",
    "share_split",
    "validation_split",
]
