"""Build-time checks of the ``clock:`` section against the method and the rest of the config (one-line
:class:`~fedskew.errors.ConfigError` naming the key and the allowed values; docs/clock.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedskew.engine.sampling import clients_per_round
from fedskew.errors import ConfigError

if TYPE_CHECKING:
    from fedskew.experiment.config import Config

__all__ = ["check_clock"]


def check_clock(cfg: Config, alg: Any, mean_methods: list[str]) -> None:
    """The clock runs in the embedded engine, samples from the seed's stream, and its policies fit the
    method: asynchronous aggregation needs a mean (the contract's ``mean_aggregation`` seam), partial work
    a method that declares ``partial_work``."""
    clock = cfg.clock
    if clock is None:
        return
    if cfg.engine.runtime != "embedded":
        raise ConfigError(
            f"config key 'clock': the virtual clock runs in the embedded engine, not engine.runtime="
            f"{cfg.engine.runtime}; allowed: embedded"
        )
    if cfg.privacy.mechanism != "none" and (
        cfg.privacy.sampling == "poisson" or cfg.privacy.randomness == "secret"
    ):
        raise ConfigError(
            "config key 'clock': the clock samples from the seed's stream, which DP's secret or Poisson "
            "sampling replaces; allowed with privacy: privacy.randomness=reproducible, privacy.sampling=fixed"
        )
    if clock.availability == "trace" and clock.trace is None:
        raise ConfigError(
            "config key 'clock.availability': 'trace' needs clock.trace; allowed: always, bernoulli"
        )
    # values other than the defaults (a recorded config repeats every default: "was it given" cannot tell)
    changed = {
        k
        for k, f in type(clock).model_fields.items()
        if getattr(clock, k) != f.get_default(call_default_factory=True)
    }
    unread = [k for k in clock.ASYNC_ONLY if k in changed and not clock.asynchronous]
    unread += ["available"] if "available" in changed and clock.availability != "bernoulli" else []
    if unread:
        raise ConfigError(
            f"config key 'clock.{unread[0]}': read only by clock.aggregation=fedasync/fedbuff (available: by "
            f"clock.availability=bernoulli); here it would be ignored; allowed: leave it out"
        )
    if clock.asynchronous:
        _check_asynchronous(cfg, alg, mean_methods)
    if clock.late == "partial":
        _check_partial(cfg, alg)


def _check_asynchronous(cfg: Config, alg: Any, mean_methods: list[str]) -> None:
    clock = cfg.clock
    assert clock is not None
    name = f"clock.aggregation={clock.aggregation}"
    if not alg.mean_aggregation:
        raise ConfigError(
            f"config key 'clock.aggregation': {clock.aggregation} mixes model updates, and "
            f"'{cfg.algorithm.name}' does not aggregate by a mean; allowed methods: {', '.join(mean_methods)}"
        )
    secured = [k for k, on in (("attack", cfg.attack.name != "none"), ("defence", cfg.defence.name != "mean"),
                               ("privacy", cfg.privacy.mechanism != "none")) if on]  # fmt: skip
    if secured:
        raise ConfigError(
            f"config key 'clock.aggregation': {name} runs without {', '.join(secured)}; allowed: sync"
        )
    if clock.deadline is not None or clock.over_selection > 1:
        raise ConfigError(
            f"config key 'clock.deadline' / 'clock.over_selection': policies of synchronous rounds, not of "
            f"{name}; allowed: deadline unset, over_selection 1"
        )
    n = cfg.data.num_clients
    concurrency = clock.concurrency or clients_per_round(n, cfg.client.fraction)
    if concurrency > n:
        raise ConfigError(f"config key 'clock.concurrency': {concurrency} > the {n} clients; allowed: 1..{n}")
    buffer = clock.buffer or clients_per_round(n, cfg.client.fraction)
    if clock.aggregation == "fedbuff" and buffer > concurrency:
        raise ConfigError(
            f"config key 'clock.buffer': K={buffer} updates can never be buffered by {concurrency} "
            f"concurrent clients; allowed: 1..{concurrency}"
        )


def _check_partial(cfg: Config, alg: Any) -> None:
    clock = cfg.clock
    assert clock is not None
    if clock.deadline is None:
        raise ConfigError(
            "config key 'clock.late': 'partial' needs clock.deadline; allowed without one: drop"
        )
    if not alg.partial_work:
        raise ConfigError(
            f"config key 'clock.late': '{cfg.algorithm.name}' does not declare partial_work (its update "
            "assumes the planned local steps); allowed: drop, or partial with fedprox, fednova"
        )
    if cfg.engine.mode != "sequential" or cfg.engine.workers > 1:
        raise ConfigError(
            "config key 'clock.late': partial work cuts each client's steps in the sequential executor; "
            "allowed: engine.mode=sequential with engine.workers=1"
        )
