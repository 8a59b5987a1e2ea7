"""The MiniRL objective on hand-written tensors, with hand-computed values."""

import math

import pytest
import torch

from minirl.train import objective as O

LN = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_group_advantages_mean_baseline_and_std():
    r = t([[1, 0, 0, 1], [1, 1, 1, 1]])
    assert torch.allclose(O.group_advantages(r), t([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]))
    # std of {1,0,0,1} (population) is 0.5 -> ±1; an all-equal group stays 0
    assert torch.allclose(O.group_advantages(r, std_scale=True), t([[1, -1, -1, 1], [0, 0, 0, 0]]), atol=1e-5)


def test_is_weight_truncate_mask_off():
    logp = torch.log(t([[0.5, 0.9, 0.3]]))
    mu = torch.log(t([[0.25, 0.1, 0.3]]))  # ratios 2, 9, 1
    assert torch.allclose(O.is_weight(logp, mu, cap=5.0, mode="truncate"), t([[2, 5, 1]]))
    assert torch.allclose(O.is_weight(logp, mu, cap=5.0, mode="mask"), t([[2, 0, 1]]))
    assert torch.equal(O.is_weight(logp, mu, mode="off"), torch.ones(1, 3))
    logp.requires_grad_(True)
    assert not O.is_weight(logp, mu).requires_grad  # stop-gradient


def test_is_weight_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown IS mode"):
        O.is_weight(t([[0.0]]), t([[0.0]]), mode="clip")


@pytest.mark.parametrize(
    "adv, ratio, expected",
    [
        (1.0, 1.30, 0.0),  # A > 0, r > 1 + ε_high -> masked
        (1.0, 1.20, 1.0),  # A > 0, r inside -> kept
        (1.0, 0.50, 1.0),  # A > 0, r small -> kept (no lower clip for positive A)
        (-1.0, 0.75, 0.0),  # A < 0, r < 1 - ε_low -> masked
        (-1.0, 0.85, 1.0),  # A < 0, r inside -> kept
        (-1.0, 2.00, 1.0),  # A < 0, r large -> kept (no upper clip for negative A)
        (0.0, 3.00, 1.0),  # A = 0 never masked
    ],
)
def test_clip_mask_truth_table(adv, ratio, expected):
    old = t([[LN(0.5)]])
    new = old + LN(ratio)
    assert O.clip_mask(new, old, t([adv]), eps_low=0.2, eps_high=0.27).item() == expected


def test_aggregate_sum_per_response_then_mean_vs_length_norm():
    tok = t([[1, 2, 3, 0], [4, 0, 0, 0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert O.aggregate(tok, mask).item() == pytest.approx((6 + 4) / 2)
    assert O.aggregate(tok, mask, length_norm=True).item() == pytest.approx((6 / 3 + 4 / 1) / 2)


def test_minirl_loss_value_by_hand():
    # Two responses, two tokens each; on-policy staleness (logp == old) so M = 1.
    logp = torch.log(t([[0.5, 0.5], [0.25, 0.8]])).requires_grad_(True)
    old = logp.detach().clone()
    mu = torch.log(t([[0.25, 0.5], [0.25, 0.1]]))  # w = [2, 1], [1, 8 -> cap 5]
    adv = t([1.0, -0.5])
    mask = torch.ones(2, 2)
    loss, m = O.minirl_loss(logp, old, mu, adv, mask)
    lp = logp.detach()
    expected = -((2 * 1 * lp[0, 0] + 1 * 1 * lp[0, 1]) + (1 * -0.5 * lp[1, 0] + 5 * -0.5 * lp[1, 1])) / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert m["loss/clip_frac"] == 0.0
    assert m["loss/is_weight_max"] == pytest.approx(8.0, rel=1e-5)
    loss.backward()
    # d/d logp of −(1/B)·w·A·logp = −w·A/B (weights are constants)
    assert torch.allclose(logp.grad, t([[-1.0, -0.5], [0.25, 1.25]]), atol=1e-6)


def test_padding_contributes_nothing():
    logp = torch.log(t([[0.5, 0.4, 0.9]])).requires_grad_(True)
    mu = logp.detach().clone()
    adv = t([1.0])
    base, _ = O.minirl_loss(logp[:, :2], mu[:, :2], mu[:, :2], adv, torch.ones(1, 2))
    padded, _ = O.minirl_loss(logp, mu, mu, adv, t([[1, 1, 0]]))
    assert padded.item() == pytest.approx(base.item())
    padded.backward()
    assert logp.grad[0, 2].item() == 0.0


def test_non_finite_rollout_logp_is_dropped():
    logp = torch.log(t([[0.5, 0.5]]))
    mu = t([[math.log(0.5), float("-inf")]])
    loss, m = O.minirl_loss(logp, logp, mu, t([1.0]), torch.ones(1, 2))
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(-math.log(0.5))
    assert m["loss/tokens"] == 1.0


def test_clipped_tokens_carry_no_gradient():
    old = torch.log(t([[0.5, 0.5]]))
    logp = (old + torch.log(t([[1.5, 1.0]]))).requires_grad_(True)  # r = 1.5 (> 1.27), 1.0
    loss, m = O.minirl_loss(logp, old, logp.detach(), t([1.0]), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(-1.0)
    assert m["loss/clip_frac"] == 0.5


def test_grpo_by_hand():
    old = torch.log(t([[0.5, 0.5, 0.5]]))
    logp = old + torch.log(t([[1.5, 1.0, 0.6]]))  # r = 1.5, 1.0, 0.6
    adv = t([1.0])
    loss, _ = O.grpo_loss(logp, old, old, adv, t([[1, 1, 1]]))
    # min(rA, clip(r)A) with A = 1: min(1.5, 1.27), 1, min(0.6, 0.8) -> 1.27 + 1 + 0.6, over |y| = 3
    assert loss.item() == pytest.approx(-(1.27 + 1.0 + 0.6) / 3, rel=1e-5)


def test_cispo_by_hand():
    old = torch.log(t([[0.5, 0.5], [0.5, 0.5]]))
    logp = (old + torch.log(t([[1.5, 1.0], [0.5, 1.0]]))).requires_grad_(True)
    adv = t([1.0, -1.0])
    mask = t([[1, 1], [1, 0]])
    loss, _ = O.cispo_loss(logp, old, old, adv, mask)
    lp = logp.detach()
    w = t([[1.27, 1.0], [0.8, 1.0]])
    expected = -(w[0, 0] * lp[0, 0] + w[0, 1] * lp[0, 1] - w[1, 0] * lp[1, 0]) / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_train_inference_kl_is_mean_logmu_minus_logpi_on_response_tokens():
    mu = t([[-1.0, -2.0, 0.0]])
    pi = t([[-1.5, -1.0, 0.0]])
    assert O.train_inference_kl(mu, pi, t([[1, 1, 0]])) == pytest.approx((0.5 - 1.0) / 2)


def test_entropy_from_logits_uniform():
    assert O.entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8), rel=1e-6)


def test_a_token_sampled_behind_is_clipped_against_its_sampler_not_the_trained_weights():
    """k ≥ 1, N = 1 (#74): π_old is π_θ itself, so r_t = π_θ/π_old ≡ 1 and the clip never acts. A token
    sampled 2 updates behind by weights that gave it 0.4, which the policy now gives 0.6 (A > 0):
    anchored at its sampler, r = 1.5 > 1 + ε_high and it carries no gradient; the fresh token beside
    it is unchanged. Anchored at π_old (decoupled PPO's proximal policy) it is pushed by w = 1.5."""
    from minirl.config.recipe import LossConfig
    from minirl.train.batch import build_batch

    batch = build_batch([[7, 8]], [[5, 6]], [[LN(0.4), LN(0.5)]], [1.0], pad_id=0, versions=[(3, 5)], trained=5)
    assert batch.behind_BT.tolist() == [[0.0, 1.0, 0.0]]
    grads = {}
    for anchor in ("sampler", "proximal"):
        logp = t([[0.0, LN(0.6), LN(0.5)]]).requires_grad_(True)
        loss, m = O.loss_for(LossConfig(clip_against=anchor))(logp, batch)
        loss.backward()
        grads[anchor] = (logp.grad[0, 1:].tolist(), m["loss/clip_frac"])
    assert grads["sampler"][0] == pytest.approx([0.0, -1.0]) and grads["sampler"][1] == 0.5
    assert grads["proximal"][0] == pytest.approx([-1.5, -1.0]) and grads["proximal"][1] == 0.0


def test_the_sampler_anchor_keeps_pi_old_for_fresh_tokens_and_a_broken_mu():
    old, mu = t([[-1.0, -2.0, -3.0]]), t([[-1.5, -2.5, float("nan")]])
    assert O.sampler_logp(old, mu, None) is old  # synchronous: nothing behind
    assert O.sampler_logp(old, mu, t([[0.0, 1.0, 1.0]])).tolist() == [[-1.0, -2.5, -3.0]]


def test_a_batch_without_version_stamps_has_nothing_behind():
    from minirl.train.batch import build_batch

    assert build_batch([[7, 8]], [[5, 6]], None, None, pad_id=0).behind_BT is None
    assert build_batch([[7, 8]], [[5, 6]], None, None, pad_id=0, versions=[None], trained=4).behind_BT is None
    b = build_batch([[7], [7, 8]], [[5, 6], [5]], None, None, pad_id=0, versions=[(2, 3), None], trained=3)
    assert b.behind_BT.tolist() == [[1.0, 0.0], [0.0, 0.0]] and b.select(slice(0, 1)).behind_BT.shape == (1, 2)


def test_the_ten_percent_share_counts_either_side_whatever_the_advantage():
    """#97: TRL #7269's measure of a sampler's bias. Four tokens, A > 0, π_old/μ = 0.85, 1.05, 1.15,
    0.95: the first and third are outside [0.9, 1.1] (a half), while none is out of the clip band in
    its advantage's direction (below 1 is never clipped at A > 0, and 1.15 < 1 + ε_high)."""
    from minirl.config.recipe import LossConfig
    from minirl.train.batch import build_batch

    mu = [LN(0.4)] * 4
    batch = build_batch([[7]], [[5, 6, 7, 8]], [mu], [1.0], pad_id=0)
    old = t([[LN(0.4 * 0.85), LN(0.4 * 1.05), LN(0.4 * 1.15), LN(0.4 * 0.95)]])
    _, m = O.loss_for(LossConfig())(old, batch.with_old_logp(old))
    assert m["loss/mismatch_outside_10pct"] == pytest.approx(0.5)
    assert m["loss/mismatch_out_of_band"] == 0.0


def test_each_clipped_token_is_counted_by_its_cause():
    """#79: the rows split the clip. Four tokens, A > 0, after an update (N > 1: π_θ ≠ π_old):
    fresh, moved 1.5× since π_old (movement); stale, π_old/μ = 1.5 with π_θ = π_old (the anchor's gap
    alone: the mismatch, or the lag, which no setting separates per token); stale, π_old/μ = 1 and
    moved 1.5× (movement); fresh, untouched. Each share is a quarter of the tokens, the stale and
    fresh ones sum to clip_frac, and so do the mismatch and movement ones; π_old/μ is out of the
    band for one token (what an anchor at μ would clip before any update). Anchored at π_old, no
    token's anchor gap is out of the band: only the moved ones are clipped."""
    from minirl.config.recipe import LossConfig
    from minirl.train.batch import build_batch

    mu = [LN(0.4), LN(0.4), LN(0.4), LN(0.4)]
    batch = build_batch([[7]], [[5, 6, 7, 8]], [mu], [1.0], pad_id=0, versions=[(5, 3, 3, 5)], trained=5)
    old = t([[LN(0.4), LN(0.6), LN(0.4), LN(0.4)]])
    batch = batch.with_old_logp(old)
    logp = t([[LN(0.6), LN(0.6), LN(0.6), LN(0.4)]])
    _, m = O.loss_for(LossConfig(clip_against="sampler"))(logp, batch)
    assert m["loss/clip_frac"] == pytest.approx(0.75)
    assert (m["loss/clip_frac_stale"], m["loss/clip_frac_fresh"]) == pytest.approx((0.5, 0.25))
    assert (m["loss/clip_frac_mismatch"], m["loss/clip_frac_movement"]) == pytest.approx((0.25, 0.5))
    assert (m["loss/stale_frac"], m["loss/mismatch_out_of_band"]) == pytest.approx((0.5, 0.25))
    assert m["loss/mismatch_outside_10pct"] == pytest.approx(0.25)
    _, m = O.loss_for(LossConfig(clip_against="proximal"))(logp, batch)
    assert m["loss/clip_frac"] == pytest.approx(0.5) and m["loss/clip_frac_mismatch"] == 0.0
    assert (m["loss/clip_frac_stale"], m["loss/clip_frac_fresh"]) == pytest.approx((0.25, 0.25))
    # synchronous (no stamps): nothing stale, nothing of the anchor's own
    sync = build_batch([[7]], [[5, 6, 7, 8]], [mu], [1.0], pad_id=0).with_old_logp(old)
    _, m = O.loss_for(LossConfig())(logp, sync)
    assert m["loss/stale_frac"] == 0.0 and m["loss/clip_frac_fresh"] == m["loss/clip_frac"] == pytest.approx(0.5)
