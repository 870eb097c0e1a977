"""Hand-checked cases for the robust aggregation rules in fedskew.algorithms.security.robust."""

from __future__ import annotations

import math

import pytest
import torch

from fedskew.algorithms.security.robust import (
    _bulyan_select,
    bulyan,
    clip_rows,
    coordinate_median,
    geometric_median,
    krum_scores,
    multi_krum,
    norm_bound,
    trimmed_mean,
)


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def assert_exact(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


# 4 inliers and one outlier at (100, 100)
FIVE = [[1, 2], [2, 3], [3, 1], [4, 5], [100, 100]]
# Krum points: pairwise squared distances a-b 1, a-c 4, a-d 5, b-c 5, b-d 2, c-d 5;
# o to a, b, c, d: 20000, 19801, 19604, 19405
KRUM = [[0, 0], [1, 0], [0, 2], [2, 1], [100, 100]]


def test_coordinate_median_odd_n() -> None:
    # x: 1 2 3 4 100 -> 3; y: 1 2 3 5 100 -> 3
    assert_exact(coordinate_median(t(FIVE)), [3.0, 3.0])


def test_coordinate_median_even_n_averages_the_two_middle_values() -> None:
    # x: 1 2 3 100 -> (2+3)/2; y: 1 2 8 100 -> (2+8)/2 (torch.median would give 2 and 2)
    assert_exact(coordinate_median(t([[1, 2], [2, 8], [3, 1], [100, 100]])), [2.5, 5.0])


def test_coordinate_median_single_update() -> None:
    assert_exact(coordinate_median(t([[1.5, -2.0]])), [1.5, -2.0])


def test_trimmed_mean_removes_exactly_the_outliers() -> None:
    updates = t([[1, 2], [2, 3], [3, 1], [100, 100], [-100, -100]])
    # k = floor(0.2 * 5) = 1: drops +-100 in both coordinates -> mean of the three inliers
    assert_exact(trimmed_mean(updates, 0.2), [2.0, 2.0])


def test_trimmed_mean_trims_each_coordinate_separately() -> None:
    # x: drop 1 and 100 -> (2+3+4)/3 = 3; y: drop 1 and 100 -> (2+3+5)/3 = 10/3
    assert_exact(trimmed_mean(t(FIVE), 0.2), [3.0, 10.0 / 3.0])
    # k = floor(0.4 * 5) = 2 leaves only the median
    assert_exact(trimmed_mean(t(FIVE), 0.4), [3.0, 3.0])


def test_trimmed_mean_beta_zero_is_the_mean() -> None:
    assert_exact(trimmed_mean(t(FIVE), 0.0), [22.0, 22.2])


@pytest.mark.parametrize("beta", [0.5, 0.7, -0.1])
def test_trimmed_mean_rejects_beta_outside_range(beta: float) -> None:
    with pytest.raises(ValueError, match=r"0 <= beta < 0\.5"):
        trimmed_mean(t(FIVE), beta)


def test_krum_scores_match_hand_computation() -> None:
    # n - f - 2 = 2 neighbours: a 1+4, b 1+2, c 4+5, d 2+5, o 19405+19604
    assert_exact(krum_scores(t(KRUM), 1), [5.0, 3.0, 9.0, 7.0, 39009.0])


def test_krum_never_selects_the_outlier() -> None:
    assert multi_krum(t(KRUM), 1, 1) == [1]
    # same points with the outlier moved to index 0
    permuted = t([KRUM[4], *KRUM[:4]])
    assert multi_krum(permuted, 1, 1) == [2]


def test_multi_krum_selects_the_inliers_in_score_order() -> None:
    assert multi_krum(t(KRUM), 1, 3) == [1, 0, 3]
    assert multi_krum(t(KRUM), 1, 4) == [1, 0, 3, 2]
    assert multi_krum(t(KRUM), 1, 5) == [1, 0, 3, 2, 4]


def test_multi_krum_breaks_ties_by_lower_index() -> None:
    # square corners all score 1 + 1 = 2
    square = t([[100, 100], [0, 0], [1, 0], [0, 1], [1, 1]])
    assert_exact(krum_scores(square, 1)[1:], [2.0, 2.0, 2.0, 2.0])
    assert multi_krum(square, 1, 2) == [1, 2]


def test_krum_rejects_too_few_updates() -> None:
    with pytest.raises(ValueError, match=r"n >= 2f \+ 3.*n=5, f=2"):
        krum_scores(t(KRUM), 2)
    with pytest.raises(ValueError, match="n >= 2f"):
        multi_krum(t(KRUM[:4]), 1, 1)


@pytest.mark.parametrize("m", [0, 6])
def test_multi_krum_rejects_m_outside_range(m: int) -> None:
    with pytest.raises(ValueError, match="1 <= m <= n"):
        multi_krum(t(KRUM), 1, m)


def test_bulyan_hand_computed_case() -> None:
    # Row i is (x_i, 10 - x_i) with x = 0 1 3 4 7 9 100 (y of the outlier is -90), so every squared
    # distance is twice the 1-d one. n=7, f=1: theta = 5, beta = 3. Iterated Krum (1-d squared distances):
    # |R|=7, 4 nbrs: 0:75 1:50 3:30 4:35 7:65 9:129 -> pick 3
    # |R|=6, 3 nbrs: 0:66 1:46 4:34 7:49 9:93 -> pick 4
    # |R|=5, 2 nbrs: 0:50 1:37 7:40 9:68 -> pick 1
    # |R|=4, 1 nbr (max(4-3, 1)): 0:49 7:4 9:4 -> pick 7 (lower index)
    # |R|=3, 1 nbr: 0:81 9:81 100:8281 -> pick 0 (lower index)
    # selection x = 0 1 3 4 7: median 3, closest three 3 4 1 -> 8/3;
    # selection y = 10 9 7 6 3: median 7, closest three 7 6 9 -> 22/3
    updates = t([[0, 10], [1, 9], [3, 7], [4, 6], [7, 3], [9, 1], [100, -90]])
    assert _bulyan_select(updates, 1, 5) == [2, 3, 1, 4, 0]
    assert_exact(bulyan(updates, 1), [8.0 / 3.0, 22.0 / 3.0])


def test_bulyan_selection_recomputes_krum_on_the_remaining_set() -> None:
    # x = 0 1 3 4 5 7 100 (1-d), f=1. Full-set Krum scores (4 nbrs): 0:51 1:30 3:18 4:20 5:25 7:65, so
    # scoring once would pick 3, 4, 5. Recomputed: |R|=6, 3 nbrs: 0:42 1:26 4:19 5:21 7:49 -> 4;
    # |R|=5, 2 nbrs: 0:26 1:17 5:20 7:40 -> 1 (not 5).
    updates = t([[0], [1], [3], [4], [5], [7], [100]])
    assert _bulyan_select(updates, 1, 5)[:3] == [2, 3, 1]


def test_bulyan_with_f_zero_is_the_mean() -> None:
    assert_exact(bulyan(t([[0, 3], [1, 6], [5, 0]]), 0), [2.0, 3.0])


@pytest.mark.parametrize("f", [-1, 2])
def test_bulyan_rejects_n_below_4f_plus_3(f: int) -> None:
    updates = t([[0, 0], [1, 1], [2, 2], [3, 3], [4, 4], [5, 5], [6, 6]])
    with pytest.raises(ValueError, match=r"n >= 4f \+ 3"):
        bulyan(updates, f)
    with pytest.raises(ValueError, match=r"n=6, f=1"):
        bulyan(updates[:6], 1)


def _objective(updates: torch.Tensor, v: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(updates - v, dim=1).sum())


def test_geometric_median_of_symmetric_points_is_the_centre() -> None:
    centre = torch.tensor([1.0, 2.0], dtype=torch.float64)
    offsets = t([[1, 0], [-1, 0], [0, 3], [0, -3], [2, 2], [-2, -2]])
    assert_exact(geometric_median(centre + offsets), [1.0, 2.0])


def test_geometric_median_of_collinear_points_is_the_middle_one() -> None:
    updates = t([[0, 0], [1, 0], [10, 0]])  # mean is (11/3, 0)
    torch.testing.assert_close(
        geometric_median(updates), torch.tensor([1.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-9
    )


def test_geometric_median_weights_and_smoothing() -> None:
    updates = t([[0, 0], [1, 0], [10, 0]])
    weights = torch.tensor([1.0, 1.0, 5.0])
    # weight 5/7 on (10, 0) exceeds the other two together: the weighted median is that point. The smoothed
    # fixed point sits eps-close: with beta_3 = (5/7)/eps, v - 10 = -(2/7) / sum(beta) ~ -0.4 eps.
    for eps in (1e-6, 1e-9):
        torch.testing.assert_close(
            geometric_median(updates, weights, eps=eps, tol=0.0, max_iter=1000),
            torch.tensor([10.0 - 0.4 * eps, 0.0], dtype=torch.float64),
            rtol=0,
            atol=1e-12,
        )


def test_geometric_median_resists_a_far_outlier() -> None:
    corners = [[1, 1], [-1, 1], [1, -1], [-1, -1]]
    # On the diagonal v = (s, s): the unit vectors to (1,1) and (-1,-1) cancel, the outlier pulls
    # (1,1)/sqrt(2) and the other two corners pull -2s(1,1)/sqrt(2+2s^2); balance gives s = 1/sqrt(3),
    # for any outlier on the diagonal beyond (1, 1).
    s = 1.0 / math.sqrt(3.0)
    for far in (100.0, 1000.0):
        updates = t([*corners, [far, far]])
        exact = geometric_median(updates, tol=0.0, max_iter=1000)
        torch.testing.assert_close(exact, torch.tensor([s, s], dtype=torch.float64), rtol=0, atol=1e-6)
        default = geometric_median(updates)
        mean = updates.mean(dim=0)
        assert float(default.abs().max()) < 0.6  # inside the inliers' square
        assert float(mean.min()) == far / 5  # the mean is dragged to (far/5, far/5)
        assert _objective(updates, default) < _objective(updates, mean)


def test_geometric_median_max_iter_zero_returns_weighted_mean() -> None:
    updates = t([[0, 0], [1, 0], [10, 0]])
    assert_exact(geometric_median(updates, torch.tensor([1.0, 0.0, 1.0]), max_iter=0), [5.0, 0.0])


@pytest.mark.parametrize(
    "weights", [torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0, 1.0]), torch.zeros(3)]
)
def test_geometric_median_rejects_bad_weights(weights: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="weights"):
        geometric_median(t([[0, 0], [1, 0], [10, 0]]), weights)


def test_geometric_median_rejects_bad_eps() -> None:
    with pytest.raises(ValueError, match="eps > 0"):
        geometric_median(t([[0, 0], [1, 0]]), eps=0.0)


def test_norm_bound_exact_scaling() -> None:
    updates = t([[3, 4], [0, 0], [0.6, 0.8], [-6, 8]])
    # norms 5, 0, 1, 10 against 2.5: factors 1/2, 1, 1, 1/4
    assert_exact(norm_bound(updates, 2.5), [[1.5, 2.0], [0.0, 0.0], [0.6, 0.8], [-1.5, 2.0]])


def test_clip_rows_returns_within_norm_flags() -> None:
    updates = t([[3, 4], [0, 0], [0.6, 0.8], [-6, 8]])
    clipped, within = clip_rows(updates, 5.0)  # norm exactly 5 counts as within
    assert_exact(clipped, [[3.0, 4.0], [0.0, 0.0], [0.6, 0.8], [-3.0, 4.0]])
    assert within.dtype == torch.bool
    assert within.tolist() == [True, True, True, False]


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_norm_defences_reject_non_positive_max_norm(max_norm: float) -> None:
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        norm_bound(t(FIVE), max_norm)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_rows(t(FIVE), max_norm)


def test_rules_reject_non_matrix_updates() -> None:
    with pytest.raises(ValueError, match=r"shape \[n>=1, d\]"):
        coordinate_median(torch.tensor([1.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shape \[n>=1, d\]"):
        trimmed_mean(torch.zeros(0, 3, dtype=torch.float64), 0.1)
