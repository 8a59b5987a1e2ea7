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
