import math

import pytest

from engine.analysis import analytic


@pytest.mark.parametrize("alpha,k,expected", [(0.7, 4, 2.77), (0.8, 4, 3.36), (0.4, 4, 1.65)])
def test_chapter_numbers(alpha, k, expected):
    assert analytic.expected_tokens(alpha, k) == pytest.approx(expected, abs=0.005)


def test_alpha_one_gives_k_plus_one():
    assert analytic.expected_tokens(1.0, 4) == 5.0
    assert analytic.expected_tokens(0.0, 4) == 1.0


def test_per_position_form_matches_constant_alpha():
    assert analytic.expected_tokens_per_position([0.7] * 4) == pytest.approx(analytic.expected_tokens(0.7, 4))
    # falling acceptance with depth: 1 + 0.9 + 0.9*0.5 + 0.9*0.5*0.2
    assert analytic.expected_tokens_per_position([0.9, 0.5, 0.2]) == pytest.approx(1 + 0.9 + 0.45 + 0.09)


def test_speedup_and_optimal_k():
    assert analytic.speedup(0.8, 4, 0.0) == pytest.approx(3.3616, abs=1e-4)
    assert analytic.speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4, abs=1e-4)
    k, best = analytic.optimal_k(0.8, 0.05, 16)
    assert best == pytest.approx(max(analytic.speedup(0.8, j, 0.05) for j in range(1, 17)))
    assert 1 <= k <= 16
    # a drafter as costly as the target never pays off
    assert analytic.optimal_k(0.5, 1.0) == (0, 1.0)
    # cheaper drafts and better acceptance push the optimum up
    assert analytic.optimal_k(0.9, 0.02)[0] > analytic.optimal_k(0.6, 0.02)[0]


def test_predicted_tpot_and_inverse():
    e = analytic.expected_tokens(0.7, 4)
    assert analytic.predicted_tpot(10.0, 0.1, 4, e) == pytest.approx(10.0 * 1.4 / e)
    assert analytic.alpha_from_tokens_per_forward(e, 4) == pytest.approx(0.7, abs=1e-6)


def test_batch_regime_gain_shrinks_and_turns_negative():
    gains = [analytic.batch_speedup(0.7, 4, 0.05, b, critical_batch=64) for b in (1, 8, 32, 128, 512)]
    assert gains[0] > 2.0
    assert all(a >= b for a, b in zip(gains, gains[1:]))
    assert gains[-1] < 1.0


def test_chi2_sf_known_values():
    assert analytic.chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert analytic.chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-3)
    assert math.isclose(analytic.chi2_sf(0.0, 3), 1.0)
