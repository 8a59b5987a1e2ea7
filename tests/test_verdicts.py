"""The lab's rules: the collapse criterion and the statistics behind a verdict, on known inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minirl.lab import verdicts as v


def rows(reward, entropy, start=1):
    return [{"step": start + i, "rollout/reward_mean": r, "train/entropy": h} for i, (r, h) in enumerate(zip(reward, entropy))]


def test_collapse_needs_the_reward_down_and_the_entropy_out_of_its_band():
    healthy = rows([0.5] * 20, [1.0] * 20)
    assert v.collapse_step(healthy) is None
    freezing = rows([0.5] * 10 + [0.01] * 10, [1.0] * 10 + [0.1] * 10)
    assert v.collapse_step(freezing) == 15  # the first window wholly past the change
    dissolving = rows([0.5] * 10 + [0.05] * 10, [1.0] * 10 + [4.0] * 10)
    assert v.collapse_step(dissolving) == 15
    hard_but_steady = rows([0.5] * 10 + [0.05] * 10, [1.0] * 20)  # the reward fell, the policy did not
    assert v.collapse_step(hard_but_steady) is None
    held = healthy[:8] + [{**healthy[8], "heldout/avg@4": 0.1}] + healthy[9:]
    assert v.collapse_step(held, heldout_start=0.3) == 9  # below half the start
    assert v.collapse_step(held, heldout_start=0.15) is None


def test_fisher_logrank_and_the_paired_t_test_give_known_p_values():
    assert v.collapse_rates([False] * 5, [True] * 5).p == pytest.approx(2 / 252)  # C(10, 5) = 252 tables
    assert v.collapse_rates([False] * 5, [False] * 5).p == 1.0
    # one event at t = 1 in A, one run censored at 2 in B: chi² = (1 − ½)² / ¼ = 1
    assert v.time_to_collapse([1], [None], steps=2).p == pytest.approx(0.31731, abs=1e-4)
    # differences 0.1, 0.2, 0.3: mean 0.2, SD 0.1, t = 0.2 / (0.1 / √3) = 2√3 on 2 df: p = 0.0742
    e = v.paired_scores([0.3, 0.3, 0.3], [0.4, 0.5, 0.6])
    assert e.effect == pytest.approx(0.2) and e.p == pytest.approx(0.07418, abs=1e-4)
    # five pairs all up by 0.1: no spread, the interval is the point and the difference certain
    e = v.paired_scores([0.3] * 5, [0.4] * 5)
    assert (e.low, e.high, e.p) == (pytest.approx(0.1), pytest.approx(0.1), 0.0)
    assert v.paired_scores([0.3] * 5, [0.3] * 5).p == 1.0
    # five pairs can reach α (a permutation test could not: its smallest p is 2 / 2⁵)
    assert v.paired_scores([0.30, 0.32, 0.28, 0.31, 0.29], [0.36, 0.41, 0.33, 0.40, 0.35]).p < v.ALPHA


def test_bootstrap_intervals_cover_the_mean_and_narrow_with_seeds():
    rng = np.random.default_rng(0)
    a = rng.normal(0.3, 0.1, 40)
    b = a + 0.05 + rng.normal(0, 0.05, 40)
    few, many = v.paired_scores(a[:8], b[:8]), v.paired_scores(a, b)
    for e in (few, many):
        assert e.low < e.effect < e.high
    assert many.high - many.low < few.high - few.low
    assert many.p < v.ALPHA < few.p or many.p < few.p


def test_power_is_alpha_without_an_effect_and_grows_with_it():
    assert v.power_collapse(5, 0.0, 1.0) == pytest.approx(1.0)
    assert v.power_collapse(5, 0.5, 0.5) <= v.ALPHA  # Fisher's test is conservative
    assert v.power_collapse(10, 0.1, 0.8) > v.power_collapse(5, 0.1, 0.8)
    assert v.power_paired(8, 0.0, 0.1) == pytest.approx(v.ALPHA, abs=1e-9)
    assert v.power_paired(20, 0.05, 0.1) > v.power_paired(5, 0.05, 0.1)
    # n = 5, effect = 1 SD: noncentrality √5 on 4 df (G*Power gives 0.4013)
    assert v.power_paired(5, 0.1, 0.1) == pytest.approx(0.4013, abs=2e-3)
    # two pairs that barely differ: a noncentrality of 150 on 1 df, where scipy's far tail is nan
    assert v.power_paired(2, 0.1, 0.1 * 2 ** 0.5 / 150) == pytest.approx(1.0)


def test_verdicts_say_reproduced_contradicted_or_not_observed_with_power():
    nan = math.nan
    assert v.verdict(v.Evidence(0.8, nan, nan, 0.008, 10, "x"), claim_sign=1, power=0.9).startswith("reproduced (x +0.800")
    assert v.verdict(v.Evidence(-0.8, nan, nan, 0.008, 10, "x"), claim_sign=1, power=0.9).startswith("contradicted")
    text = v.verdict(v.Evidence(0.2, nan, nan, 0.4, 10, "x"), claim_sign=1, power=0.31)
    assert text.startswith("not observed") and "power 0.31" in text and "inconclusive" not in text


def test_the_placebo_comes_out_no_different_and_a_broken_lab_is_caught():
    """fp32 rollouts make MiniRL and "without IS" the same algorithm: synthetic runs drawn alike
    must come out "no difference"; a lab that made them differ says it is broken."""
    rng = np.random.default_rng(1)
    same_a, same_b = rng.normal(0.4, 0.08, 8), rng.normal(0.4, 0.08, 8)
    ok = v.verdict(v.paired_scores(same_a, same_b), claim_sign=0, power=0.0, placebo=True)
    assert ok.startswith("no difference")
    broken = v.verdict(v.paired_scores(same_a, same_a + 0.2), claim_sign=0, power=0.0, placebo=True)
    assert "the lab itself is broken" in broken
    assert v.verdict(v.collapse_rates([False] * 6, [False] * 6), claim_sign=0, power=0.0,
                     placebo=True).startswith("no difference")
    # a finding that claims no difference (F6) is reproduced by none, contradicted by one
    assert v.verdict(v.paired_scores(same_a, same_b), claim_sign=0, power=0.9).startswith("reproduced: no difference")
    assert v.verdict(v.paired_scores(same_a, same_b), claim_sign=0, power=0.3).startswith("not observed: no difference seen")
    assert v.verdict(v.paired_scores(same_a, same_a + 0.2), claim_sign=0, power=0.5).startswith("contradicted")
    # fewer than MIN_BOOTSTRAP pairs: the t-test's own interval, named so; known values: differences
    # 0.5, 0.6, 0.7 have mean 0.6 and standard error 0.1 / √3, and t(0.975, 2) = 4.303, so
    # 0.6 ± 0.248; one pair has no interval at all
    few = v.paired_scores([1.0, 1.0, 1.0], [1.5, 1.6, 1.7])
    assert (few.low, few.high) == (pytest.approx(0.3516, abs=1e-4), pytest.approx(0.8484, abs=1e-4))
    assert "95% t-CI [+0.352, +0.848]" in few.text()
    assert math.isnan(v.paired_scores([0.1], [0.3]).low)


def test_still_rising_tests_the_slopes_across_seeds():
    """Known values: t = mean / (sd / √n) = 0.022 / (0.0324 / √3) = 1.17 on 2 degrees of freedom,
    one-sided p = 0.180; one seed cannot be tested; equal slopes are decided by their sign."""
    mean, p = v.still_rising([0.031, -0.014, 0.049])
    assert mean == pytest.approx(0.022) and p == pytest.approx(0.1806, abs=1e-3)
    assert v.still_rising([0.03]) == (pytest.approx(0.03), 0.0)
    assert v.still_rising([0.02, 0.02]) == (pytest.approx(0.02), 0.0)
    assert v.still_rising([-0.01, -0.01])[1] == 1.0


def test_a_verdict_without_the_power_says_how_many_seeds_would_have_it():
    """Known values: Fisher at true collapse rates 0 and 0.8 has power 0.74 at 5 seeds, 0.66 at 6
    (the test's discreteness: power is not monotone in n), 0.85 at 7; the paired t-test for 0.1 with differences spreading by 0.1126 (the lengthnorm
    study's) reaches 0.8 at 13 pairs. Verdicts that have the power say nothing more."""
    assert v.seeds_for_power(lambda n: v.power_collapse(n, 0.0, 0.8)) == 7
    assert v.seeds_for_power(lambda n: v.power_paired(n, 0.1, 0.1126)) == 13
    assert v.seeds_for_power(lambda n: 0.0) == v.SEEDS_MOST + 1
    e = v.Evidence(-0.098, -0.185, -0.011, 0.123, 5, "mean paired held-out difference")
    assert v.verdict(e, claim_sign=-1, power=0.33, seeds_needed=13).endswith("; power 0.8 needs 13 seeds)")
    assert v.verdict(e, claim_sign=-1, power=0.33, seeds_needed=41).endswith("needs more than 40 seeds)")
    assert "needs" not in v.verdict(e, claim_sign=-1, power=0.9, seeds_needed=3)
