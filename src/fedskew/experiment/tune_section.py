"""The ``tuning:`` config section: how a config's values were chosen by ``fedskew tune`` (issue 52, item 3).

``fedskew tune`` writes one config per method (``DIR/chosen/<method>.yaml``) whose ``tuning`` section records
the seeds the values were chosen on. A run of that config on one of those seeds would report a number that
the choice has already seen, so :func:`check_tuning_seed` refuses it in one line wherever a config is built
(``fedskew run``, ``fedskew sweep``, a Flower app). The section is provenance, not a setting: it is left out
when configs are compared (``config_sections.WATCH_ONLY``), so a reporting run groups with its peers.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from fedskew.errors import ConfigError, FedskewError
from fedskew.settings import Strict


class TuningSection(Strict):
    """Where a config's values come from: the tuning seeds (refused as reporting seeds) and the study."""

    seeds: list[int] = Field(..., min_length=1, description="the tuning runs' seeds (never report on them)")
    trials: int = Field(..., ge=1, description="completed trials of this method (the same for every method)")
    study: str | None = Field(None, description="the tune's folder (its journal, runs and budget.json)")
    objective: str = Field("final val_accuracy, mean over the tuning seeds", description="what was maximised")
    value: float | None = Field(None, description="the chosen trial's objective")
    values: dict[str, Any] = Field(default_factory=dict, description="the chosen knob values, by config key")


def check_tuning_seed(seed: int, tuning: TuningSection | None) -> None:
    """A one-line :class:`ConfigError` when ``seed`` is one of the seeds the config was tuned on."""
    if tuning is not None and seed in tuning.seeds:
        seeds = ", ".join(str(s) for s in tuning.seeds)
        raise ConfigError(
            f"config key 'seed': {seed} is one of the seeds its values were tuned on (tuning.seeds: "
            f"{seeds}); allowed: a reporting seed outside them",
            key="seed",
        )


def check_no_tuning_runs(label: str, runs: list[tuple[int, dict[str, Any] | None, str]]) -> None:
    """A one-line :class:`~fedskew.errors.FedskewError` when a report group (``label``; its runs as
    ``(seed, tuning record or None, folder)``) mixes a tuned config's reporting runs with runs on its tuning
    seeds: a tune's trial runs carry no ``tuning`` record and so group with the chosen config's runs, and
    their seeds' numbers have already been seen by the choice."""
    tuned = {int(s) for _, rec, _ in runs if isinstance(rec, dict) for s in rec.get("seeds", [])}
    for seed, _, folder in runs:
        if seed in tuned:
            raise FedskewError(
                f"report group '{label}' holds run '{folder}' on tuning seed {seed} beside runs of the "
                "config tuned on it; allowed: report the sweep's result folder without the tune's folder"
            )
