"""Guardrails: one decision per step, taken between the loss and the optimizer step.

The paper's collapses (F1, F3, F4) announce themselves in two signals it tells us to watch:
the training–inference KL D_KL(μ_old ‖ π_old) climbs, and token entropy falls sharply. The guard
reads both, plus the update itself (a non-finite loss or gradient), and answers:

    "step"      apply the optimizer step
    "skip"      drop this update (non-finite loss/grad), nothing else changes; also when disabled
    "rollback"  a signal stayed bad for `patience` steps: restore the last good checkpoint
    "stop"      `max_rollbacks` used up: end the run as "collapsed"

Thresholds are deliberately loose: a healthy run sharpens its policy (on the embedded default the
entropy falls from 0.32 to 0.07 in 300 steps, and KL stays ~1e-3), so "collapse" means KL above
`max_kl`, or the reward down from the run's level while the entropy has left its band either way:

    below `min_entropy_frac` × H_0   the paper's collapse: the policy freezes onto wrong answers;
    above `max_entropy_factor` × H_0 the other shape, seen in `minirl lab` off-policy without
                                     clipping: the policy dissolves into noise, entropy rising;

where H_0 is the run's first finite entropy. The run's *level* is a trend, never a lucky step (#80:
judged against the best single step, healthy plateaus at rewards 0.02–0.5 whose entropy drifted up
were rolled back on 7–10 of 20 seeds: docs/runs.md): the best mean reward of `slide_window` consecutive
steps since the run's start or its last rollback (the restored weights' level is the new
reference), of all the steps so far while there are fewer. "Down" means below level −
`reward_drop` or below (1 − `reward_drop_frac`) × level, *and* more than `down_z` standard errors
below it, the error of the difference under "the policy is still at its level": a step's reward
varies at most L(1 − L) / B there (Bhatia–Davis, below), the level's own mean its variance bound. On
a hard task at B = 32 a step must fall far to count: from a level of 0.23 to below 0.08, from 0.05
never (one step there cannot tell a fall from noise; the slide rule sees a lasting one). A fall of
the reward alone to half the level is no bad step: real runs dip there for a few steps and come
back (docs/runs.md), which only the entropy tells apart from a collapse. A *crash* is: a step below
(1 − `crash_frac`) × the level (a quarter of it), `down_z` standard errors below it, whatever the
entropy does (the lab's 0.23 → 0.02 in 2 steps, its entropy out of the band only 3 steps later:
acted on 3 steps after the fall instead of 7).

A slide the entropy does not show (#64: a reward that fell from 0.47 to 0.10 over 90 steps with a
calm entropy) is bad on its own: the mean reward of the last `slide_window` steps below the best
such window of the run so far by more than `slide_z` standard errors of the difference, and by more
than `slide_drop_frac` of that best. The error is the run's own sampling noise, bounded from the
reward alone: a step's reward is the mean of B prompts' group means, each in [0, 1] with mean r,
so its variance is at most r(1 − r) / B (Bhatia–Davis), and a window's mean's variance at most
Σ r_t(1 − r_t) / (B · W²). Sampling noise is not all of it: a policy wobbles by itself (off-policy
runs without clipping by 0.1 over a few dozen steps at B = 128, where the sampling noise is
small), which the relative floor leaves alone. How the three were chosen (healthy runs never
reach them; a forced slide is caught within a window): docs/runs.md.

The training–inference mismatch, judged apart from the lag (#79). Sampling k updates ahead puts the
policy's own move into KL(μ‖π_old), so that KL is allowed `max_kl_per_update_behind` × the lag; a
mismatch (an engine's numerics, a sync that went wrong) must not hide in that allowance, and two
signals see it without any lag in them: the KL over the tokens the trained weights sampled
themselves (with in-flight updates; `kl_fresh`, held to `max_kl`), and the parity check (the loop's
`parity`: both engines at the same weights, on a fixed batch), which `observe_parity` takes after
each sync and the next decision judges: above `max_parity`, or above `parity_growth` × the median
of the run's parities so far (a healthy run's wobble stays within it: docs/runs.md), and above
`parity_floor`. A bad parity is measured again at the next step (`parity_due`), so that a lasting
one makes a streak. What was left out: no automatic learning-rate or clip retuning beyond the
`lr_factor` applied at each rollback; the held-out score is not watched (a run measures it at
its start and end unless eval.every is set).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from minirl.config.recipe import GuardConfig

_SET = GuardConfig()  # the thresholds' defaults, written once: the recipe's [guard] section
PARITIES_KEPT = 50  # the good parity checks whose median is the reference (a run's last 500 steps at parity_every 10)


@dataclass(frozen=True, slots=True)
class Verdict:
    action: str  # step | skip | rollback | stop
    reason: str = ""


@dataclass
class Guard:
    max_kl: float = _SET.max_kl
    max_kl_per_update_behind: float = _SET.max_kl_per_update_behind
    max_parity: float = _SET.max_parity
    parity_growth: float = _SET.parity_growth
    parity_floor: float = _SET.parity_floor
    min_entropy_frac: float = _SET.min_entropy_frac
    max_entropy_factor: float = _SET.max_entropy_factor
    # with the entropy out of its band, the reward must also be `reward_drop` below the run's level,
    # or below (1 − `reward_drop_frac`) × it, and `down_z` standard errors below it
    reward_drop: float = _SET.reward_drop
    reward_drop_frac: float = _SET.reward_drop_frac
    down_z: float = _SET.down_z
    crash_frac: float = _SET.crash_frac  # a step below (1 − this) × the level, down_z errors below: bad on its own
    slide_window: int = _SET.slide_window
    slide_z: float = _SET.slide_z
    slide_drop_frac: float = _SET.slide_drop_frac
    patience: int = _SET.patience
    max_rollbacks: int = _SET.max_rollbacks
    enabled: bool = _SET.enabled
    prompts: int = 1  # B, the prompts a step's reward averages (the slide's noise); 1 is the widest bound
    # state (saved with checkpoints)
    entropy0: float | None = None
    bad_streak: int = 0
    recent: list[float] = field(default_factory=list)  # the last `patience` judged steps' rewards
    window: list[float] = field(default_factory=list)  # the last `slide_window` steps' rewards
    # the run's level: (mean, variance of the mean, steps) of the best window since the start or the
    # last rollback; a partial window's only until the first full one
    best_window: tuple[float, float, int] | None = None
    slide: tuple[float, float] = (0.0, 0.0)  # the last full window's (z, share of the best lost): what _slide judged
    parities: list[float] = field(default_factory=list)  # the run's good parity checks (their median: the reference)
    parity_bad: str = ""  # the last parity check's verdict, judged by the next decision ('' when good)
    rollbacks: int = 0
    skipped: int = 0
    skip_streak: int = 0  # non-finite updates in a row (#80: beyond `patience` they act as a bad streak does)
    reasons: list[str] = field(default_factory=list)

    SETTINGS = ("max_kl", "max_kl_per_update_behind", "max_parity", "parity_growth", "parity_floor", "min_entropy_frac",
                "max_entropy_factor", "reward_drop", "reward_drop_frac", "down_z", "crash_frac", "slide_window", "slide_z", "slide_drop_frac",
                "patience", "max_rollbacks", "enabled")

    @classmethod
    def from_settings(cls, settings: Mapping, **over) -> Guard:
        """A fresh guard from the recipe's [guard] section (a dict or GuardConfig); keys a recorded
        recipe predates take their defaults."""
        get = settings.get if isinstance(settings, Mapping) else lambda k, d: getattr(settings, k, d)
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(**{**{k: get(k, defaults[k]) for k in cls.SETTINGS}, **over})

    def decide(
        self, *, kl: float, entropy: float, reward: float, loss: float, grad_norm: float, new_step: bool = True,
        lag: float = 0.0, kl_fresh: float | None = None,
    ) -> Verdict:
        """The one decision point. Call after backward, before optimizer.step(). The step's signals
        (KL, entropy, reward) are judged once, on its first mini-batch (new_step); every mini-batch's
        update is checked for non-finite values, and skipped when it has any, whether the guard is
        enabled or only observing (`enabled = false`, every lab cell): a NaN in the weights is no
        outcome to observe. `lag`: the batch's mean staleness in updates (rollout.max_staleness ≥ 1):
        the KL that sampling behind adds is allowed, the rest is a mismatch. `kl_fresh`: KL(μ‖π_old)
        over the batch's tokens sampled by the trained weights themselves, where a batch sampled
        behind has enough of them (None otherwise; at k = 0 `kl` is it), held to max_kl."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped += 1
            self.skip_streak += 1
            reason = f"non-finite update (loss {loss}, grad norm {grad_norm})"
            if self.enabled and self.skip_streak >= self.patience:  # the run would train on nothing: act
                return self._act(f"{reason}, {self.skip_streak} updates in a row")
            return Verdict("skip", reason)
        self.skip_streak = 0
        if not self.enabled or not new_step:
            return Verdict("step")
        if self.entropy0 is None and math.isfinite(entropy):  # a non-finite first entropy: the first finite one
            self.entropy0 = entropy
        finite = math.isfinite(reward)  # a non-finite reward is no evidence of progress or of a fall
        if finite:
            self.recent = [*self.recent, reward][-self.patience:]
            new_level = self._level(reward)
        reason = ""
        down = finite and self._down(reward, 1)
        allowed = self.max_kl + self.max_kl_per_update_behind * lag
        if not all(math.isfinite(x) for x in (kl, entropy, reward)):  # never "not above a threshold"
            reason = f"a non-finite signal (KL(μ‖π_old) {kl}, entropy {entropy}, reward {reward})"
        elif kl > allowed:
            reason = (f"KL(μ‖π_old) {kl:.3g} > {self.max_kl}" if not lag else
                      f"KL(μ‖π_old) {kl:.3g} > {self.max_kl} + {self.max_kl_per_update_behind} × {lag:.2f} updates "
                      f"of lag: a mismatch beyond what sampling {lag:.2f} updates behind explains "
                      f"(guard.max_kl_per_update_behind, rollout.max_staleness)")
        elif kl_fresh is not None and kl_fresh > self.max_kl:
            reason = (f"KL(μ‖π_old) {kl_fresh:.3g} > {self.max_kl} over the tokens the trained weights sampled "
                      f"themselves: a mismatch between engine and trainer, no lag in it")
        elif self.parity_bad:
            reason = self.parity_bad
        elif down and self.entropy0 is not None and entropy < self.min_entropy_frac * self.entropy0:
            reason = f"entropy {entropy:.3g} < {self.min_entropy_frac} × {self.entropy0:.3g} with {down}"
        elif down and self.entropy0 is not None and entropy > self.max_entropy_factor * self.entropy0:
            reason = f"entropy {entropy:.3g} > {self.max_entropy_factor} × {self.entropy0:.3g} with {down}"
        elif crash := finite and self._down(reward, 1, crash=True):
            reason = f"a crash: {crash}"
        slide = self._slide(new_level) if finite else ""
        reason = reason or slide
        self.bad_streak = self.bad_streak + 1 if reason else 0
        if self.bad_streak < self.patience:
            return Verdict("step", reason)
        return self._act(reason)

    def _act(self, reason: str) -> Verdict:
        """`patience` bad steps (or skipped updates) in a row: a rollback, or once `max_rollbacks` are
        used, the stop. A streak of skipped updates goes on across the rollback: one more non-finite
        update after it acts again at once (a NaN every step stops within patience + max_rollbacks
        steps, never "finished" having trained nothing)."""
        self.bad_streak = 0
        self.reasons.append(reason)
        if self.rollbacks >= self.max_rollbacks:
            return Verdict("stop", f"{reason}; {self.rollbacks} rollbacks used")
        self.rollbacks += 1
        self.window, self.best_window = [], None  # the weights go back: their level is the new reference
        return Verdict("rollback", reason)

    def observe_parity(self, parity: float) -> None:
        """A parity check (mean |log μ − log π| on the fixed batch, both engines at the weights just
        synced), judged by the next decision: bad above max_parity, or above parity_floor and
        parity_growth × the median of the good ones so far (once there are 3)."""
        ref = statistics.median(self.parities) if len(self.parities) >= 3 else None
        if not math.isfinite(parity):  # the loop stops on one first (errors.EngineFault); a replay may not
            self.parity_bad = f"parity {parity}: the engine's log-probs are broken"
        elif parity > self.max_parity:
            self.parity_bad = (f"parity {parity:.3g} > {self.max_parity:g} (mean |log μ − log π| on the fixed batch "
                               f"after the sync): the engine does not compute what the trainer does")
        elif ref is not None and parity > max(self.parity_floor, self.parity_growth * ref):
            self.parity_bad = (f"parity {parity:.3g} > {self.parity_growth:g} × {ref:.3g}, the median of the run's "
                               f"parities (mean |log μ − log π| on the fixed batch after the sync): the engine has "
                               f"moved away from the trainer")
        else:
            self.parity_bad = ""
            self.parities = [*self.parities, parity][-PARITIES_KEPT:]

    @property
    def parity_due(self) -> bool:
        """The last parity check was bad: measure it again after this step's sync."""
        return bool(self.parity_bad)

    def _level(self, reward: float) -> bool:
        """The step's reward into the window, and the run's level updated: True when this window is
        the new level."""
        w = max(self.slide_window, 1)  # slide_window = 0 (no slide rule): the level is the best step
        self.window = [*self.window, reward][-w:]
        n = len(self.window)
        mean = sum(self.window) / n
        if self.best_window is None or mean > self.best_window[0] or (n == w and self.best_window[2] < w):
            self.best_window = (mean, sum(_spread(x) for x in self.window) / (self.prompts * n * n), n)
            return True
        return False

    def _slide(self, new_level: bool) -> str:
        """The reward's last `slide_window` steps against the run's level: a reason when their mean
        is more than `slide_z` standard errors of the difference below it and more than
        `slide_drop_frac` of it (the module's docstring), else ''."""
        w = self.slide_window
        if not w or len(self.window) < w:
            return ""
        if new_level:
            self.slide = (0.0, 0.0)
            return ""
        mean = sum(self.window) / w
        var = sum(_spread(x) for x in self.window) / (self.prompts * w * w)
        best = self.best_window[0]
        if best <= 0:  # no window has earned anything yet (an ordinary start on a hard task): no slide from it
            self.slide = (0.0, 0.0)
            return ""
        z, lost = (best - mean) / math.sqrt(max(var + self.best_window[1], 1e-12)), (best - mean) / best
        self.slide = (z, lost)
        if z <= self.slide_z or lost <= self.slide_drop_frac:
            return ""
        return (f"reward slid: the last {w} steps' mean {mean:.3g} is {z:.1f} standard errors (> {self.slide_z:g}) "
                f"and {lost:.0%} (> {self.slide_drop_frac:.0%}) below the best {w}-step mean {best:.3g}")

    def _down(self, mean: float, n: int, *, crash: bool = False) -> str:
        """The mean reward of the last `n` steps against the run's level: '' unless it is down (the
        module's docstring), else what was seen. `crash`: down below (1 − crash_frac) × the level."""
        if self.best_window is None or self.best_window[0] <= 0:
            return ""
        level, level_var, _ = self.best_window
        far = mean < level - self.reward_drop or mean < (1 - self.reward_drop_frac) * level
        if crash:
            far = mean < (1 - self.crash_frac) * level
        z = (level - mean) / math.sqrt(max(_spread(level) / (self.prompts * n) + level_var, 1e-12))
        if not far or z <= self.down_z:
            return ""
        return f"reward {mean:.3g} down from the run's level {level:.3g} ({z:.1f} standard errors)"

    @property
    def healthy(self) -> bool:
        """No bad signal pending and the reward of the last `patience` steps, on average, not down
        from the run's level: a checkpoint saved now is a 'good' one, a rollback target. The reward
        counts because a collapse can run for a few steps before its entropy leaves the band (seen
        in `minirl lab`: reward 0.23 → 0.02 in 2 steps, the entropy past 1.25 × H_0 only 3 steps
        later); a checkpoint in that stretch is no target."""
        down = bool(self.recent) and self._down(sum(self.recent) / len(self.recent), len(self.recent))
        return self.bad_streak == 0 and not down

    def record(self) -> dict:
        """The guard's part of a checkpoint's record: its state, and whether the checkpoint is a good
        one (a rollback target; `export --best` picks only among good ones)."""
        return {"guard": self.state_dict(), "good": self.healthy}

    def restore(self, record: dict) -> None:
        self.load_state_dict(record.get("guard", {}))

    def state_dict(self) -> dict:
        return {"entropy0": self.entropy0, "rollbacks": self.rollbacks, "skipped": self.skipped, "reasons": list(self.reasons),
                "window": list(self.window), "best_window": list(self.best_window) if self.best_window else None,
                "parities": list(self.parities), "parity_bad": self.parity_bad,
                # the streaks and the trend (#80: a resume in the middle of a collapse continues it)
                "bad_streak": self.bad_streak, "skip_streak": self.skip_streak, "recent": list(self.recent),
                "slide": list(self.slide)}

    def load_state_dict(self, d: dict) -> None:
        self.entropy0 = d.get("entropy0")
        self.rollbacks, self.skipped, self.reasons = d.get("rollbacks", 0), d.get("skipped", 0), list(d.get("reasons", []))
        # checkpoints before #64 hold no window: it fills again over the next slide_window steps
        self.window = list(d.get("window", []))
        best = d.get("best_window")  # before #80: (mean, variance) of a full window
        self.best_window = (*best[:2], best[2] if len(best) > 2 else max(self.slide_window, 1)) if best else None
        self.parities, self.parity_bad = list(d.get("parities", [])), d.get("parity_bad", "")  # before #79: none
        self.bad_streak, self.skip_streak = d.get("bad_streak", 0), d.get("skip_streak", 0)  # before #80: none
        self.recent, self.slide = list(d.get("recent", [])), tuple(d.get("slide", (0.0, 0.0)))


def _spread(reward: float) -> float:
    """The most a mean of group means in [0, 1] at `reward` varies, per prompt (Bhatia–Davis)."""
    r = min(max(reward, 0.0), 1.0)
    return r * (1 - r)
