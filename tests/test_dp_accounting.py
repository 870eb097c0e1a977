"""DP-FedAvg privacy accounting (fedskew.algorithms.security.accounting) against dp_accounting's own API."""

import itertools
import math

import dp_accounting
import pytest
from dp_accounting.rdp import RdpAccountant

from fedskew.algorithms.security import accounting as acc

N, M, Z, T, DELTA = 100, 10, 1.1, 50, 1e-5
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def _direct(event, count):
    return RdpAccountant(neighboring_relation=REPLACE_ONE).compose(event, count).get_epsilon(DELTA)


def test_round_event_shapes():
    gaussian = dp_accounting.GaussianDpEvent(Z)
    assert acc.round_event(N, M, Z) == dp_accounting.SampledWithoutReplacementDpEvent(N, M, gaussian)
    assert acc.round_event(N, N, Z) == gaussian
    assert acc.round_event(N, M, Z, local=True) == gaussian


def test_epsilon_matches_direct_sampled_without_replacement():
    event = dp_accounting.SampledWithoutReplacementDpEvent(N, M, dp_accounting.GaussianDpEvent(Z))
    expected = _direct(event, T)
    got = acc.epsilon(N, M, Z, T, DELTA)
    assert got == pytest.approx(expected, rel=1e-9)
    assert 8.4 < got < 8.7  # 8.533 with dp_accounting 0.6's default orders


def test_epsilon_local_matches_self_composed_gaussian():
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(Z), T)
    expected = RdpAccountant(neighboring_relation=REPLACE_ONE).compose(event).get_epsilon(DELTA)
    assert acc.epsilon(N, M, Z, T, DELTA, local=True) == pytest.approx(expected, rel=1e-12)
    assert acc.epsilon(N, M, Z, T, DELTA, local=True) > acc.epsilon(N, M, Z, T, DELTA)


@pytest.mark.parametrize("local", [False, True])
def test_epsilon_curve_last_value_and_monotone(local):
    curve = acc.epsilon_curve(N, M, Z, T, DELTA, local=local)
    assert len(curve) == T
    assert curve[-1] == pytest.approx(acc.epsilon(N, M, Z, T, DELTA, local=local), rel=1e-12)
    assert all(b >= a for a, b in itertools.pairwise(curve))
    assert curve[0] < curve[-1]
    # the first rounds against an accountant composing one round at a time
    stepwise = RdpAccountant(neighboring_relation=REPLACE_ONE)
    for t in range(3):
        stepwise.compose(acc.round_event(N, M, Z, local=local))
        assert curve[t] == pytest.approx(stepwise.get_epsilon(DELTA), rel=1e-9)
    assert acc.epsilon_curve(N, M, Z, 0, DELTA) == []


def test_more_noise_less_epsilon_more_rounds_more_epsilon():
    assert acc.epsilon(N, M, 2 * Z, T, DELTA) < acc.epsilon(N, M, Z, T, DELTA)
    assert acc.epsilon(N, M, Z, 2 * T, DELTA) > acc.epsilon(N, M, Z, T, DELTA)
    assert acc.epsilon(N, M, Z, T, DELTA, local=True) < acc.epsilon(N, M, Z, 2 * T, DELTA, local=True)


def test_epsilon_edge_cases():
    assert acc.epsilon(N, M, Z, 0, DELTA) == 0.0
    assert acc.epsilon(N, M, 0.0, T, DELTA) == math.inf
    assert acc.epsilon(N, M, math.inf, T, DELTA) == 0.0
    assert acc.epsilon_curve(N, M, 0.0, 3, DELTA) == [math.inf] * 3
    assert acc.noise_for_epsilon(1.0, DELTA, N, M, 0) == 0.0


@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_noise_for_epsilon_is_the_smallest_noise_within_target(target):
    z = acc.noise_for_epsilon(target, DELTA, N, M, T)
    assert acc.epsilon(N, M, z, T, DELTA) <= target
    assert acc.epsilon(N, M, 0.99 * z, T, DELTA) > target


def test_noise_for_epsilon_local():
    z = acc.noise_for_epsilon(3.0, DELTA, N, M, 20, local=True)
    assert (
        acc.epsilon(N, M, z, 20, DELTA, local=True)
        <= 3.0
        < acc.epsilon(N, M, 0.99 * z, 20, DELTA, local=True)
    )


def test_effective_noise_hand_value_and_round_trip():
    assert acc.effective_noise(1.0, 1.0) == pytest.approx(1 / math.sqrt(2))
    for z, count_noise in [(0.5, 3.0), (1.1, 10.0), (4.0, 4.0), (2.0, 0.7)]:
        eff = acc.effective_noise(z, count_noise)
        assert eff < min(z, count_noise)
        assert acc.update_noise_for(eff, count_noise) == pytest.approx(z, rel=1e-12)
    assert acc.effective_noise(1.0, 0.0) == 0.0
    assert acc.effective_noise(math.inf, 2.0) == 2.0
    assert acc.effective_noise(3.0, math.inf) == 3.0
    assert acc.effective_noise(math.inf, math.inf) == math.inf
    assert acc.update_noise_for(1.5, math.inf) == 1.5
    assert acc.update_noise_for(0.0, 1.0) == 0.0


def test_effective_noise_agrees_with_composed_gaussians_in_dp_accounting():
    # the update sum and the clipped count, one sampled mechanism: dp_accounting folds the composed
    # Gaussians into one with (z^-2 + σ_b^-2)^-1/2 too
    inner = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(Z), dp_accounting.GaussianDpEvent(5.0)]
    )
    expected = _direct(dp_accounting.SampledWithoutReplacementDpEvent(N, M, inner), 5)
    assert acc.epsilon(N, M, acc.effective_noise(Z, 5.0), 5, DELTA) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: acc.epsilon(N, M, Z, T, 0.0), r"delta must be in \(0, 1\)"),
        (lambda: acc.epsilon(N, M, Z, T, 1.0), r"delta must be in \(0, 1\)"),
        (lambda: acc.epsilon(N, 0, Z, T, DELTA), "1 <= per_round <= num_clients"),
        (lambda: acc.epsilon(N, N + 1, Z, T, DELTA), "1 <= per_round <= num_clients"),
        (lambda: acc.epsilon(N, M, -0.1, T, DELTA), "noise_multiplier must be >= 0"),
        (lambda: acc.epsilon(N, M, Z, -1, DELTA), "rounds must be >= 0"),
        (lambda: acc.epsilon_curve(N, M, Z, T, 2.0), r"delta must be in \(0, 1\)"),
        (lambda: acc.epsilon_curve(N, M, Z, -1, DELTA), "rounds must be >= 0"),
        (lambda: acc.round_event(N, M, math.nan), "noise_multiplier must be >= 0"),
        (lambda: acc.round_event(5, 6, Z), "1 <= per_round <= num_clients"),
        (lambda: acc.noise_for_epsilon(0.0, DELTA, N, M, T), "target_epsilon must be > 0"),
        (lambda: acc.noise_for_epsilon(-1.0, DELTA, N, M, T), "target_epsilon must be > 0"),
        (lambda: acc.noise_for_epsilon(1.0, 0.0, N, M, T), r"delta must be in \(0, 1\)"),
        (lambda: acc.noise_for_epsilon(1.0, DELTA, N, M, -1), "rounds must be >= 0"),
        (lambda: acc.effective_noise(-1.0, 1.0), "must be >= 0"),
        (lambda: acc.effective_noise(1.0, -1.0), "must be >= 0"),
        (lambda: acc.update_noise_for(-1.0, 1.0), "effective must be >= 0"),
        (lambda: acc.update_noise_for(2.0, 2.0), "count_noise=2.0, effective=2.0"),
        (lambda: acc.update_noise_for(2.0, 1.0), "count_noise must be > effective"),
        (lambda: acc.update_noise_for(math.inf, math.inf), "count_noise must be > effective"),
    ],
)
def test_value_errors_are_one_line(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


# --- accountants, samplings, adjacencies ---------------------------------------------------------------

POISSON = {"sampling": "poisson", "adjacency": "add_remove"}


def _prv(q, z, rounds, delta):
    """(lower, estimate, upper) ε of prv-accountant (Gopi, Lee & Wutschitz 2021), an independent numerical
    composition: the Poisson-subsampled Gaussian (add/remove), or the Gaussian when q = 1."""
    prv_accountant = pytest.importorskip("prv_accountant")
    mechanism = (
        prv_accountant.GaussianMechanism(noise_multiplier=z)
        if q == 1
        else prv_accountant.PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=z)
    )
    accountant = prv_accountant.PRVAccountant(
        mechanism, eps_error=0.01, delta_error=delta * 1e-3, max_self_compositions=rounds
    )
    return accountant.compute_epsilon(delta, rounds)


@pytest.mark.parametrize(
    ("n", "m", "z", "rounds", "delta"),
    [
        (1000, 100, 0.95, 30, 1e-5),
        (1000, 100, 1.9, 30, 1e-5),
        (1000, 100, 4.66, 30, 1e-5),
        (1000, 10, 1.1, 1000, 1e-5),
        (1000, 50, 2.0, 300, 1e-6),
        (500, 10, 0.8, 500, 1e-3),
    ],
)
def test_pld_poisson_matches_prv_accountant_and_rdp_is_an_upper_bound(n, m, z, rounds, delta):
    lower, estimate, upper = _prv(m / n, z, rounds, delta)
    pld = acc.epsilon(n, m, z, rounds, delta, accountant="pld", **POISSON)
    assert pld == pytest.approx(estimate, rel=0.01)
    assert lower <= pld <= upper
    rdp = acc.epsilon(n, m, z, rounds, delta, accountant="rdp", **POISSON)
    assert pld <= rdp <= 1.3 * pld  # RDP is looser by 8-21% at these settings


@pytest.mark.parametrize(("z", "rounds"), [(3.0, 50), (1.5, 200)])
def test_pld_local_matches_prv_gaussian_and_dp_accounting(z, rounds):
    lower, estimate, upper = _prv(1, z, rounds, DELTA)
    pld = acc.epsilon(N, M, z, rounds, DELTA, local=True, accountant="pld")
    assert pld == pytest.approx(estimate, rel=0.01)
    assert lower <= pld <= upper
    # dp_accounting's discretized PLD of the same Gaussian (one-shift: ADD_OR_REMOVE_ONE, see the module)
    direct = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-3
    )
    direct.compose(dp_accounting.GaussianDpEvent(z), rounds)
    assert pld <= direct.get_epsilon(DELTA) <= pld * (1 + 1e-3)  # pessimistic, from above
    assert pld <= acc.epsilon(N, M, z, rounds, DELTA, local=True)  # RDP


def test_poisson_events_and_rdp_matches_direct():
    gaussian = dp_accounting.GaussianDpEvent(Z)
    assert acc.round_event(N, M, Z, **POISSON) == dp_accounting.PoissonSampledDpEvent(M / N, gaussian)
    assert acc.round_event(N, N, Z, **POISSON) == gaussian
    assert acc.round_event(N, M, Z, local=True, accountant="pld") == gaussian
    direct = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct.compose(dp_accounting.PoissonSampledDpEvent(M / N, gaussian), T)
    assert acc.epsilon(N, M, Z, T, DELTA, **POISSON) == pytest.approx(direct.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("local", [False, True])
def test_pld_curve_is_exact_every_round(local):
    kinds = {"local": True} if local else POISSON
    curve = acc.epsilon_curve(N, M, Z, 40, DELTA, accountant="pld", **kinds)
    assert len(curve) == 40
    assert all(b >= a for a, b in itertools.pairwise(curve))
    for t in (1, 7, 40):
        expected = acc.epsilon(N, M, Z, t, DELTA, accountant="pld", **kinds)
        assert curve[t - 1] == pytest.approx(expected, rel=1e-6)
    assert acc.epsilon_curve(N, M, 0.0, 2, DELTA, accountant="pld", **POISSON) == [math.inf] * 2
    assert acc.epsilon(N, M, math.inf, 5, DELTA, accountant="pld", **POISSON) == 0.0


def test_noise_for_epsilon_pld_is_the_smallest_noise_within_target():
    n, m, rounds, target = 1000, 100, 30, 2.0
    z = acc.noise_for_epsilon(target, DELTA, n, m, rounds, accountant="pld", **POISSON)
    assert acc.epsilon(n, m, z, rounds, DELTA, accountant="pld", **POISSON) <= target
    assert acc.epsilon(n, m, 0.99 * z, rounds, DELTA, accountant="pld", **POISSON) > target
    # RDP is looser, so it needs more noise for the same target
    assert acc.noise_for_epsilon(target, DELTA, n, m, rounds, accountant="rdp", **POISSON) > z


@pytest.mark.parametrize(
    ("accountant", "sampling", "adjacency", "local", "why"),
    [
        ("pld", "fixed", "replace_one", False, "no SampledWithoutReplacementDpEvent"),
        ("rdp", "poisson", "replace_one", False, "use add_remove with poisson sampling"),
        ("pld", "poisson", "replace_one", False, "use add_remove with poisson sampling"),
        ("rdp", "fixed", "add_remove", False, "fixed-size sample cannot hide"),
        ("pld", "fixed", "add_remove", False, "fixed-size sample cannot hide"),
        ("rdp", "poisson", "add_remove", True, "local randomizer"),
        ("pld", "fixed", "add_remove", True, "local randomizer"),
        ("moments", "fixed", "replace_one", False, "unknown accountant"),
    ],
)
def test_unsupported_combinations_raise_one_line(accountant, sampling, adjacency, local, why):
    message = acc.unsupported(accountant, sampling, adjacency, local)
    assert message is not None and why in message and "\n" not in message
    assert f"accountant={accountant!r}, sampling={sampling!r}, adjacency={adjacency!r}" in message
    assert "supported: central rdp/fixed/replace_one" in message
    kinds = {"accountant": accountant, "sampling": sampling, "adjacency": adjacency}
    for call in (
        lambda: acc.epsilon(N, M, Z, T, DELTA, local, **kinds),
        lambda: acc.epsilon_curve(N, M, Z, T, DELTA, local, **kinds),
        lambda: acc.noise_for_epsilon(1.0, DELTA, N, M, T, local, **kinds),
        lambda: acc.round_event(N, M, Z, local, **kinds),
        lambda: acc.describe(accountant, sampling, adjacency, local),
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


def test_supported_combinations_and_describe():
    supported = [
        ("rdp", "fixed", "replace_one", False),
        ("rdp", "poisson", "add_remove", False),
        ("pld", "poisson", "add_remove", False),
        ("rdp", "fixed", "replace_one", True),
        ("pld", "poisson", "replace_one", True),
    ]
    for combination in supported:
        assert acc.unsupported(*combination) is None
        line = acc.describe(*combination)
        assert "\n" not in line and ("sensitivity 2C" in line) == (combination[2] == "replace_one")
    assert "Wang, Balle & Kasiviswanathan 2019" in acc.describe("rdp", "fixed", "replace_one", False)
    assert "Doroshenko" in acc.describe("pld", "poisson", "add_remove", False)


def test_pld_refuses_tiny_noise():
    with pytest.raises(ValueError, match="needs noise_multiplier >= 0.001"):
        acc.epsilon(N, M, 1e-4, T, DELTA, accountant="pld", **POISSON)
