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
