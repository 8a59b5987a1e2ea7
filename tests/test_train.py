"""Trainer checkpoints (DCP): exact round trips, and no side effect of saving on the optimizer."""

import pytest
import torch

from minirl.models.shapes import TINY
from minirl.train.batch import build_batch
from minirl.train.sft import sft_loss
from minirl.train.trainer import Trainer

BATCH = build_batch([[4, 5, 16]] * 4, [[6, 2]] * 4, None, None, pad_id=0)


def test_saving_before_the_first_step_leaves_adam_untouched(tmp_path):
    """DCP materialises an empty optimizer with a zero step; that must not reach the live optimizer."""
    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.save(tmp_path / "s0", {"step": 0})
    assert not tr.optim.state
    tr.forward_backward(BATCH, sft_loss)
    tr.optim_step()
    assert all(float(s["step"]) == 1.0 for s in tr.optim.state.values())


def test_round_trip_and_rollback_to_a_pre_step_checkpoint(tmp_path):
    tr = Trainer(TINY, lr=1e-3, seed=0)
    start = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.save(tmp_path / "s0", {"step": 0})
    for _ in range(2):
        tr.forward_backward(BATCH, sft_loss)
        tr.optim_step()
    tr.save(tmp_path / "s2", {"step": 2})
    other = Trainer(TINY, lr=1e-3, seed=9)
    assert other.load(tmp_path / "s2")["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(tr.model.state_dict().values(), other.model.state_dict().values()))
    a = next(iter(tr.optim.state.values()))
    b = next(iter(other.optim.state.values()))
    assert torch.equal(a["exp_avg"], b["exp_avg"]) and float(b["step"]) == 2.0
    tr.load(tmp_path / "s0")  # back to before any step: weights as they were, a fresh optimizer
    assert all(torch.equal(start[k], v) for k, v in tr.model.state_dict().items())
    assert not tr.optim.state


@pytest.mark.parametrize("T", [1.0, 0.6])
def test_chunked_logprobs_equal_the_whole_softmax_in_value_and_gradient(T):
    """Of softmax(logits / T), the policy the engine samples at temperature T."""
    from minirl.train.head import token_logprobs
    from minirl.train.objective import entropy_from_logits

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=g)
    whole = torch.log_softmax(logits / T, -1).gather(-1, targets[..., None]).squeeze(-1)
    (gw,) = torch.autograd.grad(whole.sum(), logits)
    chunked = token_logprobs(logits, targets, chunk_tokens=4, temperature=T)  # 21 positions: 5 full chunks + 1
    (gc,) = torch.autograd.grad(chunked.sum(), logits)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)  # log-probs down to -20: a few fp32 ulps
    torch.testing.assert_close(gc, gw, rtol=0, atol=1e-6 / T)  # (onehot - p) / T: a few ulps of 1/T
    with torch.no_grad():
        p = torch.softmax(logits / T, -1)
        torch.testing.assert_close(entropy_from_logits(logits, chunk_tokens=4, temperature=T), -(p * p.log()).sum(-1))


@pytest.mark.parametrize("T", [1.0, 0.6])
def test_target_logprobs_read_several_targets_from_one_position_in_value_and_gradient(T):
    """Packed prompts: one position predicts the first token of each of its responses. The
    gradient sums over them; formed in fp32 before the cast, it keeps 1 − p where bf16 would not."""
    from minirl.train.head import target_logprobs

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 40, generator=g) * 4).requires_grad_()
    rows = torch.tensor([0, 2, 2, 2, 5, 8, 8])
    targets = torch.randint(0, 40, (7,), generator=g)
    w = torch.randn(7, generator=g)
    whole = torch.log_softmax(x / T, -1)[rows, targets]
    (gw,) = torch.autograd.grad((whole * w).sum(), x)
    chunked = target_logprobs(x, rows, targets, chunk_tokens=2, temperature=T)
    (gc,) = torch.autograd.grad((chunked * w).sum(), x)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(gc, gw, rtol=1e-6, atol=1e-6)

    confident = torch.zeros(1, 40)
    confident[0, 3] = 12.0  # p ≈ 0.99998: ∂ log p / ∂x[3] = 1 − p ≈ 2.5e-4
    xb = confident.bfloat16().requires_grad_()
    (gb,) = torch.autograd.grad(target_logprobs(xb, torch.tensor([0]), torch.tensor([3])).sum(), xb)
    exact = 1 - torch.softmax(xb.detach().float(), -1)[0, 3]
    assert float(gb[0, 3]) == pytest.approx(float(exact), rel=0.01)


def test_a_batch_moves_and_splits_whole():
    b = BATCH.with_old_logp(torch.full(BATCH.mask_BT.shape, -0.5))
    mb = b.select(torch.tensor([1, 3])).to(torch.device("cpu"))
    assert mb.tokens_BL.shape[0] == 2 and mb.old_logp_BT.shape == mb.mask_BT.shape
    assert BATCH.select(slice(0, 2)).old_logp_BT is None


def test_micro_batches_give_the_whole_batch_gradient():
    from minirl.train.objective import minirl_loss

    g = torch.Generator().manual_seed(1)
    prompts = [[4, 5, 16]] * 6
    resps = [[int(x) for x in torch.randint(3, 30, (n,), generator=g)] + [2] for n in (1, 3, 2, 4, 1, 2)]
    b = build_batch(prompts, resps, [[-1.0] * len(r) for r in resps], [0.5, -0.5, 1.0, -1.0, 0.2, -0.2], pad_id=0)

    def run(micro: int):
        tr = Trainer(TINY, lr=1e-3, seed=0)
        old, _, _ = tr.logprobs(b)
        bb = b.with_old_logp(old)
        loss, m = tr.forward_backward(
            bb, lambda lp, x: minirl_loss(lp, x.old_logp_BT, x.rollout_logp_BT, x.adv_B, x.mask_BT),
            micro_batch_tokens=micro)
        return loss, m, {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}

    loss1, m1, g1 = run(0)
    loss2, m2, g2 = run(2 * b.tokens_BL.shape[1])  # 2 rows a micro-batch: 3 of them
    assert loss2 == pytest.approx(loss1, rel=1e-5)
    assert m2["loss/tokens"] == m1["loss/tokens"] and m2["loss/is_weight_max"] == pytest.approx(m1["loss/is_weight_max"])
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-7)


def test_length_groups_cost_the_fewest_positions_and_keep_one_forward_where_no_cut_pays():
    """The cold start's rows by length: every row in one forward, each forward padded to its longest row;
    the grouping's positions (plus `fixed` a forward) are the fewest of every split of the sorted rows."""
    import itertools
    import random

    from minirl.train.sft import length_groups

    def cost(lengths, groups, fixed):
        return sum(fixed + max(lengths[i] for i in g) * len(g) for g in groups)

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([3, 4, 5, 40, 41, 90]) + rng.randrange(2) for _ in range(rng.randrange(1, 9))]
        fixed = rng.choice([0, 8, 64, 10**6])
        groups = length_groups(lengths, fixed)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], fixed)
                   for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
        assert cost(lengths, groups, fixed) == best
    # targets of about one length (the embedded default's): one forward, in the batch's own order
    assert length_groups([12, 13, 12, 14, 13] * 20, 256) == [list(range(100))]
    assert length_groups([74, 163, 75, 160], 100) == [[0, 2], [3, 1]]


def test_sft_in_forwards_by_length_gives_the_whole_batchs_gradient():
    """A multi-turn task's SFT batch (short answers, long calls with a masked reply) in two forwards by
    length: the loss and every gradient are the one forward's token mean."""
    from minirl.train.sft import length_groups, sft_backward

    g = torch.Generator().manual_seed(3)

    def ids(n):
        return [int(x) for x in torch.randint(3, 30, (n,), generator=g)]

    examples = [(ids(5), ids(3) + [2]) if i % 2 else (ids(5), ids(40) + [2], [1] * 10 + [0] * 20 + [1] * 11)
                for i in range(16)]
    assert len(length_groups([len(p) + len(t) for p, t, *_ in examples])) == 2

    def run(fixed):
        tr = Trainer(TINY, lr=1e-3, seed=0)
        loss = sft_backward(tr, examples, pad_id=0, fixed=fixed)
        return loss, {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}

    loss1, g1 = run(10**9)  # a forward costs more than any padding: one forward
    loss2, g2 = run(256)
    assert loss2 == pytest.approx(loss1, rel=1e-5)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("micro", [0, 2])
def test_on_policy_update_gives_pi_old_itself(micro):
    """N = 1: the update's own forward is at θ_old, so the loop takes log π_θold and H from it
    (loop.loss_for holds it fixed) instead of a second forward: same values, same gradient."""
    from minirl.config import recipes
    from minirl.train.objective import loss_for

    g = torch.Generator().manual_seed(2)
    prompts = [[4, 5, 16]] * 6
    resps = [[int(x) for x in torch.randint(3, 30, (n,), generator=g)] + [2] for n in (1, 3, 2, 4, 1, 2)]
    b = build_batch(prompts, resps, [[-1.0 - 0.1 * i for i in range(len(r))] for r in resps],
                    [0.5, -0.5, 1.0, -1.0, 0.2, -0.2], pad_id=0)
    fn = loss_for(recipes.load(None).loss)
    micro_tokens = micro * b.tokens_BL.shape[1]

    separate = Trainer(TINY, lr=1e-3, seed=0)
    old, ent, _ = separate.logprobs(b)
    loss1, m1 = separate.forward_backward(b.with_old_logp(old), fn, micro_batch_tokens=micro_tokens)
    fused = Trainer(TINY, lr=1e-3, seed=0)
    loss2, m2, own_logp, own_ent = fused.forward_backward(b, fn, micro_batch_tokens=micro_tokens, with_logp=True)

    torch.testing.assert_close(own_logp, old, rtol=0, atol=1e-6)  # eval and train mode: no dropout, same π
    torch.testing.assert_close(own_ent, ent, rtol=0, atol=1e-6)
    assert loss2 == pytest.approx(loss1, rel=1e-6) and m2["loss/is_weight_mean"] == pytest.approx(m1["loss/is_weight_mean"])
    assert m2["loss/clip_frac"] == 0.0  # ratio π/π_old is exactly 1 on-policy
    for (n, p1), (_, p2) in zip(separate.model.named_parameters(), fused.model.named_parameters()):
        if p1.grad is not None:
            torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_bf16_compute_keeps_fp32_master_weights():
    """train.param_dtype = bfloat16 forced on the CPU runs CUDA's dtype code in one process
    (autocast, TorchTitan's bf16 grouped experts): over five updates the loss follows the fp32
    trainer's within 2% (bf16's 8 mantissa bits; not equal, so bf16 really ran), while weights,
    gradients and Adam's moments stay float32."""
    fp32, bf16 = Trainer(TINY, lr=1e-3, seed=0), Trainer(TINY, lr=1e-3, seed=0, param_dtype="bfloat16")
    assert fp32.param_dtype == "float32"  # "auto" on the CPU
    bf16.load_weights(fp32.model.state_dict())
    lp32, _, _ = fp32.logprobs(BATCH)
    lp16, _, _ = bf16.logprobs(BATCH)
    m = BATCH.mask_BT.bool()
    assert lp16.dtype == torch.float32 and not torch.equal(lp16[m], lp32[m])  # another rounding...
    torch.testing.assert_close(lp16[m], lp32[m], rtol=0, atol=0.05)  # ...of the same model
    experts = type(bf16.model.layers["0"].moe.routed_experts.inner_experts)
    assert experts.__name__ == "GroupedExperts"  # TorchTitan's own, as on CUDA (fp32: models/titan.py's)
    losses = []
    for _ in range(5):
        loss32, _ = fp32.forward_backward(BATCH, sft_loss)
        loss16, _ = bf16.forward_backward(BATCH, sft_loss)
        fp32.optim_step()
        bf16.optim_step()
        assert loss16 == pytest.approx(loss32, rel=0.02) and loss16 != loss32
        losses.append(loss16)
    assert losses[-1] < 0.9 * losses[0]  # it trains
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert {v.dtype for s in bf16.optim.state.values() for k, v in s.items() if k != "step"} == {torch.float32}


def test_activation_checkpointing_keeps_the_gradients_and_the_names():
    """train.activation_checkpoint = full (TorchTitan's FullAC on every decoder layer): the same
    loss and gradients as without, and the same state-dict names (checkpoints, HF export, sync)."""
    plain, ac = Trainer(TINY, lr=1e-3, seed=0), Trainer(TINY, lr=1e-3, seed=0, activation_checkpoint="full")
    assert "CheckpointWrapper" in type(ac.model.layers["0"]).__name__
    assert ac.model.state_dict().keys() == plain.model.state_dict().keys()
    ac.load_weights(plain.model.state_dict())
    loss1, _ = plain.forward_backward(BATCH, sft_loss)
    loss2, _ = ac.forward_backward(BATCH, sft_loss)
    assert loss2 == pytest.approx(loss1, rel=1e-6)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in ac.model.named_parameters()}
    for n, p in plain.model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_a_full_disk_inside_a_dcp_save_is_found_in_torchs_wrapped_failures():
    """DCP reports a failed write as CheckpointException({rank: (exception, stack)}). When the disk
    fills while it writes the metadata, the freed temp folder leaves room again, so the OSError
    itself must be found in the wrapped failures (it once surfaced as a traceback, exit 1)."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from minirl.disk.oserrors import os_error_of as _os_error

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
        wrapped = _wrap_exception(e)
    found = _os_error(CheckpointException("write", {0: wrapped}))
    assert isinstance(found, OSError) and found.errno == errno.ENOSPC
    assert _os_error(CheckpointException("write", {0: _wrap_exception(ValueError("x"))})) is None


def test_logprobs_forwards_at_most_the_micro_batchs_tokens_at_once():
    """#72: π_old of an off-policy step's mini-batch (or of 32k-token responses) is forwarded in
    chunks of at most train.micro_batch_tokens tokens (one row at least), and equals the whole
    batch's forward."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30, (4,), generator=g).tolist() for _ in range(7)]
    batch = build_batch(prompts, [torch.randint(3, 30, (6,), generator=g).tolist() for _ in prompts], None, None,
                        pad_id=0)
    L = batch.tokens_BL.shape[1]
    whole = Trainer(TINY, lr=1e-3, seed=0)
    chunked = Trainer(TINY, lr=1e-3, seed=0, micro_batch_tokens=3 * L + 1)  # 3 rows a forward
    seen = []
    chunked.model.register_forward_hook(lambda mod, args, out: seen.append(int(args[0].shape[0])))
    lp, ent, _ = chunked.logprobs(batch)
    assert seen == [3, 3, 1]
    want_lp, want_ent, _ = whole.logprobs(batch)
    m = batch.mask_BT.bool()
    torch.testing.assert_close(lp[m], want_lp[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[m], want_ent[m], rtol=0, atol=1e-5)


def test_the_cpu_token_dispatch_is_torchtitans_bit_for_bit():
    """The MoE's tokens gathered and combined by index on a CPU (models/titan.py): outputs and
    every gradient equal to TorchTitan's own dispatcher's, bit for bit, on the same weights; and
    no more kept for backward than TorchTitan's keeps, which is what the plan's activations count
    and tests/test_memory_model.py measures on a CPU for CUDA (autograd's own `index_add` kept an
    [N, D] copy of the routed outputs a layer more)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from minirl.models.titan import titan_config

    cfg = titan_config(TINY)
    torch.manual_seed(0)
    ours = cfg.build()
    with torch.no_grad():
        ours.init_states()
    for layer in cfg.layers:
        d = layer.moe.routed_experts.token_dispatcher
        layer.moe.routed_experts.token_dispatcher = AllToAllTokenDispatcher.Config(num_experts=d.num_experts,
                                                                                    top_k=d.top_k)
    theirs = cfg.build()
    theirs.load_state_dict(ours.state_dict())
    assert type(ours.layers["0"].moe.routed_experts.token_dispatcher).__name__ == "IndexTokenDispatcher"
    assert type(theirs.layers["0"].moe.routed_experts.token_dispatcher) is AllToAllTokenDispatcher
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, TINY.vocab_size, (16, 24), generator=g)  # 384 tokens over 8 experts, 2 each
    weights = torch.randn(16, 24, TINY.vocab_size, generator=g)
    results, kept = [], []
    for model in (ours, theirs):
        storages = {}  # what the forward saves for backward, each storage once (held: no address reused)

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens)
        kept.append(sum(t.untyped_storage().nbytes() for t in storages.values()))
        (out * weights).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    assert kept[0] <= kept[1], kept
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
