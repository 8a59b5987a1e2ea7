"""The guard's decisions on hand-written metric sequences."""

import math

from minirl.guard import Guard

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


def test_disabled_guard_always_steps():
    g = Guard(enabled=False, patience=1)
    assert g.decide(**{**OK, "kl": 9.0, "loss": math.nan}).action == "step"


def test_state_round_trip():
    g = Guard(patience=1)
    g.decide(**OK)
    g.decide(**{**OK, "kl": 1.0})
    h = Guard()
    h.load_state_dict(g.state_dict())
    assert (h.entropy0, h.best_reward, h.rollbacks, h.reasons) == (g.entropy0, g.best_reward, 1, g.reasons)
