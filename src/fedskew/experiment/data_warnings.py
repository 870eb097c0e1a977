"""One warning when partitioning leaves clients without training data or with less than one batch.

Why: a skewed partition (Dirichlet with a small alpha, many clients) silently empties clients; they then
upload the model they were sent, and a run looks like it learns slowly for no visible reason. The warning
names the count and the setting that causes it, once per run (the run loop calls it after assembly, on the
process that owns the run: never once per Flower node or per round).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fedskew.experiment.config import Config

__all__ = ["small_clients_message", "warn_small_clients"]

log = logging.getLogger("fedskew.data")


def partition_setting(cfg: Config) -> str:
    """``data.partition: dirichlet alpha=0.05`` (name first, then its parameters as written)."""
    part: dict[str, Any] = dict(cfg.data.partition)
    name = part.pop("name", "?")
    params = " ".join(f"{k}={v}" for k, v in part.items())
    return f"data.partition: {name}{' ' + params if params else ''}"


def small_clients_message(cfg: Config, sizes: Sequence[int]) -> str | None:
    """The warning for clients with these training-sample counts (``None``: every client has a batch)."""
    batch = cfg.client.batch_size
    empty = sum(1 for s in sizes if s == 0)
    small = sum(1 for s in sizes if 0 < s < batch)
    if not empty and not small:
        return None
    n, setting = len(sizes), partition_setting(cfg)
    few = f"fewer than client.batch_size={batch} samples"
    if not empty:
        return f"{small} of {n} clients have {few} after partitioning ({setting})"
    more = f"; {small} more have {few}" if small else ""
    return f"{empty} of {n} clients have no training data after partitioning ({setting}){more}"


def warn_small_clients(cfg: Config, sizes: Sequence[int]) -> None:
    """Log :func:`small_clients_message` as one warning, if there is one."""
    message = small_clients_message(cfg, sizes)
    if message is not None:
        log.warning(message)
