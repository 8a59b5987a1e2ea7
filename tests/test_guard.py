"""The guard's decisions on hand-written metric sequences."""

import math

from minirl.run.guard import Guard

OK = dict(kl=1e-3, entropy=0.3, reward=0.5, loss=1.0, grad_norm=0.5)


def test_healthy_steps_are_applied():
    g = Guard()
    assert [g.decide(**OK).action for _ in range(10)] == ["step"] * 10
    assert g.healthy and g.rollbacks == 0


def test_non_finite_update_is_skipped_without_touching_the_streak():
    g = Guard(patience=1)
    assert g.decide(**{**OK, "loss": math.nan}).action == "skip"
    assert g.decide(**{**OK, "grad_norm": math.inf}, new_step=False).action == "skip"
    assert g.skipped == 2 and g.rollbacks == 0 and g.decide(**OK).action == "step"


def test_high_kl_for_patience_steps_rolls_back_then_stops():
    g = Guard(max_kl=0.05, patience=3, max_rollbacks=1)
    bad = {**OK, "kl": 0.2}
    assert [g.decide(**bad).action for _ in range(3)] == ["step", "step", "rollback"]
    assert g.decide(**bad).reason.startswith("KL(μ‖π_old) 0.2 > 0.05")
    assert not g.healthy  # a checkpoint saved now would not become the rollback target
    assert [g.decide(**bad).action for _ in range(2)] == ["step", "stop"]


def test_a_good_step_resets_the_streak():
    g = Guard(patience=2)
    bad = {**OK, "kl": 1.0}
    assert [g.decide(**x).action for x in (bad, OK, bad, OK, bad)] == ["step"] * 5


def test_entropy_collapse_needs_a_reward_drop_too():
    g = Guard(min_entropy_frac=0.1, reward_drop=0.2, patience=1)
    g.decide(**OK)  # entropy0 = 0.3, best reward 0.5
    sharp_and_good = {**OK, "entropy": 0.01, "reward": 0.9}  # a policy that converged: fine
    assert g.decide(**sharp_and_good).action == "step"
    collapsed = {**OK, "entropy": 0.01, "reward": 0.3}  # low entropy and reward 0.6 below its best
    v = g.decide(**collapsed)
    assert v.action == "rollback" and "entropy" in v.reason


def test_a_disabled_guard_observes_signals_but_still_skips_non_finite_updates():
    """enabled = false (the lab's cells observe collapses): a collapse signal is let through, a
    NaN or inf update is not, and it is counted."""
    g = Guard(enabled=False, patience=1)
    assert [g.decide(**{**OK, "kl": 9.0}).action for _ in range(3)] == ["step"] * 3
    assert g.decide(**{**OK, "kl": 9.0, "loss": math.nan}).action == "skip"
    assert g.decide(**{**OK, "grad_norm": math.inf}, new_step=False).action == "skip"
    assert g.skipped == 2 and g.rollbacks == 0


def test_state_round_trip():
    g = Guard(patience=1)
    g.decide(**OK)
    g.decide(**{**OK, "kl": 1.0})
    h = Guard()
    h.load_state_dict(g.state_dict())
    assert (h.entropy0, h.best_reward, h.rollbacks, h.reasons) == (g.entropy0, g.best_reward, 1, g.reasons)


def test_entropy_rising_out_of_its_band_with_the_reward_gone_rolls_back():
    """The other collapse shape (seen off-policy without clipping in `minirl lab`): the policy
    dissolves, entropy rising, and the reward falls from a low start, where an absolute drop of
    0.2 cannot happen; the relative test (below half of its best) sees it."""
    g = Guard(max_entropy_factor=2.0, reward_drop=0.2, reward_drop_frac=0.5, patience=2)
    g.decide(**{**OK, "entropy": 0.12, "reward": 0.22})  # H_0 = 0.12, best 0.22
    assert g.decide(**{**OK, "entropy": 0.30, "reward": 0.15}).reason == ""  # noisy, but not down by half
    assert g.decide(**{**OK, "entropy": 0.20, "reward": 0.01}).reason == ""  # down, entropy still in its band
    v = g.decide(**{**OK, "entropy": 0.26, "reward": 0.02})
    assert v.action == "step" and v.reason.startswith("entropy 0.26 > 2.0 × 0.12 with reward 0.02 down from 0.22")
    assert g.decide(**{**OK, "entropy": 0.31, "reward": 0.0}).action == "rollback"


def test_high_entropy_alone_and_a_reward_dip_alone_are_not_collapse():
    g = Guard(patience=1)
    g.decide(**{**OK, "entropy": 0.1, "reward": 0.8})
    assert g.decide(**{**OK, "entropy": 0.5, "reward": 0.75}).action == "step"  # exploring, reward held
    assert g.decide(**{**OK, "entropy": 0.1, "reward": 0.1}).action == "step"  # a bad batch, entropy as before


def test_from_settings_takes_the_recipe_section_and_defaults_what_an_old_recipe_lacks():
    from minirl.recipe import GuardConfig

    cfg = GuardConfig(max_entropy_factor=3.0, patience=5, enabled=False)
    g = Guard.from_settings(cfg)
    assert (g.max_entropy_factor, g.patience, g.enabled, g.reward_drop_frac) == (3.0, 5, False, 0.5)
    old = {"max_kl": 0.1, "min_entropy_frac": 0.05, "reward_drop": 0.2, "patience": 3}  # a summary from before
    g = Guard.from_settings(old, enabled=True, max_rollbacks=0)
    assert (g.max_kl, g.max_entropy_factor, g.reward_drop_frac, g.max_rollbacks) == (0.1, 1.25, 0.5, 0)


def test_a_checkpoint_saved_while_the_reward_is_down_is_no_rollback_target():
    """A collapse can run for steps before the entropy leaves its band; the weights of those steps
    must not become the place a rollback returns to. One noisy step does not count: the mean of the
    last `patience` rewards does."""
    g = Guard(patience=3)
    g.decide(**{**OK, "entropy": 0.12, "reward": 0.23})
    assert g.healthy
    g.decide(**{**OK, "entropy": 0.12, "reward": 0.02})  # one step down: mean 0.125 of (0.23, 0.02)
    assert g.healthy
    g.decide(**{**OK, "entropy": 0.12, "reward": 0.02})  # mean 0.09 < half of 0.23, entropy still in band
    assert g.decide(**{**OK, "entropy": 0.12, "reward": 0.03}).reason == "" and not g.healthy
    for r in (0.2, 0.2):
        g.decide(**{**OK, "entropy": 0.12, "reward": r})
    assert g.healthy  # mean of (0.03, 0.2, 0.2) = 0.143: back
