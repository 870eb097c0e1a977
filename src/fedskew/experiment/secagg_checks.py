"""Build-time checks of ``engine.secagg`` (secure aggregation with Flower's SecAgg+:
:mod:`fedskew.flower.secure`): one-line :class:`~fedskew.errors.ConfigError` naming the key and the
allowed values."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedskew.errors import ConfigError

if TYPE_CHECKING:
    from fedskew.experiment.config import Config

#: the runtimes whose server is a Flower ServerApp (SecAgg+ is Flower's protocol)
SECAGG_RUNTIMES = ("flower-simulation", "flower-deployment")


def check_secagg(cfg: Config, alg: Any, mean_methods: list[str]) -> None:
    """``engine.secagg`` needs a Flower runtime, at least 2 nodes, a method whose aggregation is a weighted
    mean (the server sees only the sum), no rule or mechanism that needs the individual updates (robust
    rules, model-poisoning attacks, DP clipping of each update) and the folded mean (the section's own
    values are checked as Flower's ``SecAggPlusWorkflow`` checks them:
    :class:`fedskew.settings.SecAggSection`)."""
    section = cfg.engine.secagg
    if section is None:
        return
    from fedskew.algorithms.security.rules import poisons_updates, replaces_mean

    key = "config key 'engine.secagg'"
    if cfg.engine.runtime not in SECAGG_RUNTIMES:
        raise ConfigError(
            f"{key}: secure aggregation is Flower's SecAgg+, not available on engine.runtime="
            f"{cfg.engine.runtime}; allowed: {', '.join(SECAGG_RUNTIMES)}"
        )
    if cfg.engine.nodes < 2:
        raise ConfigError(f"{key}: a secure sum needs engine.nodes >= 2 (got {cfg.engine.nodes})")
    if not alg.mean_aggregation:
        raise ConfigError(
            f"{key}: algorithm '{cfg.algorithm.name}' does not aggregate by a weighted mean of its uploads; "
            f"allowed algorithms: {', '.join(mean_methods)}"
        )
    needs_each = [
        label
        for label, on in (
            (f"defence.name={cfg.defence.name}", replaces_mean(cfg.defence)),
            (f"attack.name={cfg.attack.name}", poisons_updates(cfg.attack)),
            (f"privacy.mechanism={cfg.privacy.mechanism}", cfg.privacy.mechanism != "none"),
        )
        if on
    ]
    if needs_each:
        raise ConfigError(
            f"{key}: {needs_each[0]} needs every client's update, and SecAgg+ shows the server only their "
            "sum; allowed: defence.name=none, no model-poisoning attack, privacy.mechanism=none"
        )
    if not cfg.engine.fold_uploads:
        raise ConfigError(f"{key}: the secure sum is the folded mean; allowed: engine.fold_uploads=true")
