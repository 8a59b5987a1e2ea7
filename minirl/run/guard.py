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
`max_kl`, or the reward down from its best while the entropy has left its band either way:

    below `min_entropy_frac` × H_0   the paper's collapse: the policy freezes onto wrong answers;
    above `max_entropy_factor` × H_0 the other shape, seen in `minirl lab` off-policy without
                                     clipping: the policy dissolves into noise, entropy rising;

where H_0 is the run's first step's entropy, and "down" means below best − `reward_drop` or below
(1 − `reward_drop_frac`) × best (the relative test catches a run that starts and collapses at low
reward, where an absolute drop of 0.2 cannot happen).

A slide the entropy does not show (#64: a reward that fell from 0.47 to 0.10 over 90 steps with a
calm entropy) is bad on its own: the mean reward of the last `slide_window` steps below the best
such window of the run so far by more than `slide_z` standard errors of the difference, and by more
than `slide_drop_frac` of that best. The error is the run's own sampling noise, bounded from the
reward alone: a step's reward is the mean of B prompts' group means, each in [0, 1] with mean r,
so its variance is at most r(1 − r) / B (Bhatia–Davis), and a window's mean's variance at most
Σ r_t(1 − r_t) / (B · W²). Sampling noise is not all of it: a policy wobbles by itself (off-policy
runs without clipping by 0.1 over a few dozen steps at B = 128, where the sampling noise is
small), which the relative floor leaves alone. How the three were chosen (healthy runs never
reach them; a forced slide is caught within a window): docs/runs.md. What was left out: no automatic learning-rate or clip retuning beyond the
`lr_factor` applied at each rollback; the held-out score is not watched (a run measures it at
its start and end unless eval.every is set).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from minirl.recipe import GuardConfig

_SET = GuardConfig()  # the thresholds' defaults, written once: the recipe's [guard] section


@dataclass(frozen=True, slots=True)
class Verdict:
    action: str  # step | skip | rollback | stop
    reason: str = ""


@dataclass
class Guard:
    max_kl: float = _SET.max_kl
    max_kl_per_update_behind: float = _SET.max_kl_per_update_behind
    min_entropy_frac: float = _SET.min_entropy_frac
    max_entropy_factor: float = _SET.max_entropy_factor
    # with the entropy out of its band, the reward must also be `reward_drop` below its best, or
    # below (1 − `reward_drop_frac`) × its best
    reward_drop: float = _SET.reward_drop
    reward_drop_frac: float = _SET.reward_drop_frac
    slide_window: int = _SET.slide_window
    slide_z: float = _SET.slide_z
    slide_drop_frac: float = _SET.slide_drop_frac
    patience: int = _SET.patience
    max_rollbacks: int = _SET.max_rollbacks
    enabled: bool = _SET.enabled
    prompts: int = 1  # B, the prompts a step's reward averages (the slide's noise); 1 is the widest bound
    # state (saved with checkpoints)
    entropy0: float | None = None
    best_reward: float = -math.inf
    bad_streak: int = 0
    recent: list[float] = field(default_factory=list)  # the last `patience` judged steps' rewards
    window: list[float] = field(default_factory=list)  # the last `slide_window` steps' rewards
    best_window: tuple[float, float] | None = None  # (mean, variance of the mean) of the best full window
    slide: tuple[float, float] = (0.0, 0.0)  # the last full window's (z, share of the best lost): what _slide judged
    rollbacks: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    SETTINGS = ("max_kl", "max_kl_per_update_behind", "min_entropy_frac", "max_entropy_factor", "reward_drop",
                "reward_drop_frac", "slide_window", "slide_z", "slide_drop_frac", "patience", "max_rollbacks", "enabled")

    @classmethod
    def from_settings(cls, settings: Mapping, **over) -> Guard:
        """A fresh guard from the recipe's [guard] section (a dict or GuardConfig); keys a recorded
        recipe predates take their defaults."""
        get = settings.get if isinstance(settings, Mapping) else lambda k, d: getattr(settings, k, d)
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(**{**{k: get(k, defaults[k]) for k in cls.SETTINGS}, **over})

    def decide(
        self, *, kl: float, entropy: float, reward: float, loss: float, grad_norm: float, new_step: bool = True,
        lag: float = 0.0,
    ) -> Verdict:
        """The one decision point. Call after backward, before optimizer.step(). The step's signals
        (KL, entropy, reward) are judged once, on its first mini-batch (new_step); every mini-batch's
        update is checked for non-finite values, and skipped when it has any, whether the guard is
        enabled or only observing (`enabled = false`, every lab cell): a NaN in the weights is no
        outcome to observe. `lag`: the batch's mean staleness in updates (rollout.max_staleness ≥ 1):
        the KL that sampling behind adds is allowed, the rest is a mismatch."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped += 1
            return Verdict("skip", f"non-finite update (loss {loss}, grad norm {grad_norm})")
        if not self.enabled or not new_step:
            return Verdict("step")
        if self.entropy0 is None:
            self.entropy0 = entropy
        self.best_reward = max(self.best_reward, reward)
        reason = ""
        down = self._down(reward)
        self.recent = [*self.recent, reward][-self.patience:]
        allowed = self.max_kl + self.max_kl_per_update_behind * lag
        if kl > allowed:
            reason = (f"KL(μ‖π_old) {kl:.3g} > {self.max_kl}" if not lag else
                      f"KL(μ‖π_old) {kl:.3g} > {self.max_kl} + {self.max_kl_per_update_behind} × {lag:.2f} updates "
                      f"of lag: a mismatch beyond what sampling {lag:.2f} updates behind explains "
                      f"(guard.max_kl_per_update_behind, rollout.max_staleness)")
        elif down and entropy < self.min_entropy_frac * self.entropy0:
            reason = (f"entropy {entropy:.3g} < {self.min_entropy_frac} × {self.entropy0:.3g} with reward "
                      f"{reward:.3g} down from {self.best_reward:.3g}")
        elif down and entropy > self.max_entropy_factor * self.entropy0:
            reason = (f"entropy {entropy:.3g} > {self.max_entropy_factor} × {self.entropy0:.3g} with reward "
                      f"{reward:.3g} down from {self.best_reward:.3g}")
        slide = self._slide(reward)
        reason = reason or slide
        self.bad_streak = self.bad_streak + 1 if reason else 0
        if self.bad_streak < self.patience:
            return Verdict("step", reason)
        self.bad_streak = 0
        self.reasons.append(reason)
        if self.rollbacks >= self.max_rollbacks:
            return Verdict("stop", f"{reason}; {self.rollbacks} rollbacks used")
        self.rollbacks += 1
        self.window = []  # the weights go back: the next window is theirs
        return Verdict("rollback", reason)

    def _slide(self, reward: float) -> str:
        """The reward's last `slide_window` steps against the best such window so far: a reason
        when their mean is more than `slide_z` standard errors of the difference below it and more
        than `slide_drop_frac` of it (the module's docstring), else ''."""
        w = self.slide_window
        if not w:
            return ""
        self.window = [*self.window, reward][-w:]
        if len(self.window) < w:
            return ""
        mean = sum(self.window) / w
        var = sum(r * (1 - r) for r in (min(max(x, 0.0), 1.0) for x in self.window)) / (self.prompts * w * w)
        if self.best_window is None or mean > self.best_window[0]:
            self.best_window = (mean, var)
            self.slide = (0.0, 0.0)
            return ""
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

    def _down(self, reward: float) -> bool:
        return reward < self.best_reward - self.reward_drop or reward < (1 - self.reward_drop_frac) * self.best_reward

    @property
    def healthy(self) -> bool:
        """No bad signal pending and the reward of the last `patience` steps, on average, not down
        from its best: a checkpoint saved now is a 'good' one, a rollback target. The reward counts
        because a collapse can run for a few steps before its entropy leaves the band (seen in
        `minirl lab`: reward 0.23 → 0.02 in 2 steps, the entropy past 1.25 × H_0 only 3 steps
        later); a checkpoint in that stretch is no target."""
        down = bool(self.recent) and self._down(sum(self.recent) / len(self.recent))  # one noisy step is no trend
        return self.bad_streak == 0 and not down

    def record(self) -> dict:
        """The guard's part of a checkpoint's record: its state, and whether the checkpoint is a good
        one (a rollback target; `export --best` picks only among good ones)."""
        return {"guard": self.state_dict(), "good": self.healthy}

    def restore(self, record: dict) -> None:
        self.load_state_dict(record.get("guard", {}))

    def state_dict(self) -> dict:
        return {"entropy0": self.entropy0, "best_reward": self.best_reward if math.isfinite(self.best_reward) else None,
                "rollbacks": self.rollbacks, "skipped": self.skipped, "reasons": list(self.reasons),
                "window": list(self.window), "best_window": list(self.best_window) if self.best_window else None}

    def load_state_dict(self, d: dict) -> None:
        self.entropy0 = d.get("entropy0")
        self.best_reward = d["best_reward"] if d.get("best_reward") is not None else -math.inf
        self.rollbacks, self.skipped, self.reasons = d.get("rollbacks", 0), d.get("skipped", 0), list(d.get("reasons", []))
        # checkpoints before #64 hold no window: it fills again over the next slide_window steps
        self.window = list(d.get("window", []))
        self.best_window = tuple(d["best_window"]) if d.get("best_window") else None
