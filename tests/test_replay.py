"""Routing Replay in the TorchTitan MoE router, and the paper's central identity, on the tiny model."""

import pytest
import torch

from minirl.models.shapes import TINY
from minirl.train import objective as O
from minirl.train.batch import build_batch
from minirl.train.replay import route_agreement, route_dtype, tokens_with_a_flip
from minirl.train.trainer import Trainer


@pytest.fixture
def setup():
    torch.manual_seed(0)
    tr = Trainer(TINY, lr=1e-2, seed=0)
    with torch.no_grad():
        for p in tr.model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32, (8,), generator=g).tolist() for _ in range(6)]
    responses = [torch.randint(3, 32, (int(n),), generator=g).tolist() for n in (3, 5, 4, 2, 5, 1)]
    adv = [0.5, -0.5, 1.0, -1.0, 0.25, 0.0]
    rollout = [[-1.0] * len(r) for r in responses]
    return tr, build_batch(prompts, responses, rollout, adv, pad_id=0)


def test_routes_are_compact_and_shaped(setup):
    tr, batch = setup
    _, _, routes = tr.logprobs(batch, record_routes=True)
    T = batch.tokens_BL.shape[1] - 1
    assert routes.dtype == torch.uint8 == route_dtype(8) and route_dtype(300) == torch.int16
    assert routes.shape == (TINY.n_layers, len(batch), T, TINY.top_k)
    assert int(routes.max()) < TINY.num_experts


def test_r2_first_minibatch_equals_no_replay_exactly(setup):
    """θ = θ_old on the first mini-batch, so the recorded routes are the ones the router picks anyway."""
    tr, batch = setup
    old, _, routes = tr.logprobs(batch, record_routes=True)
    idx = torch.tensor([0, 2, 4])
    mb = batch.select(idx)

    def loss_fn(lp, b):
        return O.minirl_loss(lp, old[idx], b.rollout_logp_BT, b.adv_B, b.mask_BT)

    captured = {}

    def spy(lp, b):
        captured.setdefault("lp", []).append(lp.detach().clone())
        return loss_fn(lp, b)

    loss_plain, _ = tr.forward_backward(mb, spy)
    grads_plain = [p.grad.clone() for p in tr.model.parameters()]
    tr.optim.zero_grad()
    loss_r2, _ = tr.forward_backward(mb, spy, routes=routes[:, idx])
    grads_r2 = [p.grad.clone() for p in tr.model.parameters()]
    tr.optim.zero_grad()
    assert loss_plain == loss_r2
    assert torch.equal(captured["lp"][0], captured["lp"][1])
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_r2))


def test_replay_forces_the_experts_and_keeps_router_gradients(setup):
    tr, batch = setup
    _, _, routes = tr.logprobs(batch, record_routes=True)
    with torch.no_grad():  # move the routers far enough that they would choose differently
        for r in tr.replay.routers:
            r.gate.weight.add_(torch.randn_like(r.gate.weight) * 2.0)
    _, _, fresh = tr.logprobs(batch, record_routes=True)
    assert route_agreement(fresh, routes, batch.mask_BT).mean() < 0.9
    lp_plain, _, _ = tr.logprobs(batch)
    lp_replay, _, _ = tr.logprobs(batch, routes=routes)
    assert not torch.allclose(lp_plain, lp_replay)

    loss_fn = lambda lp, b: (-(lp * b.mask_BT).sum(), {})  # noqa: E731
    tr.forward_backward(batch, loss_fn, routes=routes)
    assert all(r.gate.weight.grad is not None and r.gate.weight.grad.abs().sum() > 0 for r in tr.replay.routers)
    tr.optim.zero_grad()


def test_mismatched_routes_are_an_error(setup):
    tr, batch = setup
    _, _, routes = tr.logprobs(batch, record_routes=True)
    with pytest.raises(ValueError, match="do not fit tokens"):
        tr.logprobs(batch, routes=routes[:, :, :-1])
    with pytest.raises(ValueError, match="MoE layers"):
        tr.logprobs(batch, routes=routes[:-1])


def test_route_agreement_by_hand():
    a = torch.tensor([[[[1, 2], [3, 4]]]])  # 1 layer, 1 row, 2 tokens, k=2
    b = torch.tensor([[[[2, 1], [3, 5]]]])  # same set, different order; then a different set
    assert route_agreement(a, b, torch.ones(1, 2)).tolist() == [0.5]
    assert route_agreement(a, b, torch.tensor([[1.0, 0.0]])).tolist() == [1.0]


def test_a_token_counts_as_flipped_when_any_layer_flips():
    # 2 layers × 1 row × 3 tokens, k = 2: token 0 flips in layer 1 only, token 1 nowhere (reordered), token 2 in both
    a = torch.tensor([[[[0, 1], [2, 3], [4, 5]]], [[[0, 1], [2, 3], [4, 5]]]])
    b = torch.tensor([[[[0, 1], [3, 2], [4, 6]]], [[[0, 7], [2, 3], [5, 7]]]])
    assert route_agreement(a, b, torch.ones(1, 3)).tolist() == pytest.approx([2 / 3, 1 / 3])
    assert tokens_with_a_flip(a, b, torch.ones(1, 3)) == pytest.approx(2 / 3)
    assert tokens_with_a_flip(a, b, torch.tensor([[0.0, 1.0, 0.0]])) == 0.0


def test_token_surrogate_gradient_equals_sequence_reinforce_on_policy(setup):
    """Paper §2: with θ = θ_old and μ = π, ∇J_token = ∇J_seq, where
    J_seq = (1/B) Σ_i A_i log π_θ(y_i | x_i) and log π(y|x) = Σ_t log π(y_t | x, y_<t)."""
    tr, batch = setup
    old, _, _ = tr.logprobs(batch)

    def minirl(lp, b):  # μ = π_θold = π_θ exactly
        return O.minirl_loss(lp, old, old, b.adv_B, b.mask_BT)

    tr.forward_backward(batch, minirl)
    g_token = [p.grad.clone() for p in tr.model.parameters()]
    tr.optim.zero_grad()

    def reinforce(lp, b):
        seq_logp_B = (lp * b.mask_BT).sum(-1)
        return -(b.adv_B * seq_logp_B).mean(), {}

    tr.forward_backward(batch, reinforce)
    g_seq = [p.grad.clone() for p in tr.model.parameters()]
    tr.optim.zero_grad()
    assert sum(g.abs().sum() for g in g_seq) > 0
    for a, b in zip(g_token, g_seq):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_activation_checkpoint_recompute_replays_the_same_indices(setup):
    """With activation checkpointing the MoE forward runs twice (forward, then recompute in backward);
    both must use the replayed experts, so gradients equal those without checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    tr, batch = setup
    _, _, routes = tr.logprobs(batch, record_routes=True)
    with torch.no_grad():
        for r in tr.replay.routers:  # make the router's own choice differ from the replayed one
            r.gate.weight.add_(torch.randn_like(r.gate.weight) * 2.0)
    loss_fn = lambda lp, b: (-(lp * b.mask_BT).sum(-1).mul(b.adv_B).mean(), {})  # noqa: E731
    tr.forward_backward(batch, loss_fn, routes=routes)
    plain = [p.grad.clone() for p in tr.model.parameters()]
    tr.optim.zero_grad()
    for name, layer in list(tr.model.layers.named_children()):
        tr.model.layers.register_module(name, checkpoint_wrapper(layer))
    tr.forward_backward(batch, loss_fn, routes=routes)
    ckpt = [p.grad.clone() for p in tr.model.parameters()]
    tr.optim.zero_grad()
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
