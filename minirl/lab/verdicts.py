"""The lab's rules, fixed before any run: when a run has collapsed, and how two arms' seeds become
a verdict. Statistics come from scipy.stats; nothing here reads a run folder.

A study compares two arms over K paired seeds (seed i of both arms draws the same prompts and
sampling noise). Three kinds of evidence, each with its test:

- collapse rates: Fisher's exact test on the 2 × 2 table (collapsed or not, per arm);
- time to collapse: the log-rank test, runs that never collapsed censored at their last step;
- final held-out scores: the mean paired difference, a bootstrap interval and the paired
  t-test's p-value. (Not a permutation test: with the 5 seeds a study can afford, its smallest
  two-sided p is 2 / 2⁵ = 0.0625, so no score finding could ever be reproduced.)

A verdict says "reproduced (effect, interval, p)" when the effect the paper claims is there at
α = 0.05, "contradicted (…)" when the opposite effect is, and otherwise "not observed (n, power
for the stated effect)": how likely this many seeds were to see the paper's effect had it been
there. Never a bare "inconclusive".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

ALPHA = 0.05
MIN_BOOTSTRAP = 5  # pairs below which no bootstrap interval is given

# Collapse, independent of the guard's thresholds (which were shaped on this lab's own runs):
# a run has collapsed at the first step where, over a window of COLLAPSE_WINDOW steps, the mean
# reward is below COLLAPSE_REWARD_FRAC of the best window mean so far and the mean entropy has left
# [ENTROPY_LOW, ENTROPY_HIGH] × the first window's, or where a held-out score falls below
# COLLAPSE_HELDOUT_FRAC of the run's starting score.
COLLAPSE_WINDOW = 5
COLLAPSE_REWARD_FRAC = 0.25
ENTROPY_LOW, ENTROPY_HIGH = 0.25, 3.0
COLLAPSE_HELDOUT_FRAC = 0.5


def collapse_step(rows: Sequence[dict], heldout_start: float | None = None) -> int | None:
    """The step at which a run collapsed by the rule above, or None. `rows` are metrics.jsonl rows
    (`step`, `rollout/reward_mean`, `train/entropy`, and `heldout/avg@k` where evaluated).

    >>> healthy = [{"step": s, "rollout/reward_mean": 0.5, "train/entropy": 1.0} for s in range(1, 21)]
    >>> collapse_step(healthy) is None
    True
    >>> frozen = healthy[:10] + [{"step": s, "rollout/reward_mean": 0.01, "train/entropy": 0.1} for s in range(11, 21)]
    >>> collapse_step(frozen)
    15
    """
    rewards = [float(r.get("rollout/reward_mean", math.nan)) for r in rows]
    entropies = [float(r.get("train/entropy", math.nan)) for r in rows]
    w = COLLAPSE_WINDOW
    best = -math.inf
    h0 = float(np.mean(entropies[:w])) if len(entropies) >= w else math.nan
    for i, row in enumerate(rows):
        held = next((v for k, v in row.items() if k.startswith("heldout/avg@")), None)
        if heldout_start and held is not None and held < COLLAPSE_HELDOUT_FRAC * heldout_start:
            return int(row["step"])
        if i + 1 < w:
            continue
        reward, entropy = float(np.mean(rewards[i + 1 - w:i + 1])), float(np.mean(entropies[i + 1 - w:i + 1]))
        best = max(best, reward)
        out_of_band = not (ENTROPY_LOW * h0 <= entropy <= ENTROPY_HIGH * h0)
        if best > 0 and reward < COLLAPSE_REWARD_FRAC * best and out_of_band:
            return int(row["step"])
    return None


# A run's final held-out score, the endpoint every score comparison is decided on. "last": the
# last evaluation. "late": the mean of the evaluations in the run's last third (steps ≥ 2/3 of
# its last): a policy swings between evaluations by far more than the evaluation's own noise
# (docs/results/lab.md, the long miniature's placebo pair), and one evaluation inherits the swing
# whole. A study records its endpoint before its first run (studies.mechanism); one declared
# before "late" existed keeps "last".
ENDPOINTS = {"last": "the last held-out evaluation",
             "late": "the mean of the held-out evaluations in the run's last third"}


def late_score(rows: Sequence[dict], end: float | None = None) -> float | None:
    """The "late" endpoint: the mean held-out score over the evaluations at steps ≥ 2/3 of the
    run's last, or None where there was none. `end`: the run's closing evaluation, which its rows
    hold only where the last step fell on the evaluation schedule.

    >>> rows = [{"step": s, "heldout/avg@4": x} for s, x in [(50, 0.2), (75, 0.4), (100, 0.6), (125, 0.9), (150, 0.6)]]
    >>> round(late_score(rows, end=0.6), 3)
    0.7
    >>> round(late_score(rows[:-1] + [{"step": 160}], end=0.3), 3)  # 160 is off the schedule: `end` counts
    0.6
    """
    if not rows:
        return None
    last = rows[-1]["step"]
    pts = [x for r in rows if 3 * r["step"] >= 2 * last for k, x in r.items() if k.startswith("heldout/avg@")]
    if end is not None and not any(k.startswith("heldout/avg@") for k in rows[-1]):
        pts.append(end)
    return float(np.mean(pts)) if pts else None


# F6 compares cold starts once training has converged: a run has plateaued when its held-out score
# rises by less than PLATEAU_SLOPE per 100 steps over the second half of the run (least squares
# over the evaluations there; the score's own noise is 0.016–0.031 at 256 problems × 4 samples).
PLATEAU_SLOPE = 0.02
PLATEAU_MIN_EVALS = 3


def heldout_slope(rows: Sequence[dict]) -> float | None:
    """The held-out score's rise per 100 steps over the second half of the run (least squares),
    or None with fewer than PLATEAU_MIN_EVALS evaluations there.

    >>> rows = [{"step": s, "heldout/avg@4": 0.3 + 0.001 * s} for s in range(25, 201, 25)]
    >>> round(heldout_slope(rows), 3)
    0.1
    """
    if not rows:
        return None
    last = rows[-1]["step"]
    pts = [(r["step"], x) for r in rows if r["step"] >= last / 2 for k, x in r.items() if k.startswith("heldout/avg@")]
    if len(pts) < PLATEAU_MIN_EVALS:
        return None
    steps, scores = zip(*pts)
    return 100 * float(stats.linregress(steps, scores).slope)


def still_rising(slopes: Sequence[float]) -> tuple[float, float]:
    """Mean held-out slope over seeds (per 100 steps) and the one-sided p that it is above 0 (one-sample
    t-test across seeds: the seeds are the independent units; one run's evaluations are not, a
    policy drifts between them). An arm is still rising while the mean is at or above PLATEAU_SLOPE
    and p < ALPHA; one seed cannot be tested, and counts as rising at or above the bound.

    >>> mean, p = still_rising([0.031, -0.014, 0.049]); round(mean, 3), round(p, 2)
    (0.022, 0.18)
    """
    mean = float(np.mean(slopes))
    if len(slopes) < 2:
        return mean, 0.0
    if float(np.ptp(slopes)) < 1e-12:
        return mean, 0.0 if mean > 0 else 1.0
    return mean, float(stats.ttest_1samp(slopes, 0.0, alternative="greater").pvalue)


@dataclass(frozen=True)
class Evidence:
    """One test's outcome: the effect (B − A), its 95% interval where there is one, the p-value."""

    effect: float
    low: float
    high: float
    p: float
    n: int
    what: str
    interval: str = "CI"  # how the interval was had: "CI" (BCa bootstrap), "t-CI" (the t distribution's)

    def text(self) -> str:
        interval = "" if math.isnan(self.low) else f", 95% {self.interval} [{self.low:+.3f}, {self.high:+.3f}]"
        return f"{self.what} {self.effect:+.3f}{interval}, p = {self.p:.3g}, n = {self.n}"


def collapse_rates(a: Sequence[bool], b: Sequence[bool]) -> Evidence:
    """Fisher's exact test, two-sided, on collapsed / not per arm; effect: rate(B) − rate(A).

    >>> round(collapse_rates([False] * 5, [True] * 5).p, 4)
    0.0079
    """
    table = [[sum(b), len(b) - sum(b)], [sum(a), len(a) - sum(a)]]
    p = stats.fisher_exact(table).pvalue
    return Evidence(sum(b) / len(b) - sum(a) / len(a), math.nan, math.nan, float(p), len(a) + len(b),
                    "collapse rate difference")


def time_to_collapse(a: Sequence[int | None], b: Sequence[int | None], *, steps: int) -> Evidence:
    """The log-rank test on time to collapse, runs that never collapsed censored at `steps`;
    effect: the difference in median collapse-free steps (B − A, `steps` where more than half never fell)."""

    def data(times):
        x = stats.CensoredData(uncensored=[t for t in times if t is not None],
                               right=[steps for t in times if t is None])
        return x

    # no collapse in either arm: nothing to compare (the test's statistic would be 0 / 0)
    p = stats.logrank(data(a), data(b)).pvalue if any(t is not None for t in (*a, *b)) else 1.0

    def median(times):
        ordered = sorted(steps if t is None else t for t in times)
        return float(np.median(ordered))

    return Evidence(median(b) - median(a), math.nan, math.nan, float(p), len(a) + len(b),
                    "median steps to collapse difference")


def paired_scores(a: Sequence[float], b: Sequence[float], *, seed: int = 0, resamples: int = 9999) -> Evidence:
    """Seed i of A against seed i of B: the mean paired difference B − A, its bootstrap 95%
    interval (BCa; from MIN_BOOTSTRAP pairs on; below that, too few to resample, the paired
    t-test's own interval, labelled "t-CI") and the two-sided p-value of the paired t-test.

    >>> round(paired_scores([0.30, 0.32, 0.28, 0.31, 0.29], [0.40, 0.41, 0.37, 0.42, 0.38]).p, 4)
    0.0
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = b - a
    spread = len(d) >= 2 and np.ptp(d) >= 1e-12  # else (to rounding) t is 0 / 0 or ±∞
    test = stats.ttest_rel(b, a) if spread else None
    kind = "CI"
    if spread and len(d) < MIN_BOOTSTRAP:
        ci = test.confidence_interval(0.95)
        low, high, kind = float(ci.low), float(ci.high), "t-CI"
    elif spread:
        ci = stats.bootstrap((d,), np.mean, confidence_level=0.95, n_resamples=resamples, method="BCa",
                             random_state=np.random.default_rng(seed)).confidence_interval
        low, high = float(ci.low), float(ci.high)
    elif len(d) >= MIN_BOOTSTRAP:  # every pair moved alike: the interval is the point
        low = high = float(d.mean())
    else:  # one pair, or pairs that all moved alike below MIN_BOOTSTRAP: no interval to speak of
        low = high = math.nan
    if spread:
        p = float(test.pvalue)
    else:  # one pair tells nothing; pairs that all moved alike differ surely, unless by nothing
        p = 1.0 if len(d) < 2 or d[0] == 0 else 0.0
    return Evidence(float(d.mean()), low, high, p, len(d), "mean paired held-out difference", kind)


def power_collapse(n: int, rate_a: float, rate_b: float) -> float:
    """The chance that Fisher's test on n seeds an arm finds p < α when the arms' true collapse
    rates are `rate_a` and `rate_b` (exact: every outcome's probability summed).

    >>> round(power_collapse(5, 0.0, 1.0), 3)
    1.0
    """
    power = 0.0
    for ka in range(n + 1):
        for kb in range(n + 1):
            prob = stats.binom.pmf(ka, n, rate_a) * stats.binom.pmf(kb, n, rate_b)
            if prob > 0 and stats.fisher_exact([[kb, n - kb], [ka, n - ka]]).pvalue < ALPHA:
                power += prob
    return float(power)


def power_paired(n: int, effect: float, sd: float) -> float:
    """The chance that the two-sided paired t-test on n pairs finds p < α when the true mean
    difference is `effect` and the paired differences spread with `sd` (the noncentral t)."""
    if n < 2 or sd <= 0:
        return 0.0
    df = n - 1
    t = stats.t.ppf(1 - ALPHA / 2, df)
    shift = abs(effect) / (sd / math.sqrt(n))
    # scipy's noncentral t returns nan for some far tails (df = 1, shift ≈ 150): a tail that far is 0
    upper, lower = (float(np.nan_to_num(x)) for x in (stats.nct.sf(t, df, shift), stats.nct.cdf(-t, df, shift)))
    return min(1.0, upper + lower)


POWER = 0.8  # enough seeds: "no difference" counts as shown at this power; below it a verdict says what would reach it
SEEDS_MOST = 40  # where seeds_for_power stops looking: beyond it a miniature cannot afford the seeds


def seeds_for_power(power: Callable[[int], float], *, target: float = POWER) -> int:
    """The fewest seeds per arm at which `power(n)` reaches `target`; SEEDS_MOST + 1 when not by then.

    >>> seeds_for_power(lambda n: power_collapse(n, 0.0, 0.8))
    7
    """
    return next((n for n in range(2, SEEDS_MOST + 1) if power(n) >= target), SEEDS_MOST + 1)


def verdict(evidence: Evidence, *, claim_sign: int, power: float, placebo: bool = False,
            seeds_needed: int | None = None) -> str:
    """"reproduced" when the effect has the paper's sign (`claim_sign`: +1 or −1) at p < α,
    "contradicted" when it has the other sign at p < α, else "not observed" with this many seeds'
    power to see the paper's effect (and, given `seeds_needed`, how many seeds would have 0.8).
    `claim_sign` 0: the paper expects no difference; for a `placebo` (an arm pair that is one
    algorithm) a difference means the lab itself is broken.

    >>> e = Evidence(0.8, float("nan"), float("nan"), 0.008, 10, "collapse rate difference")
    >>> verdict(e, claim_sign=1, power=0.9).split(" (")[0]
    'reproduced'
    """
    significant = evidence.p < ALPHA
    if claim_sign == 0 and placebo:
        return (f"difference ({evidence.text()}): the placebo differs, so the lab itself is broken" if significant
                else f"no difference, as it must be ({evidence.text()})")
    need = ""
    if power < POWER and seeds_needed is not None:
        need = f"; power {POWER:g} needs {seeds_needed if seeds_needed <= SEEDS_MOST else f'more than {SEEDS_MOST}'} seeds"
    if claim_sign == 0:  # "no difference" is shown only by seeds that would have seen one
        if significant:
            return f"contradicted: a difference ({evidence.text()})"
        if power >= POWER:
            return f"reproduced: no difference ({evidence.text()}; power {power:.2f} to see an effect of the stated size)"
        return (f"not observed: no difference seen, but these seeds had power {power:.2f} to see an effect of the "
                f"stated size ({evidence.text()}{need})")
    if significant and np.sign(evidence.effect) == claim_sign:
        return f"reproduced ({evidence.text()})"
    if significant:
        return f"contradicted ({evidence.text()})"
    return f"not observed ({evidence.text()}; power {power:.2f} to see the paper's effect with these seeds{need})"
