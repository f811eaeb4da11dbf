"""Capacity routing alone: speed estimates, floored shares, unbiased counts and uniform placement."""

import itertools
import math
from collections import Counter
from fractions import Fraction

import pytest

from hf_noloco.engine.capacity import SpeedEstimate, assign, draw_counts, floored_shares, round_quotas
from hf_noloco.engine.routing import seeded_uniform

SPEED_CASES = [
    ([1.0, 2.0, 3.0], 10, 0.0),
    ([1.0, 1.7, 0.3, 5.0], 13, 0.0),
    ([0.05, 1.0, 1.0], 16, 0.2),
    ([0.01, 0.02, 3.0, 4.0, 9.5], 37, 0.1),
    ([2.5], 7, 0.0),
]


def _exact_expectation(quotas: list[Fraction]) -> list[Fraction]:
    """The counts' expectation over ``u`` uniform on [0, 1): the counts are constant between the fractional
    parts' cumulative sums mod 1, so the integral is a finite sum over those pieces."""
    cuts, start = {Fraction(0), Fraction(1)}, Fraction(0)
    for q in quotas:
        start += q - math.floor(q)
        cuts.add(start - math.floor(start))
    cuts = sorted(cuts)
    expected = [Fraction(0)] * len(quotas)
    for left, right in zip(cuts, cuts[1:]):
        counts = round_quotas(quotas, (left + right) / 2)
        expected = [e + (right - left) * c for e, c in zip(expected, counts)]
    return expected


@pytest.mark.parametrize("speeds,total,floor", SPEED_CASES)
def test_counts_sum_exactly_and_round_each_quota(speeds, total, floor):
    quotas = [total * s for s in floored_shares(speeds, floor)]
    for key in range(300):
        counts = draw_counts(speeds, total, 3, key, floor=floor)
        assert sum(counts) == total
        assert all(math.floor(q) <= c <= math.ceil(q) for q, c in zip(quotas, counts)), (quotas, counts)


@pytest.mark.parametrize("speeds,total,floor", SPEED_CASES)
def test_expected_counts_are_exactly_the_quotas(speeds, total, floor):
    quotas = [total * s for s in floored_shares(speeds, floor)]
    assert _exact_expectation(quotas) == quotas


def test_empirical_mean_counts_match_the_quotas_within_the_standard_error():
    speeds, total, draws = [1.0, 1.7, 0.3, 5.0], 13, 4000
    quotas = [float(total * s) for s in floored_shares(speeds)]
    sums = [0] * len(speeds)
    for key in range(draws):
        sums = [a + b for a, b in zip(sums, draw_counts(speeds, total, 11, key))]
    for q, s in zip(quotas, sums):
        frac = q - math.floor(q)
        std_error = math.sqrt(frac * (1 - frac) / draws)  # a count is floor(q) + Bernoulli(frac)
        assert abs(s / draws - q) < 5 * std_error + 1e-12, (q, s / draws)


def test_shares_are_proportional_above_the_floor_and_sum_to_one():
    shares = floored_shares([1.0, 2.0, 5.0])
    assert shares == [Fraction(1, 8), Fraction(2, 8), Fraction(5, 8)]
    # 0.05 of 2.05 is below 0.2: floored; the other two split 0.8 equally.
    assert floored_shares([0.05, 1.0, 1.0], 0.2) == [Fraction(1, 5), Fraction(2, 5), Fraction(2, 5)]
    # Flooring one replica can push another under the floor: both end at the floor.
    shares = floored_shares([0.01, 0.3, 10.0], Fraction(1, 4))
    assert shares == [Fraction(1, 4), Fraction(1, 4), Fraction(1, 2)]
    for speeds, _, floor in SPEED_CASES:
        shares = floored_shares(speeds, floor)
        assert sum(shares) == 1
        assert min(shares) >= Fraction(str(floor))


@pytest.mark.parametrize("speeds,total,floor", SPEED_CASES)
def test_floor_is_respected_by_every_draw(speeds, total, floor):
    for key in range(200):
        counts = draw_counts(speeds, total, 5, key, floor=floor)
        assert min(counts) >= math.floor(total * Fraction(str(floor)))
    if floor:
        assert min(draw_counts(speeds, total, 0, floor=floor)) >= 1  # a slow replica still trains


def test_equal_speeds_give_exactly_equal_counts():
    for n, per in [(1, 8), (2, 4), (3, 5), (4, 16), (8, 1)]:
        for key in range(50):
            assert draw_counts([2.3] * n, n * per, 9, key) == [per] * n
            assert draw_counts([2.3] * n, n * per, 9, key, floor=1 / (2 * n)) == [per] * n


def test_indivisible_equal_speeds_spread_the_remainder_without_bias():
    tally = Counter()
    for key in range(3000):
        counts = draw_counts([1.0, 1.0, 1.0], 10, 1, key)
        assert sorted(counts) == [3, 3, 4]
        tally[counts.index(4)] += 1
    assert all(abs(tally[r] / 3000 - 1 / 3) < 5 * math.sqrt(2 / 9 / 3000) for r in range(3)), tally


def test_counts_are_deterministic_in_the_keys():
    assert draw_counts([1.0, 2.0, 3.0], 10, 4, 2) == draw_counts([1.0, 2.0, 3.0], 10, 4, 2)
    assert len({tuple(draw_counts([1.0, 2.0, 3.0], 10, 4, k)) for k in range(100)}) > 1
    assert 0 <= seeded_uniform(1, 2) < 1 and seeded_uniform(1, 2) == seeded_uniform(1, 2)


def test_every_sample_is_placed_once_and_counts_are_met():
    for counts in ([2, 1, 1], [0, 5, 3], [7], [1, 0, 0, 4, 2], [0, 0]):
        for key in range(100):
            placed = assign(counts, 8, key)
            assert len(placed) == sum(counts)
            assert Counter(placed) == Counter({r: c for r, c in enumerate(counts) if c})


def test_placements_are_uniform_over_all_assignments_with_the_counts():
    counts, draws = [2, 1, 1], 12000
    distinct = set(itertools.permutations([0, 0, 1, 2]))
    assert len(distinct) == 12  # 4! / 2!
    observed = Counter(tuple(assign(counts, 21, key)) for key in range(draws))
    assert set(observed) == distinct
    expected = draws / len(distinct)
    chi_square = sum((observed[a] - expected) ** 2 / expected for a in distinct)
    assert chi_square < 31.26, (chi_square, observed)  # the 0.999 quantile of chi-square with 11 dof


def test_one_outlier_step_barely_moves_the_speed_estimate():
    estimate = SpeedEstimate(window=5, rate=0.2)
    for _ in range(20):
        estimate.update(2.0, 4)  # 0.5 s per sample
    assert estimate.per_sample_seconds == pytest.approx(0.5)
    estimate.update(40.0, 4)  # one step 20x slower
    assert abs(estimate.per_sample_seconds - 0.5) < 0.005
    assert estimate.speed == pytest.approx(2.0, rel=0.01)
    # A plain moving average at the same rate would have moved by 0.2 * 9.5 s.
    estimate.update(2.0, 4)
    assert abs(estimate.per_sample_seconds - 0.5) < 0.005


def test_a_sustained_change_is_followed():
    estimate = SpeedEstimate(window=5, rate=0.2)
    for _ in range(10):
        estimate.update(1.0, 2)
    for _ in range(40):
        estimate.update(3.0, 2)
    assert estimate.per_sample_seconds == pytest.approx(1.5, rel=1e-3)


def test_invalid_inputs_are_refused():
    with pytest.raises(ValueError):
        floored_shares([1.0, 1.0, 1.0], 0.5)
    with pytest.raises(ValueError):
        floored_shares([1.0, 0.0])
    with pytest.raises(ValueError):
        draw_counts([1.0], -1, 0)
    with pytest.raises(ValueError):
        assign([1, -1], 0)
    with pytest.raises(ValueError):
        SpeedEstimate().update(1.0, 0)
