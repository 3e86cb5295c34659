"""Wilson intervals against the formula worked by hand, and the seed band (analysis/intervals.py)."""

from __future__ import annotations

import math

import pytest

from headscope.analysis.intervals import (
    from_accuracy,
    overlaps,
    proportion_of,
    reaches,
    seed_band,
    smallest_passing,
    wilson,
)

Z = 1.959963984540054


def _by_hand(k: int, n: int) -> tuple[float, float]:
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (2, 4), (0, 4), (4, 4), (7, 100), (50, 100), (99, 100), (3, 17)])
def test_wilson_equals_the_formula_worked_by_hand(k, n):
    p = wilson(k, n)
    low, high = _by_hand(k, n)
    assert p.low == pytest.approx(low, abs=1e-12) and p.high == pytest.approx(high, abs=1e-12)
    assert 0 <= p.low <= p.value <= p.high <= 1


def test_two_of_four_is_a_wide_interval_and_says_so():
    # the shipped 2,048-token curve: 2 of 4 needles; 0.75 vs 0.50 is not a difference at n = 4
    half = wilson(2, 4)
    assert half.text() == "0.50 [0.15, 0.85] n=4"
    assert overlaps(wilson(3, 4), half)
    assert not overlaps(wilson(0, 100), wilson(100, 100))


def test_an_all_or_nothing_result_still_has_a_width():
    assert wilson(0, 10).high > 0.2 and wilson(10, 10).low < 0.8


def test_no_prompts_is_empty_not_zero():
    p = wilson(0, 0)
    assert p.n == 0 and math.isnan(p.value) and math.isnan(p.low) and p.text() == "n=0"
    assert not overlaps(p, wilson(1, 2))
    assert from_accuracy(float("nan"), 5).n == 0


@pytest.mark.parametrize("k,n", [(-1, 4), (5, 4), (1, -1)])
def test_impossible_counts_are_refused(k, n):
    with pytest.raises(ValueError, match="successes <= n"):
        wilson(k, n)


def test_outcomes_and_accuracies_give_the_same_interval():
    assert proportion_of([True, False, True, True]) == wilson(3, 4) == from_accuracy(0.75, 4)
    assert wilson(3, 4).columns("niah_accuracy") == {"niah_accuracy": 0.75, "niah_accuracy_n": 4,
                                                     "niah_accuracy_low": wilson(3, 4).low,
                                                     "niah_accuracy_high": wilson(3, 4).high}


def test_the_seed_band_spans_the_seeds_and_skips_missing_ones():
    band = seed_band([0.25, float("nan"), 0.5, 0.0])
    assert (band.mean, band.low, band.high, band.n_seeds) == (0.25, 0.0, 0.5, 3)
    assert seed_band([]).n_seeds == 0 and math.isnan(seed_band([]).mean)


def test_reaching_is_decided_on_the_intervals_and_a_better_policy_passes():
    base = wilson(97, 100)  # [0.915, 0.990]
    assert reaches(wilson(90, 100), base)  # high 0.945: not told apart from 0.97
    assert not reaches(wilson(60, 100), base)  # high 0.691
    assert reaches(wilson(60, 100), base, tolerance=0.25)  # 0.691 >= 0.915 - 0.25
    assert reaches(wilson(100, 100), base)  # above the uncompressed model
    assert not reaches(wilson(0, 0), base) and not reaches(base, wilson(0, 0))  # no prompts: no decision


def test_the_smallest_passing_group_needs_every_member_and_gives_its_largest():
    kv = {"a": 0.2, "b": 0.25, "c": 0.5, "d": 0.55, "e": 0.1}
    passing = {"a", "b", "c", "d"}
    # (a, b) is smallest by mean and every member passes: of it, the one keeping the most
    assert smallest_passing([["c", "d"], ["a", "b"], ["e"]], kv.get, passing.__contains__) == "b"
    assert smallest_passing([["e", "a"], ["c"]], kv.get, passing.__contains__) == "c"  # e fails its group
    assert smallest_passing([["e"], []], kv.get, passing.__contains__) is None
