"""``data.split``: where the clients' test sets come from (issue 52, PFLlib's protocol).

Absent (the default): training samples come from the dataset's training split and each client's test set
from its test split (``data.test``). ``{merged: true, train_share: 0.75}``: the two splits are pooled, the
partition deals the pool, and each client keeps ``floor(train_share·n)`` of its own samples for training and
the rest as its test set (:func:`fedskew.data.merged.build_merged`), as PFLlib's benchmark does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fedskew.errors import ConfigError
from fedskew.settings import Strict

if TYPE_CHECKING:
    from fedskew.experiment.config_sections import DataConfig


class SplitSection(Strict):
    """How train and test samples are formed (``data.split``)."""

    merged: bool = Field(
        False,
        description="pool the dataset's train and test splits, partition the pool, and cut each client's own "
        "samples into train / test (PFLlib)",
    )
    train_share: float = Field(
        0.75,
        gt=0.0,
        lt=1.0,
        description="with merged: the share of each client's samples it trains on, floor-rounded as "
        "scikit-learn's train_test_split (PFLlib: 0.75)",
    )


#: settings that choose other samples than a merged pool would, by config key (checked while it is merged)
_CLASHES = {
    "data.test": lambda d: bool(d.test),
    "data.shots": lambda d: d.shots is not None,
    "data.val_shots": lambda d: d.val_shots is not None,
    "data.train_limit": lambda d: d.train_limit is not None,
    "data.vision_language": lambda d: d.vision_language is not None,
    "data.source": lambda d: d.source != "partition",
}


def check_split(data: DataConfig) -> None:
    """One-line ConfigError for a merged pool with a setting that picks test or training rows itself."""
    split = data.split
    if split is None or not split.merged:
        return
    for key, clashes in _CLASHES.items():
        if clashes(data):
            raise ConfigError(
                f"config key '{key}' cannot be combined with data.split.merged (each client's test set is "
                f"cut from its own samples); allowed: leave {key} unset, or data.split.merged false"
            )
