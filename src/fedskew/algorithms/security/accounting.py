"""Privacy accounting for client-level DP-FedAvg, through Google's ``dp_accounting`` (RDP accountant).

Mechanism (McMahan et al., ICLR 2018, "Learning Differentially Private Recurrent Language Models"): each
round the server samples ``per_round`` of ``num_clients`` clients uniformly WITHOUT replacement (a fixed
number per round, as the engine samples), clips every sampled update to L2 norm C, sums the clipped updates
and adds N(0, (z·S)² I), where S is the L2 sensitivity of the sum. Adjacency is client-level replace-one
(one client's data replaced by anything), so S = 2C and ``noise_multiplier`` z is the noise std over 2C: the
ratio ``dp_accounting.GaussianDpEvent`` expects. One round is a Gaussian mechanism on a sample drawn without
replacement, accounted by Wang, Balle & Kasiviswanathan (AISTATS 2019, Thm. 27), which ``RdpAccountant``
supports only under ``NeighboringRelation.REPLACE_ONE``; that is the relation used throughout.

Local variant: every client adds N(0, (z·2C)²) to its own clipped update before upload. It is accounted for
one client in the worst case (it takes part in every round, no amplification by sampling): ``rounds``
self-composed Gaussian mechanisms with noise multiplier z.

RDP orders: ``DEFAULT_RDP_ORDERS`` of ``dp_accounting`` (1.1..10.9 by 0.1, 11..63, 128, 256, 512, 1024).
"""

from __future__ import annotations

import math

import dp_accounting

ORDERS: tuple[float, ...] = tuple(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
_REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
_MAX_NOISE = 1e6  # noise_for_epsilon gives up above this (the target is below what RDP can certify)
_MIN_NOISE = 1e-6


def _validate(num_clients: int, per_round: int, noise_multiplier: float, delta: float | None = None) -> None:
    if not 1 <= per_round <= num_clients:
        raise ValueError(
            f"need 1 <= per_round <= num_clients, got per_round={per_round}, num_clients={num_clients}"
        )
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0 (inf allowed), got {noise_multiplier}")
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def round_event(
    num_clients: int, per_round: int, noise_multiplier: float, local: bool = False
) -> dp_accounting.DpEvent:
    """The ``DpEvent`` of one DP-FedAvg round (McMahan et al. 2018), for replace-one client adjacency.

    Central: ``SampledWithoutReplacementDpEvent(num_clients, per_round, GaussianDpEvent(z))`` (sampling
    without replacement of a fixed ``per_round``); a plain ``GaussianDpEvent(z)`` when every client takes
    part. Local: ``GaussianDpEvent(z)``, one client's own noisy upload, no amplification by sampling.
    """
    _validate(num_clients, per_round, noise_multiplier)
    gaussian = dp_accounting.GaussianDpEvent(float(noise_multiplier))
    if local or per_round == num_clients:
        return gaussian
    return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, per_round, gaussian)


def _round_rdp(num_clients: int, per_round: int, noise_multiplier: float, local: bool) -> list[float]:
    """RDP of one round at every order of ``ORDERS`` (one ``RdpAccountant``, REPLACE_ONE)."""
    accountant = dp_accounting.rdp.RdpAccountant(list(ORDERS), neighboring_relation=_REPLACE_ONE)
    accountant.compose(round_event(num_clients, per_round, noise_multiplier, local))
    return [float(r) for r in accountant.rdp]


def epsilon_curve(
    num_clients: int,
    per_round: int,
    noise_multiplier: float,
    rounds: int,
    delta: float,
    local: bool = False,
) -> list[float]:
    """ε after each round 1..``rounds`` at ``delta`` (replace-one adjacency, see the module docstring).

    One ``RdpAccountant`` composes one round; RDP adds up over rounds, so round t's RDP is t times it
    (exactly what ``compose(event, t)`` computes) and each ε is one ``compute_epsilon`` call.
    """
    _validate(num_clients, per_round, noise_multiplier, delta)
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if noise_multiplier == 0:
        return [math.inf] * rounds
    if math.isinf(noise_multiplier):
        return [0.0] * rounds
    rdp = _round_rdp(num_clients, per_round, noise_multiplier, local)
    compute = dp_accounting.rdp.compute_epsilon
    return [float(compute(ORDERS, [t * r for r in rdp], delta)[0]) for t in range(1, rounds + 1)]


def epsilon(
    num_clients: int,
    per_round: int,
    noise_multiplier: float,
    rounds: int,
    delta: float,
    local: bool = False,
) -> float:
    """ε of ``rounds`` DP-FedAvg rounds at ``delta``: ``RdpAccountant(ORDERS, REPLACE_ONE)`` composing
    ``round_event(...)`` ``rounds`` times. 0.0 for no rounds (or infinite noise), inf for zero noise."""
    _validate(num_clients, per_round, noise_multiplier, delta)
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if rounds == 0 or math.isinf(noise_multiplier):
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    accountant = dp_accounting.rdp.RdpAccountant(list(ORDERS), neighboring_relation=_REPLACE_ONE)
    accountant.compose(round_event(num_clients, per_round, noise_multiplier, local), rounds)
    return float(accountant.get_epsilon(delta))


def noise_for_epsilon(
    target_epsilon: float,
    delta: float,
    num_clients: int,
    per_round: int,
    rounds: int,
    local: bool = False,
) -> float:
    """The smallest noise multiplier (to 1e-3 relative precision) whose ``epsilon(...)`` is <= the target.

    Grows a bracket [lo, hi] from z = 1 by doubling (or halving) until ε(lo) > target >= ε(hi), then
    bisects; returns hi, so ε at the result is always within the target. 0.0 when ``rounds`` is 0.
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
    _validate(num_clients, per_round, 0.0, delta)
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if rounds == 0:
        return 0.0

    def within(z: float) -> bool:
        return epsilon(num_clients, per_round, z, rounds, delta, local) <= target_epsilon

    lo, hi = 0.0, 1.0
    while not within(hi):
        lo, hi = hi, 2 * hi
        if hi > _MAX_NOISE:
            raise ValueError(
                f"target_epsilon={target_epsilon} is unattainable at delta={delta} (noise > 1e6)"
            )
    if lo == 0.0:
        lo = hi / 2
        while within(lo):
            if lo < _MIN_NOISE:
                return lo
            lo, hi = lo / 2, lo
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if within(mid) else (mid, hi)
    return hi


def effective_noise(noise_multiplier: float, count_noise: float) -> float:
    """Effective noise multiplier z_eff of DP-FedAvg with adaptive clipping (Andrew et al., NeurIPS 2021,
    "Differentially Private Learning with Adaptive Clipping"): z_eff^-2 = z^-2 + σ_b^-2.

    Each round releases the clipped-update sum plus N(0, (z·2C)² I) and the count of clients whose update
    norm was <= C plus N(0, σ_b²); under replace-one adjacency their sensitivities are 2C and 1. Dividing
    each part by its sensitivity times its noise multiplier gives one vector with unit-variance Gaussian noise
    whose L2 sensitivity is sqrt(z^-2 + σ_b^-2): a single Gaussian mechanism whose RDP at order α is
    α (z^-2 + σ_b^-2) / 2 = α / (2 z_eff²), for the same sampled clients, so the round (sampling included)
    is accounted as ``round_event`` with z_eff. (Andrew et al. write (2σ_b)^-2: their centred bits under
    add/remove adjacency have sensitivity 1/2.) count_noise == 0 gives 0.0 (nothing private); an infinite
    noise drops out of the sum.
    """
    if not (noise_multiplier >= 0 and count_noise >= 0):
        raise ValueError(
            f"noise_multiplier and count_noise must be >= 0, got {noise_multiplier}, {count_noise}"
        )
    if noise_multiplier == 0 or count_noise == 0:
        return 0.0
    inverse_square = noise_multiplier**-2 + count_noise**-2  # inf**-2 == 0.0
    return math.inf if inverse_square == 0 else inverse_square**-0.5


def update_noise_for(effective: float, count_noise: float) -> float:
    """The update noise multiplier z with ``effective_noise(z, count_noise) == effective`` (Andrew et al.
    2021, §3.1): z = (z_eff^-2 - σ_b^-2)^-1/2; needs count_noise > effective (the count alone already
    costs privacy)."""
    if not effective >= 0:
        raise ValueError(f"effective must be >= 0, got {effective}")
    if not count_noise > effective:
        raise ValueError(
            f"count_noise must be > effective, got count_noise={count_noise}, effective={effective}"
        )
    if effective == 0:
        return 0.0
    return (effective**-2 - count_noise**-2) ** -0.5
