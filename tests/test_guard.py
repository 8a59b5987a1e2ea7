"""The guard's decisions on hand-written metric sequences."""

import math
from pathlib import Path

from minirl.run.guard import Guard

OK = dict(kl=1e-3, entropy=0.3, reward=0.5, loss=1.0, grad_norm=0.5)


def test_healthy_steps_are_applied():
    g = Guard()
    assert [g.decide(**OK).action for _ in range(10)] == ["step"] * 10
    assert g.healthy and g.rollbacks == 0


def test_non_finite_update_is_skipped_without_touching_the_streak():
    g = Guard(patience=3)
    assert g.decide(**{**OK, "loss": math.nan}).action == "skip"
    assert g.decide(**{**OK, "grad_norm": math.inf}, new_step=False).action == "skip"
    assert g.skipped == 2 and g.rollbacks == 0 and g.decide(**OK).action == "step" and g.bad_streak == 0
    assert g.decide(**{**OK, "loss": math.nan}).action == "skip"  # a finite update in between: counted anew


def test_a_nan_update_every_step_stops_the_run_never_finishing_on_nothing():
    """#80: 50 of 50 steps skipped, 0 rollbacks, "finished". Now `patience` non-finite updates in a
    row act as a bad streak does, and go on acting after each rollback: a named stop within
    patience + max_rollbacks steps. A guard that only observes (the lab) still only skips."""
    g = Guard(patience=3, max_rollbacks=3)
    got = [g.decide(**{**OK, "loss": math.nan}).action for _ in range(6)]
    assert got == ["skip", "skip", "rollback", "rollback", "rollback", "stop"]
    assert "non-finite update (loss nan" in g.reasons[0] and "3 updates in a row" in g.reasons[0]
    g = Guard(patience=3, enabled=False)
    assert {g.decide(**{**OK, "loss": math.nan}).action for _ in range(10)} == {"skip"}


def test_a_non_finite_signal_is_a_bad_step_and_a_nan_first_entropy_waits_for_a_finite_one():
    """#80: a NaN KL or entropy compared False with every threshold, so it never counted, and a NaN
    first entropy turned both entropy rules off for the whole run."""
    g = Guard(patience=2)
    assert [g.decide(**{**OK, "kl": math.nan}).action for _ in range(2)] == ["step", "rollback"]
    assert "non-finite signal (KL(μ‖π_old) nan" in g.reasons[-1]
    g = Guard(min_entropy_frac=0.1, reward_drop=0.2, patience=1, prompts=32)
    assert g.decide(**{**OK, "entropy": math.nan}).reason.startswith("a non-finite signal")
    assert g.entropy0 is None
    g.decide(**OK)
    assert g.entropy0 == 0.3  # the first finite one
    v = g.decide(**{**OK, "entropy": 0.01, "reward": 0.1})
    assert v.action == "rollback" and v.reason.startswith("entropy 0.01 < 0.1 × 0.3")
    g = Guard(patience=5)
    g.decide(**{**OK, "reward": math.nan})
    assert g.best_window is None and not g.recent and not g.window  # a NaN reward is no level, no trend


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
    g = Guard(min_entropy_frac=0.1, reward_drop=0.2, patience=1, prompts=32)
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
    assert (h.entropy0, h.best_window, h.rollbacks, h.reasons) == (g.entropy0, g.best_window, 1, g.reasons)
    # #80: a checkpoint saved with a bad streak pending carries it, and the trend behind `healthy`
    g = Guard(patience=3)
    g.decide(**OK)
    g.decide(**{**OK, "kl": 1.0})
    g.decide(**{**OK, "loss": math.nan})
    h = Guard(patience=3)
    h.load_state_dict(g.state_dict())
    assert (h.bad_streak, h.skip_streak, h.recent, h.slide) == (1, 1, g.recent, g.slide) and not h.healthy
    assert h.decide(**{**OK, "kl": 1.0}).action == "step" and h.decide(**{**OK, "kl": 1.0}).action == "rollback"


def test_entropy_rising_out_of_its_band_with_the_reward_gone_rolls_back():
    """The other collapse shape (seen off-policy without clipping in `minirl lab`): the policy
    dissolves, entropy rising, and the reward falls from a low level, where an absolute drop of
    0.2 cannot happen; the relative test (below half of the level) sees it."""
    # (the crash rule off: it would count the steps at 0.01 and 0 without the entropy)
    g = Guard(max_entropy_factor=2.0, reward_drop=0.2, reward_drop_frac=0.5, patience=2, prompts=32, crash_frac=1.0)
    for _ in range(10):
        g.decide(**{**OK, "entropy": 0.12, "reward": 0.22})  # H_0 = 0.12, the level 0.22
    assert g.decide(**{**OK, "entropy": 0.30, "reward": 0.15}).reason == ""  # noisy, but not down by half
    v = g.decide(**{**OK, "entropy": 0.26, "reward": 0.02})
    assert v.action == "step" and v.reason.startswith("entropy 0.26 > 2.0 × 0.12 with reward 0.02 down from the "
                                                      "run's level 0.22")
    assert g.decide(**{**OK, "entropy": 0.20, "reward": 0.01}).reason == ""  # down, the entropy back in its band
    assert g.decide(**{**OK, "entropy": 0.31, "reward": 0.0}).action == "step"
    assert g.decide(**{**OK, "entropy": 0.31, "reward": 0.0}).action == "rollback"


def test_high_entropy_alone_and_a_reward_dip_alone_are_not_collapse():
    g = Guard(patience=1)
    g.decide(**{**OK, "entropy": 0.1, "reward": 0.8})
    assert g.decide(**{**OK, "entropy": 0.5, "reward": 0.75}).action == "step"  # exploring, reward held
    assert g.decide(**{**OK, "entropy": 0.1, "reward": 0.1}).action == "step"  # a bad batch, entropy as before


def test_from_settings_takes_the_recipe_section_and_defaults_what_an_old_recipe_lacks():
    from minirl.config.recipe import GuardConfig

    cfg = GuardConfig(max_entropy_factor=3.0, patience=5, enabled=False)
    g = Guard.from_settings(cfg)
    assert (g.max_entropy_factor, g.patience, g.enabled, g.reward_drop_frac) == (3.0, 5, False, 0.5)
    old = {"max_kl": 0.1, "min_entropy_frac": 0.05, "reward_drop": 0.2, "patience": 3}  # a summary from before
    g = Guard.from_settings(old, enabled=True, max_rollbacks=0)
    assert (g.max_kl, g.max_entropy_factor, g.reward_drop_frac, g.max_rollbacks) == (0.1, 1.25, 0.5, 0)


def test_a_checkpoint_saved_while_the_reward_is_down_is_no_rollback_target():
    """A collapse can run for steps before the entropy leaves its band; the weights of those steps
    must not become the place a rollback returns to. A noisy step does not count: the mean of the
    last `patience` rewards against the run's level does (the crash rule off here: it counts the step
    at 0.02 as bad on its own, which no target survives either)."""
    g = Guard(patience=3, prompts=32, crash_frac=1.0)
    for _ in range(10):
        g.decide(**{**OK, "entropy": 0.12, "reward": 0.23})
    g.decide(**{**OK, "entropy": 0.12, "reward": 0.12})  # a noisy step: not down by half, nor by 0.2
    assert g.healthy
    g.decide(**{**OK, "entropy": 0.12, "reward": 0.02})  # (0.23, 0.12, 0.02): 0.123, not below half of 0.23
    assert g.healthy
    g.decide(**{**OK, "entropy": 0.12, "reward": 0.03})  # 0.057, 3.5 standard errors below: no target
    assert not g.healthy and g.bad_streak == 0  # the entropy is calm: no bad step
    for r in (0.2, 0.2, 0.2):
        g.decide(**{**OK, "entropy": 0.12, "reward": r})
    assert g.healthy and g.rollbacks == 0  # back at its level


def _rewards(path, *, prompts=32, group=8, seed=0):
    """Step rewards as a run logs them: the mean of B prompts' group means, each prompt with its own
    success probability around the step's level (a Beta spread) and G Bernoulli samples."""
    import random

    rng = random.Random(seed)
    out = []
    for p in path:
        total = 0.0
        for _ in range(prompts):
            q = rng.betavariate(1 + 4 * p, 1 + 4 * (1 - p))  # prompts differ: some easy, some hard
            total += sum(rng.random() < q for _ in range(group)) / group
        out.append(total / prompts)
    return out


def _first_action(g, rewards, **signals):
    for i, r in enumerate(rewards, 1):
        v = g.decide(**{**OK, **signals, "reward": r})
        if v.action in ("rollback", "stop"):
            return i, v.reason
    return None, ""


def test_a_reward_slide_with_a_calm_entropy_is_rolled_back():
    """#64: the reward leaves its best `slide_window`-step mean by more than `slide_z` standard
    errors (its own sampling noise, bounded from the reward and B) and by more than a quarter of it,
    and the entropy never moves: an abrupt fall is acted on within the window and the patience
    (16–20 steps over 20 seeds), the slide of the issue (0.47 → 0.10 over 90 steps) within 80 steps
    (58–70: once it has lost about half); today's rules alone never act."""
    rise = [0.3 + 0.17 * i / 100 for i in range(100)]  # learns to 0.47
    for seed in range(5):
        abrupt = _rewards(rise + [0.1] * 60, seed=seed)
        at, reason = _first_action(Guard(prompts=32), abrupt)
        assert at is not None and 100 < at <= 100 + Guard().slide_window + Guard().patience, (seed, at)
        assert reason.startswith("reward slid: the last 30 steps' mean") and "below the best 30-step mean" in reason
        slow = _rewards(rise + [0.47 - 0.37 * i / 90 for i in range(90)] + [0.1] * 30, seed=seed)
        at, _ = _first_action(Guard(prompts=32), slow)
        assert at is not None and 100 < at <= 180, (seed, at)
        assert _first_action(Guard(prompts=32, slide_window=0), slow) == (None, "")  # the entropy is calm


def test_healthy_learning_and_its_noise_never_trip_the_slide_rule():
    """A run that learns (0.3 → 0.8 over 300 steps), one that stays flat, and one that plateaus
    after learning, each with its sampling noise at B = 32 × G = 8: no slide over 20 seeds each."""
    curves = {"learns": [0.3 + 0.5 * (1 - math.exp(-i / 80)) for i in range(300)], "flat": [0.4] * 300,
              "plateau": [min(0.8, 0.3 + i / 200) for i in range(300)]}
    for name, curve in curves.items():
        for seed in range(20):
            assert _first_action(Guard(prompts=32), _rewards(curve, seed=seed)) == (None, ""), (name, seed)


def test_the_slide_window_travels_with_checkpoints_and_restarts_after_a_rollback():
    g = Guard(prompts=32, slide_window=5, patience=1)
    for r in (0.5, 0.6, 0.7, 0.7, 0.7, 0.7):
        g.decide(**{**OK, "reward": r})
    h = Guard(prompts=32, slide_window=5, patience=1, crash_frac=1.0)  # a fall to 0 is a crash too: the slide's test
    h.load_state_dict(g.state_dict())
    assert h.window == g.window and h.best_window == g.best_window
    assert Guard(prompts=32).load_state_dict({"best_reward": 0.5}) is None  # a checkpoint from before #64 loads
    at, reason = _first_action(h, [0.0] * 10)
    assert at is not None and reason.startswith("reward slid") and h.window == []  # the next window is the restored weights'


def test_the_slide_rule_is_well_defined_at_zero_reward():
    """#75: rewards of 0 from the start (an ordinary start on a hard task) divided by the best
    window's mean, 0: a ZeroDivisionError killed the run. No window has earned anything: no slide."""
    for window in (1, 3, 30):
        g = Guard(prompts=8, slide_window=window)
        got = [g.decide(**{**OK, "reward": 0.0}).action for _ in range(40)]
        assert got == ["step"] * 40 and g.slide == (0.0, 0.0)
    g = Guard(prompts=8, slide_window=2)  # negative rewards (a graded penalty) neither
    assert [g.decide(**{**OK, "reward": -0.5}).action for _ in range(5)] == ["step"] * 5


def test_at_k_behind_the_guard_allows_the_lag_and_still_acts_on_a_mismatch():
    """#74: KL(μ‖π_old) includes the policy's own move over the updates a batch was sampled behind;
    on the default at k = 2 healthy steps read 0.11–0.24 and a max_kl of 0.05 rolled them back. The
    threshold grows by `max_kl_per_update_behind` per update of the batch's mean lag; beyond it, the
    reason says it is a mismatch the lag does not explain."""
    g = Guard()
    healthy = [(0.183, 1.0), (0.243, 2.0), (0.35, 4.0), (0.398, 4.0), (0.31, 4.0)]  # measured: docs/async.md
    assert [g.decide(**{**OK, "kl": kl}, lag=lag).action for kl, lag in healthy * 3] == ["step"] * 15
    g = Guard()
    got = [g.decide(**{**OK, "kl": 0.6}, lag=2.0) for _ in range(3)]
    assert [v.action for v in got] == ["step", "step", "rollback"]
    assert got[-1].reason == ("KL(μ‖π_old) 0.6 > 0.05 + 0.15 × 2.00 updates of lag: a mismatch beyond what sampling "
                              "2.00 updates behind explains (guard.max_kl_per_update_behind, rollout.max_staleness)")
    assert Guard().decide(**{**OK, "kl": 0.2}).reason == "KL(μ‖π_old) 0.2 > 0.05"  # synchronous: as before


# #79: parity checks of healthy seeded runs of the embedded default (seed 0, 300 steps, every 10th;
# this repository's runs on an AMX host): a bf16 one at k = 0 and an FP8 one at k = 0
BF16_K0 = [0.0089, 0.0098, 0.0134, 0.0185, 0.0072, 0.0177, 0.0113, 0.0102, 0.02, 0.0133, 0.011, 0.014, 0.0139,
           0.0103, 0.03, 0.0124, 0.0138, 0.0118, 0.0178, 0.0126, 0.0184, 0.0115, 0.0108, 0.0122, 0.0162, 0.0094,
           0.0106, 0.0133, 0.0064, 0.0094, 0.0083]
# the embedded default's bf16 run on an H200 (2026-11-28 GPU visit, `../shared/gpu-visits/`): a 3.1× spike at step 150
H200_BF16 = [0.0162, 0.0171, 0.0141, 0.0405, 0.0174, 0.0147, 0.0115, 0.0213, 0.0169, 0.0181, 0.0232, 0.0243, 0.0246,
             0.0229, 0.0255, 0.0563, 0.0299, 0.0201, 0.0194, 0.0153, 0.0262, 0.0222, 0.0266, 0.0302, 0.0272, 0.0244,
             0.0371, 0.0269, 0.0264, 0.0244, 0.0287]
FP8_K0 = [0.0546, 0.0608, 0.0407, 0.0414, 0.0463, 0.0389, 0.04, 0.0349, 0.0537, 0.0706, 0.0283, 0.0475, 0.039,
          0.0415, 0.0448, 0.0486, 0.0571, 0.0584, 0.0409, 0.0301, 0.0544, 0.0488, 0.0618, 0.0433, 0.0585, 0.0474,
          0.0667, 0.0703, 0.0607, 0.049, 0.0555]


def _parity_run(g: Guard, parities) -> list[str]:
    """A step's decision after each parity check (the loop: parity after the sync, judged next step)."""
    out = []
    for p in parities:
        g.observe_parity(p)
        out.append(g.decide(**OK).action)
    return out


def test_a_healthy_runs_parity_wobble_is_never_a_bad_step():
    for trace in (BF16_K0, FP8_K0, H200_BF16):
        g = Guard()
        assert _parity_run(g, trace) == ["step"] * len(trace) and not g.parity_due and g.healthy


def test_a_parity_that_leaves_the_runs_own_level_is_checked_again_and_rolled_back():
    """#79: an engine whose numerics moved away from the trainer's (the CPU MoE kernel's stale
    prepack took 1.25e-3 to 3e-2, 24×) while KL and entropy stay calm: bad, due again at the next
    step, and after `patience` bad checks a rollback (which syncs every weight again)."""
    g = Guard(patience=3)
    assert _parity_run(g, BF16_K0[:10]) == ["step"] * 10
    assert _parity_run(g, [0.2]) == ["step"] and g.parity_due and not g.healthy
    assert g.decide(**OK).reason.startswith("parity 0.2 > 6 × 0.0") and g.bad_streak == 2
    g = Guard(patience=2)
    _parity_run(g, BF16_K0[:10])
    assert _parity_run(g, [0.2, 0.011]) == ["step", "step"] and not g.parity_due  # back at its level: good
    assert _parity_run(g, [0.2, 0.2]) == ["step", "rollback"]
    assert "the engine has moved away from the trainer" in g.reasons[-1]


def test_a_first_parity_above_the_cap_is_bad_and_tiny_gaps_never_are():
    g = Guard(patience=1)
    assert _parity_run(g, [0.6]) == ["rollback"] and "parity 0.6 > 0.5" in g.reasons[-1]
    g = Guard(patience=1)  # fp32: a gap at float noise may double; below parity_floor it is no mismatch
    assert _parity_run(g, [4.7e-7, 4.6e-7, 4.7e-7, 5e-6, 2e-5]) == ["step"] * 5


def test_a_mismatch_in_the_tokens_the_trained_weights_sampled_has_no_lag_allowance():
    """k ≥ 1 with in-flight updates: the batch's tokens sampled by the trained weights themselves
    carry no lag, so their KL is held to max_kl while the whole batch's gets its allowance."""
    g = Guard(max_kl=0.05, patience=1)
    assert g.decide(**{**OK, "kl": 0.2}, lag=1.5, kl_fresh=0.01).action == "step"  # the lag explains it
    v = g.decide(**{**OK, "kl": 0.2}, lag=1.5, kl_fresh=0.08)
    assert v.action == "rollback" and "over the tokens the trained weights sampled themselves" in v.reason


def test_the_parity_reference_travels_with_checkpoints():
    g = Guard()
    _parity_run(g, [*FP8_K0[:5], 0.9])
    h = Guard()
    h.load_state_dict(g.state_dict())
    assert h.parities == FP8_K0[:5] and h.parity_due and h.parity_bad == g.parity_bad
    old = g.state_dict()
    del old["parities"], old["parity_bad"]  # a checkpoint from before #79
    h.load_state_dict(old)
    assert h.parities == [] and not h.parity_due


def test_the_guard_replayed_on_recorded_rows_decides_as_the_run_did(tmp_path):
    """#80: `minirl guard ROWS` replays a run's rows through the real guard. On rows where the KL
    left its bound from step 4 (what the skew fault makes) it rolls back at step 6, as a run with
    patience 3 did (and again at 9); with --set guard.patience=5 at step 8; a torn last line (a kill mid-write) is
    left out; a setting outside [guard] is refused in one line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from minirl.errors import UsageError
    from minirl.run import guard_replay

    row = {"train/entropy": 0.3, "rollout/reward_mean": 0.5, "train/loss": 1.0, "train/grad_norm": 0.5}
    rows = [{"step": s, **row, "train/kl_mu_pi_old": 0.001 if s < 4 else 0.3} for s in range(1, 11)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "train/k')
    got = guard_replay.replay(*guard_replay.load(run, []))
    assert [d["decision"] for d in got][:6] == ["step"] * 5 + ["rollback"] and len(got) == 10
    assert got[3]["reason"].startswith("KL(μ‖π_old) 0.3 > 0.05")
    got = guard_replay.replay(*guard_replay.load(run / "metrics.jsonl", ["guard.patience=5"]))
    assert [d["step"] for d in got if d["decision"] == "rollback"] == [8]
    with pytest.raises(UsageError, match="only guard"):
        guard_replay.load(run, ["train.lr=1"])
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "cli.main", "guard", str(run), "--json"], cwd=root, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["step"] for x in lines if x["decision"] == "rollback"] == [6, 9] and set(lines[0]) == {"step", "decision", "reason"}


# #80: traces that look like real tasks. A step's reward is the mean over B = 32 prompts of G = 8
# samples each, the prompts' success rates spread around the step's level (Beta with mean p and
# concentration 2: a step's reward then varies by sd 0.01–0.06, as real tasks' do); the entropy
# drifts away from its first step by up to ±40% over the run, as healthy runs' does.
def _task_rewards(path, *, seed, prompts=32, group=8, concentration=2.0):
    import numpy as np

    rng = np.random.default_rng(seed)
    p = np.clip(np.asarray(path, dtype=float)[:, None], 1e-3, 1 - 1e-3)
    q = rng.beta(concentration * p, concentration * (1 - p), size=(len(path), prompts))
    return (rng.binomial(group, q) / group).mean(axis=1).tolist()


def _drifting_entropy(n, *, seed, first=0.3, drift=0.4):
    import numpy as np

    rng = np.random.default_rng(10_000 + seed)
    sign = 1 if seed % 2 else -1
    return (first * (1 + sign * drift * np.minimum(1, np.arange(n) / 150) + rng.normal(0, 0.03, n) * (np.arange(n) > 0))).tolist()


def _acts(g, rewards, entropy, kl=None):
    """The first step (1-based) the guard rolls back or stops at, and why; (None, '') if never."""
    for i, (r, h) in enumerate(zip(rewards, entropy), 1):
        v = g.decide(**{**OK, "reward": r, "entropy": h, "kl": kl[i - 1] if kl else 1e-3})
        if v.action in ("rollback", "stop"):
            return i, v.reason
    return None, ""


HEALTHY = {**{f"plateau {p}": [p] * 400 for p in (0.02, 0.05, 0.15, 0.3, 0.5, 0.9)},
           "slow climb 0.02 → 0.2": [0.02 + 0.18 * i / 400 for i in range(400)],
           "slow climb 0.1 → 0.5": [0.1 + 0.4 * i / 400 for i in range(400)]}


def test_healthy_runs_on_hard_tasks_are_never_rolled_back():
    """#80: judged against its best single step, a healthy plateau at 0.15 with its entropy 30% above
    the first step's was rolled back on 20 of 20 seeds. Against the run's level (its best 30-step
    mean) and its standard error: no rollback on any healthy trace, over 20 seeds each, entropy
    drifting up and down by 40%, and every checkpoint past the first window a good one."""
    for name, path in HEALTHY.items():
        for seed in range(20):
            g = Guard(prompts=32)
            rewards, entropy = _task_rewards(path, seed=seed), _drifting_entropy(len(path), seed=seed)
            assert _acts(g, rewards, entropy) == (None, ""), (name, seed)
            assert g.healthy, (name, seed)
    # smaller batches of prompts that are mostly all-or-nothing (concentration 0.5): steps far noisier,
    # the crash rule (a step below a quarter of the level, beyond its noise) must not mistake them
    for level in (0.05, 0.1, 0.2, 0.3, 0.5):
        for seed in range(20):
            rewards = _task_rewards([level] * 400, seed=seed, prompts=16, concentration=0.5)
            assert _acts(Guard(prompts=16), rewards, _drifting_entropy(400, seed=seed)) == (None, ""), (level, seed)


def _collapse(lead, fall, *, seed, entropy_from=None, entropy_to=None):
    """A healthy stretch at `lead`, then the reward along `fall`; the entropy drifts as a healthy run's
    until `entropy_from` steps into the fall, then goes to `entropy_to` × the first step's."""
    rewards = _task_rewards([lead] * 120 + fall, seed=seed)
    entropy = _drifting_entropy(len(rewards), seed=seed, drift=0.2)
    if entropy_from is not None:
        for i in range(120 + entropy_from, len(rewards)):
            entropy[i] = entropy[0] * entropy_to
    return rewards, entropy


def test_the_collapses_the_lab_recorded_are_caught_within_patience_plus_two_steps_of_the_fall():
    """#80: the shapes `minirl lab` recorded, after 120 healthy steps, on 20 seeds each: acted on
    within `patience` + 2 steps of the fall's first step (121). The lab's 0.23 → 0.02 in 2 steps with
    the entropy past its band only 3 steps later: without the crash rule (a step below a quarter of
    the level, beyond its noise) it was acted on at 127, 7 steps after the fall, once the entropy
    showed it; now at 124. The policy dissolving (entropy ×3, reward 0.5 → 0.05); the paper's freeze
    (entropy to 2% of its first, reward 0.6 → 0.2); a KL spike. A fall to half the level without the
    entropy is left to the slide rule: real runs dip there and come back (docs/runs.md)."""
    p = Guard().patience
    shapes = {
        "0.23 → 0.02 in 2 steps": dict(lead=0.23, fall=[0.12] + [0.02] * 30, entropy_from=4, entropy_to=1.5),
        "dissolving": dict(lead=0.5, fall=[0.3, 0.15] + [0.05] * 30, entropy_from=0, entropy_to=3.0),
        "freezing": dict(lead=0.6, fall=[0.4] + [0.2] * 30, entropy_from=1, entropy_to=0.02),
    }
    for name, shape in shapes.items():
        for seed in range(20):
            at, reason = _acts(Guard(prompts=32), *_collapse(**shape, seed=seed))
            assert at is not None and 121 <= at <= 121 + p + 2, (name, seed, at, reason)
    at, reason = _acts(Guard(prompts=32, crash_frac=1.0), *_collapse(**shapes["0.23 → 0.02 in 2 steps"], seed=0))
    assert at == 127 and reason.startswith("entropy"), (at, reason)  # what the entropy alone saw
    for seed in range(20):
        rewards, entropy = _collapse(0.4, [0.4] * 30, seed=seed)
        at, reason = _acts(Guard(prompts=32), rewards, entropy, kl=[1e-3] * 120 + [0.3] * 30)
        assert at == 120 + p and reason.startswith("KL(μ‖π_old) 0.3"), (seed, at)


def test_a_fall_one_step_cannot_tell_from_noise_is_left_to_the_slide_rule():
    """At a level of 0.05 and B = 32 a step at 0 is within 2 standard errors of it: no step is down,
    and the slide rule acts once the window's fall is beyond its noise (within slide_window + patience)."""
    g = Guard()
    for seed in range(20):
        at, reason = _acts(Guard(prompts=32), *_collapse(0.05, [0.0] * 60, seed=seed))
        assert at is not None and 120 < at <= 120 + g.slide_window + g.patience and reason.startswith("reward slid"), (seed, at)


def test_a_rollback_re_anchors_the_level_at_the_restored_weights():
    """`best_reward` was never reset at a rollback, so a run restored below its best rolled back
    again and again, its learning rate halved each time. The level starts again from the restored
    weights' rewards."""
    g = Guard(prompts=32, patience=2)
    _acts(g, [0.6] * 40, [0.3] * 40)
    assert g.best_window[0] == 0.6
    assert _acts(g, [0.1, 0.1], [0.3, 0.3], kl=[0.9, 0.9])[0] == 2 and g.best_window is None
    assert _acts(g, [0.25] * 100, [0.3] * 100) == (None, "") and g.best_window[0] == 0.25 and g.healthy


def test_the_guard_replayed_on_real_runs_acts_where_they_slid_and_no_longer_where_they_were_healthy():
    """#80: rows of real runs (tests/data/guard: the FP8 anchor study of #79 on `b0a2fe3`, 300 steps,
    the columns the guard reads). Two slid and were rolled back by the slide rule at steps 82 and 187:
    the replay acts there too, for the same reason. A healthy bf16 run: nothing. One was rolled
    back at step 10 by the old entropy rule against its best single step (the reward 0.08–0.19 in
    steps 6–10 against its first step's 0.38, the entropy 1.3–1.45× its first, on the scratchpad at
    B = 16): against the run's level and its noise (one step of 0.38 at B = 16 is a level known to
    ±0.12), no step of it is bad. Whether it would have come back without the rollback (it did after
    it, at half the learning rate) the run cannot say."""
    from minirl.run import guard_replay

    data = Path(__file__).resolve().parent / "data" / "guard"

    def acts(name):
        return [(d["step"], d["reason"]) for d in guard_replay.replay(*guard_replay.load(data / name, []))
                if d["decision"] in ("rollback", "stop")]

    for name, step in (("scratchpad-fp8-k2-proximal-slide", 82), ("default-fp8-k2-mask-slide", 187)):
        recorded = [m["step"] for m in _rows(data / name) if m.get("guard/action") == "rollback"]
        assert recorded == [step] and [s for s, _ in acts(name)] == [step], name
        assert acts(name)[0][1].startswith("reward slid")
    assert acts("default-bf16-k0-healthy") == []
    early = data / "scratchpad-fp8-k2-mask-early"
    assert [m["step"] for m in _rows(early) if m.get("guard/action") == "rollback"] == [10]
    replayed = guard_replay.replay(*guard_replay.load(early, []))
    assert all(d["reason"] == "" for d in replayed[:10]) and acts(early.name) == []


def _rows(run):
    import json

    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_rows_nonfinite_values_are_strict_json_and_read_back_as_they_were(tmp_path):
    """#82: a poisoned step's NaN went into metrics.jsonl bare (no other JSON reader takes it):
    written as null and named, read back as it was by every reader of the rows (`minirl guard`'s
    among them)."""
    import json
    import math

    import pytest

    from minirl.disk.store import metric_line, metric_rows

    rows = [{"step": 1, "train/loss": 0.5}, {"step": 2, "train/loss": math.nan, "train/grad_norm": math.inf,
                                               "rollout/staleness_tokens": [1.0, -math.inf]}]
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(metric_line(r) + "\n" for r in rows))
    strict = [json.loads(x, parse_constant=lambda c: pytest.fail(f"bare {c}")) for x in f.read_text().splitlines()]
    assert strict[1]["nonfinite"] == {"rollout/staleness_tokens": "nested", "train/grad_norm": "inf", "train/loss": "nan"}
    back = metric_rows(f)
    assert math.isnan(back[1]["train/loss"]) and back[1]["train/grad_norm"] == math.inf and "nonfinite" not in back[1]
    assert back[1]["rollout/staleness_tokens"] == [1.0, None] and back[0] == rows[0]


def test_the_guard_on_any_row_file_answers_or_refuses_in_one_line(tmp_path):
    """#99: rows whose signals are null (how a run's strict JSON writes a non-finite one) are decided on, a
    null a bad signal; bytes that are not UTF-8, a signal that is a list and a step that is not a number are
    one line naming the file (and line), never a traceback."""
    import json
    import re
    import subprocess
    import sys

    import pytest

    from minirl.errors import UsageError
    from minirl.run import guard_replay
    from tests.conftest import ROOT

    good = {"train/kl_mu_pi_old": 0.001, "train/entropy": 1.0, "rollout/reward_mean": 0.5, "train/loss": 0.1,
            "train/grad_norm": 1.0}
    rows = [{"step": s, **good} for s in range(1, 5)] + [{"step": 5, **good, "train/kl_mu_pi_old": None}]
    path = tmp_path / "nulls.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = guard_replay.replay(*guard_replay.load(path, []))
    assert [d["decision"] for d in got][:4] == ["step"] * 4 and "kl" in got[4]["reason"].lower(), got[4]

    bad = {"bytes.jsonl": b'{"step": 1}\n\xff\xfe{"step": 2}\n',
           "list.jsonl": (json.dumps({"step": 1, **good, "train/entropy": [1.0, 2.0]}) + "\n").encode(),
           "step.jsonl": (json.dumps({"step": "one", **good}) + "\n").encode()}
    said = {"bytes.jsonl": "not UTF-8 text", "list.jsonl": ":1: train/entropy = [1.0, 2.0] is not a number",
            "step.jsonl": ":1: step = 'one' is not a whole number"}
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UsageError, match=re.escape(said[name])):
            guard_replay.load(tmp_path / name, [])
    r = subprocess.run([sys.executable, "-m", "cli.main", "guard", str(tmp_path / "bytes.jsonl")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "not UTF-8 text" in lines[0], r.stderr[-2000:]
