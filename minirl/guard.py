"""Guardrails: one decision per step, taken between the loss and the optimizer step.

The paper's collapses (F1, F3, F4) announce themselves in two signals it tells us to watch:
the training–inference KL D_KL(μ_old ‖ π_old) climbs, and token entropy falls sharply. The guard
reads both, plus the update itself (a non-finite loss or gradient), and answers:

    "step"      apply the optimizer step
    "skip"      drop this update (non-finite loss/grad), nothing else changes
    "rollback"  a signal stayed bad for `patience` steps: restore the last good checkpoint
    "stop"      `max_rollbacks` used up: end the run as "collapsed"

Thresholds are deliberately loose: a healthy run sharpens its policy (on the embedded default the
entropy falls from 0.32 to 0.07 in 300 steps, and KL stays ~1e-3), so "collapse" means entropy
below `min_entropy_frac` of the run's starting entropy *and* reward below its best so far, or KL
above `max_kl`. What was left out: no automatic learning-rate or clip retuning beyond the
`lr_factor` applied at each rollback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Verdict:
    action: str  # step | skip | rollback | stop
    reason: str = ""


@dataclass
class Guard:
    max_kl: float = 0.05
    min_entropy_frac: float = 0.05
    reward_drop: float = 0.2  # with low entropy, reward must also be this far below its best
    patience: int = 3
    max_rollbacks: int = 3
    enabled: bool = True
    # state (saved with checkpoints)
    entropy0: float | None = None
    best_reward: float = -math.inf
    bad_streak: int = 0
    rollbacks: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    def decide(
        self, *, kl: float, entropy: float, reward: float, loss: float, grad_norm: float, new_step: bool = True
    ) -> Verdict:
        """The one decision point. Call after backward, before optimizer.step(). The step's signals
        (KL, entropy, reward) are judged once, on its first mini-batch (new_step); every mini-batch's
        update is checked for non-finite values."""
        if not self.enabled:
            return Verdict("step")
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped += 1
            return Verdict("skip", f"non-finite update (loss {loss}, grad norm {grad_norm})")
        if not new_step:
            return Verdict("step")
        if self.entropy0 is None:
            self.entropy0 = entropy
        self.best_reward = max(self.best_reward, reward)
        reason = ""
        if kl > self.max_kl:
            reason = f"KL(μ‖π_old) {kl:.3g} > {self.max_kl}"
        elif entropy < self.min_entropy_frac * self.entropy0 and reward < self.best_reward - self.reward_drop:
            reason = (f"entropy {entropy:.3g} < {self.min_entropy_frac} × {self.entropy0:.3g} with reward "
                      f"{reward:.3g} down from {self.best_reward:.3g}")
        self.bad_streak = self.bad_streak + 1 if reason else 0
        if self.bad_streak < self.patience:
            return Verdict("step", reason)
        self.bad_streak = 0
        self.reasons.append(reason)
        if self.rollbacks >= self.max_rollbacks:
            return Verdict("stop", f"{reason}; {self.rollbacks} rollbacks used")
        self.rollbacks += 1
        return Verdict("rollback", reason)

    @property
    def healthy(self) -> bool:
        """No bad signal pending: a checkpoint saved now is a 'good' one."""
        return self.bad_streak == 0

    def state_dict(self) -> dict:
        return {"entropy0": self.entropy0, "best_reward": self.best_reward if math.isfinite(self.best_reward) else None,
                "rollbacks": self.rollbacks, "skipped": self.skipped, "reasons": list(self.reasons)}

    def load_state_dict(self, d: dict) -> None:
        self.entropy0 = d.get("entropy0")
        self.best_reward = d["best_reward"] if d.get("best_reward") is not None else -math.inf
        self.rollbacks, self.skipped, self.reasons = d.get("rollbacks", 0), d.get("skipped", 0), list(d.get("reasons", []))
