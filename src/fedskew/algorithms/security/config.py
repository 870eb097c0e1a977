"""The :class:`SecurityPlan` a run derives from its ``attack`` (simulation only), ``defence`` (robust
aggregation) and ``privacy`` (client-level differential privacy) config sections (:mod:`fedskew.settings`)
and its federation: identical in every process of a run.

Every check that can fail is here, with a one-line error naming the key and the allowed values.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedskew.algorithms.security.rules import ATTACKS, DEFENCES, poisons_updates, replaces_mean
from fedskew.errors import ConfigError
from fedskew.seeding import derive_seed
from fedskew.settings import (
    AdaptiveClip,
    AttackSection,
    DefenceSection,
    PrivacySection,
)


@dataclass(frozen=True)
class SecurityPlan:
    """A run's resolved threat model and protections."""

    attack: AttackSection
    defence: DefenceSection
    privacy: PrivacySection
    malicious: frozenset[int]
    per_round: int  # m: clients sampled a round
    num_clients: int
    byzantine: int  # f: malicious uploads a robust rule assumes per round
    rounds: int

    @property
    def noise(self) -> float:
        """The update noise multiplier z actually used (0 without privacy); computed on first use (a
        calibration to a target ε takes seconds, and a Flower node of a central-DP run never needs it)."""
        return _noise_and_epsilons(self.privacy, self.num_clients, self.per_round, self.rounds)[0]

    @property
    def effective_noise(self) -> float:
        """The noise multiplier the accountant sees (z_eff under adaptive clipping, else ``noise``)."""
        return _noise_and_epsilons(self.privacy, self.num_clients, self.per_round, self.rounds)[1]

    @property
    def epsilons(self) -> tuple[float, ...]:
        """ε after each round from ``privacy.accountant``; empty without privacy and in a reproducible run,
        which is not private (``NOT_PRIVATE``)."""
        if not self.private:
            return ()
        return _noise_and_epsilons(self.privacy, self.num_clients, self.per_round, self.rounds)[2]

    @property
    def private(self) -> bool:
        """A DP run whose noise and sample are secret: the only kind that reports ε as a guarantee."""
        return self.privacy.mechanism != "none" and self.privacy.randomness == "secret"

    @property
    def sensitivity_factor(self) -> float:
        """The L2 sensitivity of the sum in units of C: 2 (replace-one) or 1 (add/remove)."""
        return 2.0 if self.privacy.adjacency == "replace_one" else 1.0

    def accounting(self) -> dict[str, object]:
        """``summary.json``'s ``privacy`` entry: the mechanism, and ε from both accountants with their
        adjacency (``None`` with the reason where an accountant does not cover the mechanism)."""
        p = self.privacy
        out: dict[str, object] = {
            "mechanism": p.mechanism, "randomness": p.randomness, "sampling": p.sampling,
            "adjacency": p.adjacency, "accountant": p.accountant, "delta": p.delta,
            "noise_multiplier": self.noise, "clip": p.clip,
        }  # fmt: skip
        if not self.private:
            out["guarantee"] = NOT_PRIVATE
            return out
        out["guarantee"] = f"({self.epsilons[-1]:.4g}, {p.delta})-DP" if self.epsilons else "none"
        accountants: tuple[Literal["rdp", "pld"], ...] = ("rdp", "pld")
        for name in accountants:
            out[f"epsilon_{name}"], out[f"{name}_note"] = _final_epsilon(p, name, self)
        return out

    @property
    def active(self) -> bool:
        return self.attack.name != "none" or self.defence.name != "mean" or self.privacy.mechanism != "none"

    @property
    def touches_uploads(self) -> bool:
        """Whether the server changes uploads before the algorithm aggregates them (local DP acts on the
        clients)."""
        return (
            poisons_updates(self.attack) or replaces_mean(self.defence) or self.privacy.mechanism == "central"
        )

    def is_malicious(self, cid: int | None) -> bool:
        return cid is not None and cid in self.malicious


def malicious_clients(attack: AttackSection, num_clients: int, seed: int) -> frozenset[int]:
    """The malicious clients: ``attack.clients``, else ``round(fraction · N)`` drawn with the run's seed."""
    if attack.name == "none":
        return frozenset()
    if attack.clients is not None:
        bad = [c for c in attack.clients if not 0 <= c < num_clients]
        if bad:
            raise ConfigError(f"attack.clients: {bad} not in 0-{num_clients - 1}")
        return frozenset(attack.clients)
    k = round(attack.fraction * num_clients)
    rng = np.random.default_rng(derive_seed(seed, 0xBAD))
    return frozenset(int(c) for c in rng.choice(num_clients, size=k, replace=False))


def _byzantine(defence: DefenceSection, attack: AttackSection, per_round: int) -> int:
    """f, the malicious uploads a round that a rule assuming a fraction of them (``DefenceRule.byzantine``)
    tolerates: one line naming the condition when m is too small."""
    frac = defence.byzantine_fraction if defence.byzantine_fraction is not None else attack.fraction
    name, condition = defence.name, DEFENCES.get(defence.name).byzantine
    if condition is None:
        return 0
    if frac >= 0.5:
        raise ConfigError(
            f"defence.byzantine_fraction={frac}: {name} tolerates less than 0.5; allowed: [0, 0.5)"
        )
    f = math.ceil(frac * per_round)
    a, b = condition
    if per_round < a * f + b:
        raise ConfigError(
            f"defence.name={name}: needs clients per round m >= {a}f + {b}; m = {per_round}, f = {f} "
            f"(byzantine_fraction {frac}); sample more clients or assume fewer attackers"
        )
    return f


def _check_privacy(privacy: PrivacySection, defence: DefenceSection) -> None:
    if privacy.mechanism == "none":
        return
    if privacy.clip <= 0:
        raise ConfigError(f"privacy.clip={privacy.clip}: the clip norm must be > 0")
    if privacy.delta is None or not 0 < privacy.delta < 1:
        raise ConfigError(f"privacy.delta={privacy.delta}: give δ in (0, 1), e.g. 1e-5 or 1/num_clients")
    if (privacy.noise_multiplier is None) == (privacy.target_epsilon is None):
        raise ConfigError("privacy: give exactly one of noise_multiplier and target_epsilon")
    if privacy.target_epsilon is not None and privacy.target_epsilon <= 0:
        raise ConfigError(f"privacy.target_epsilon={privacy.target_epsilon}: must be > 0")
    if privacy.adaptive is not None and privacy.mechanism != "central":
        raise ConfigError("privacy.adaptive: adaptive clipping needs privacy.mechanism=central")
    if replaces_mean(defence):
        raise ConfigError(
            f"defence.name={defence.name} with privacy: a robust rule changes the sensitivity the accountant "
            "assumes; allowed with privacy: mean (clipping already bounds every update)"
        )
    if importlib.util.find_spec("dp_accounting") is not None:
        from fedskew.algorithms.security import accounting

        local = privacy.mechanism == "local"
        why = accounting.unsupported(privacy.accountant, privacy.sampling, privacy.adjacency, local)
        if why is not None:
            raise ConfigError(f"privacy.accountant={privacy.accountant}: {why}")


def check_private_run(
    privacy: PrivacySection, algorithm: str, reads_client_scalars: bool, protocol: str, data_source: str
) -> None:
    """Refuse (one line) what would release an unnoised statistic of client data from a DP run: a method
    whose aggregation reads per-client scalars, personal models (trained on client data, never noised) and
    evaluation on the nodes' own test sets."""
    if privacy.mechanism == "none":
        return
    if reads_client_scalars:
        raise ConfigError(
            f"privacy.mechanism={privacy.mechanism}: algorithm '{algorithm}' aggregates per-client scalars "
            "its clients report (unbounded, so no noise covers them); allowed: a method whose aggregation is "
            "a mean of the uploads, e.g. fedavg, fedprox, fedadam"
        )
    if protocol == "personalized":
        raise ConfigError(
            "privacy with eval.protocol=personalized: personal models and per-client scores are statistics "
            "of client data that the mechanism does not noise; allowed: global"
        )
    if data_source == "nodes":
        raise ConfigError(
            "privacy with data.source=nodes: the nodes would score the model on their own test data and send "
            "unnoised counts; allowed: data.source=partition"
        )


#: what a DP run with ``privacy.randomness: reproducible`` says instead of ε (summary.json, the log)
NOT_PRIVATE = (
    "not private: privacy.randomness=reproducible derives the noise and the client sample from the seed, "
    "which the run's own files publish; no ε is reported"
)


def _final_epsilon(
    privacy: PrivacySection, accountant: Literal["rdp", "pld"], plan: SecurityPlan
) -> tuple[float | None, str]:
    """ε after the last round from ``accountant`` at the plan's noise (``None`` and why when it does not
    cover the mechanism), with its adjacency in words."""
    from fedskew.algorithms.security import accounting

    local = privacy.mechanism == "local"
    why = accounting.unsupported(accountant, privacy.sampling, privacy.adjacency, local)
    if why is not None:
        return None, why
    assert privacy.delta is not None
    eps = accounting.epsilon(
        plan.num_clients, plan.per_round, plan.effective_noise, plan.rounds, privacy.delta, local,
        accountant=accountant, sampling=privacy.sampling, adjacency=privacy.adjacency,
    )  # fmt: skip
    return float(eps), accounting.describe(accountant, privacy.sampling, privacy.adjacency, local)


@functools.lru_cache(maxsize=16)  # per process: the plan asks on every round
def _noise_and_epsilons(
    privacy: PrivacySection, n: int, m: int, rounds: int
) -> tuple[float, float, tuple[float, ...]]:
    """The update noise multiplier, the effective one the accountant sees (they differ under adaptive
    clipping) and ε after each round from ``privacy.accountant`` (one line naming the key when impossible)."""
    if privacy.mechanism == "none":
        return 0.0, 0.0, ()
    if importlib.util.find_spec("dp_accounting") is None:
        raise ConfigError(
            "privacy: the 'dp-accounting' package is not installed; pip install 'fedskew[privacy]'"
        )
    from fedskew.algorithms.security import accounting

    local, delta = privacy.mechanism == "local", privacy.delta
    kinds = {"accountant": privacy.accountant, "sampling": privacy.sampling, "adjacency": privacy.adjacency}
    assert delta is not None
    try:
        z = privacy.noise_multiplier
        if z is None:
            assert privacy.target_epsilon is not None
            z = accounting.noise_for_epsilon(privacy.target_epsilon, delta, n, m, rounds, local, **kinds)  # type: ignore[arg-type]
        curve = accounting.epsilon_curve(n, m, z, rounds, delta, local, **kinds)  # type: ignore[arg-type]
        effective = z
        if privacy.adaptive is not None:  # the update noise that leaves the effective z (Andrew et al. §3.1)
            z = accounting.update_noise_for(z, count_noise(privacy.adaptive, m))
    except ValueError as err:
        where = "privacy.adaptive.count_noise" if "count_noise" in str(err) else "privacy"
        raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from None
    return float(z), float(effective), tuple(curve)


def count_noise(adaptive: AdaptiveClip, per_round: int) -> float:
    """σ_b, the std of the noise on the count of clipped clients (default m / 20, Andrew et al. §4)."""
    return adaptive.count_noise if adaptive.count_noise is not None else per_round / 20


def security_plan(
    attack: AttackSection,
    defence: DefenceSection,
    privacy: PrivacySection,
    *,
    num_clients: int,
    per_round: int,
    rounds: int,
    seed: int,
) -> SecurityPlan:
    """Resolve and check the three sections for a federation (raises :class:`ConfigError`)."""
    if attack.name != "none" and attack.clients is None and attack.fraction <= 0:
        raise ConfigError(f"attack.name={attack.name}: give attack.fraction in (0, 1] or attack.clients")
    ATTACKS.get(attack.name).check(attack)
    DEFENCES.get(defence.name).check(defence)
    _check_privacy(privacy, defence)
    if privacy.adaptive is not None and privacy.noise_multiplier is not None:  # z known: check σ_b now
        _noise_and_epsilons(privacy, num_clients, per_round, rounds)
    return SecurityPlan(
        attack, defence, privacy, malicious_clients(attack, num_clients, seed), per_round, num_clients,
        _byzantine(defence, attack, per_round), rounds,
    )  # fmt: skip


def check_algorithm(
    name: str,
    mean_aggregation: bool,
    heterogeneous: bool,
    eligible: list[str],
    sections: tuple[AttackSection, DefenceSection, PrivacySection],
) -> None:
    """Refuse (one line) a method whose uploads robust rules, DP clipping or update attacks cannot handle:
    its aggregation is not a mean of uploads (prototypes, class statistics), or its clients' models differ."""
    attack, defence, privacy = sections
    what = [
        label
        for label, on in (
            (f"attack.name={attack.name}", poisons_updates(attack)),
            (f"defence.name={defence.name}", replaces_mean(defence)),
            (f"privacy.mechanism={privacy.mechanism}", privacy.mechanism != "none"),
        )
        if on
    ]
    if what and not mean_aggregation:
        raise ConfigError(
            f"{what[0]}: algorithm '{name}' does not aggregate a mean of model uploads, so its uploads "
            f"cannot be bounded, replaced or robustly combined; allowed algorithms: {', '.join(eligible)}"
        )
    if what and heterogeneous:
        raise ConfigError(
            f"{what[0]}: clients with different architectures (model.per_client) upload "
            "arrays of different shapes; allowed only with one architecture"
        )
