"""Shared-prompt packing (minirl/train/packing.py): its layout, and the trainer's log-probs, entropies,
loss and gradients equal to the unpacked batch's on the tiny model."""

import pytest
import torch

from minirl.models.shapes import TINY
from minirl.train.batch import build_batch
from minirl.train.packing import pack_shared_prompts
from minirl.train.trainer import Trainer


def _pack(prompts, resps, **kw):
    b = build_batch(prompts, resps, None, None, pad_id=0)
    return b, pack_shared_prompts(b.tokens_BL, b.prompt_len_B, b.seq_len_B, pad_id=0, **kw)


def test_layout_of_shared_prompts_twins_and_prompts_sharing_a_row():
    A, Bp, D = [4, 5, 6], [7, 8], [9, 9]
    prompts = [A, Bp, A, Bp, A, Bp, A, Bp, D, D]
    resps = [[10, 11, 2], [12, 2], [13, 14, 15, 2], [2], [10, 11, 2], [12, 2], [16, 2], [17, 18, 2], [19, 2], [20, 2]]
    b, p = _pack(prompts, resps)
    B, T = b.mask_BT.shape
    assert (p.B, p.T) == (10, T) == (10, 6)
    # A's prompt once, then each distinct response without its last token (row 4 repeats row 0: not again)
    assert p.tokens_CS.tolist() == [[4, 5, 6, 10, 11, 13, 14, 15, 16], [7, 8, 12, 17, 18, 9, 9, 19, 20]]
    # positions restart after each prompt; B's and D's chunks share the second row, the longest first
    assert p.positions_CS.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 3], [0, 1, 2, 2, 3, 0, 1, 2, 2]]
    a, a1 = p.attend_C1SS[0, 0], p.attend_C1SS[1, 0]
    assert a[4].tolist() == [True, True, True, True, True, False, False, False, False]  # 11 sees A and 10
    assert a[5].tolist()[:6] == [True, True, True, False, False, True]  # 13 sees A, never 10, 11
    assert not a[2, 3]  # causal: the prompt never sees a response
    assert a1[5].tolist() == [False] * 5 + [True] + [False] * 3  # D's prompt never sees B's positions
    assert a1[8].tolist() == [False] * 5 + [True, True, False, True]  # 20 sees D, never 19
    assert not a1[3, 5:].any()  # nor B's responses D's
    # targets: every response token, predicted by the prompt's last token or its own previous token;
    # a twin's from its first copy's positions
    got = {(int(d) // T, int(d) % T): (int(s) // 9, int(s) % 9, int(t))
           for s, d, t in zip(p.src_N, p.dst_N, p.target_N)}
    assert got[(0, 2)] == (0, 2, 10) and got[(0, 3)] == (0, 3, 11) and got[(0, 4)] == (0, 4, 2)
    assert [got[(4, k)] for k in (2, 3, 4)] == [got[(0, k)] for k in (2, 3, 4)]  # the twin
    assert got[(2, 2)] == (0, 2, 13) and got[(2, 3)] == (0, 5, 14) and got[(2, 5)] == (0, 7, 2)
    assert got[(3, 1)] == (1, 1, 2)  # a one-token response: predicted by the prompt alone
    assert got[(5, 1)] == got[(1, 1)] == (1, 1, 12) and got[(5, 2)] == got[(1, 2)] == (1, 2, 2)
    assert got[(8, 1)] == (1, 6, 19) and got[(8, 2)] == (1, 7, 2) and got[(9, 1)] == (1, 6, 20)
    assert len(got) == int(b.mask_BT.sum())
    assert {k for k, v in got.items()} == {tuple(x) for x in b.mask_BT.nonzero().tolist()}


def test_a_response_is_a_twin_only_with_the_same_tokens_and_the_same_kept_counts():
    prompts, resps = [[4, 5, 6]] * 8, [[10, 11, 2]] * 4 + [[10, 11, 12, 2], [10, 2], [10, 11, 2], [10, 11, 2]]
    b, p = _pack(prompts, resps)
    assert p.tokens_CS.tolist() == [[4, 5, 6, 10, 11, 10, 11, 12, 10]]  # three distinct responses
    kept = torch.zeros_like(b.mask_BT, dtype=torch.int32)
    kept[6, 3] = 5  # the sampler cut row 6's second token elsewhere: not its twins' distribution
    p = pack_shared_prompts(b.tokens_BL, b.prompt_len_B, b.seq_len_B, kept_BT=kept)
    assert p.tokens_CS.tolist() == [[4, 5, 6, 10, 11, 10, 11, 12, 10, 10, 11]]
    assert len(p.src_N) == int(b.mask_BT.sum()) and p.src_N.unique().tolist() == list(range(2, 11))


def test_rows_split_at_max_len_and_unshared_batches_stay_unpacked():
    prompts, resps = [[4, 5, 6]] * 8, [[10 + i, 11, 12, 2] for i in range(8)]  # each response adds 3 positions
    _, p = _pack(prompts, resps, max_len=3 + 3 * 3)
    assert p.tokens_CS.shape == (3, 12)  # 3 + 3 + 2 responses: each row holds its prompt once
    assert _pack([[4, i] for i in range(8)], [[10, 2]] * 8)[1] is None  # no prompt shared: nothing saved
    assert _pack(prompts, resps, max_len=5)[1] is None  # rows longer than max_len: not packed


def test_long_responses_stay_unpacked_where_the_dense_attention_would_cost_more():
    """The tiny model's attention weighs a pair at ~3e-3 of a position: the default task's short
    responses pack, the long-response task's do not (measured: 11% slower packed)."""
    from minirl.models.shapes import attention_pair_cost

    g = torch.Generator().manual_seed(3)
    cost = attention_pair_cost(TINY)

    def batch(n_prompt: int, n_resp: int):
        prompts = [torch.randint(3, 30, (n_prompt,), generator=g).tolist() for _ in range(32) for _ in range(8)]
        prompts = [prompts[i // 8 * 8] for i in range(256)]
        return prompts, [torch.randint(3, 30, (n_resp,), generator=g).tolist() for _ in range(256)]

    short, long = batch(8, 5), batch(12, 35)
    assert _pack(*short, pair_cost=cost)[1] is not None
    assert _pack(*long, pair_cost=0.0)[1] is not None  # fewer positions...
    assert _pack(*long, pair_cost=cost)[1] is None  # ...but 32 rows of 284² pairs outweigh them


def _grouped_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts, resps = [], []
    # four prompts of different lengths, 6 responses each, two of them twins: 1-6 tokens, and 1 for the last
    # prompt, whose row then also holds another prompt's
    for n_p, most in ((5, 6), (9, 6), (7, 6), (2, 1)):
        p = torch.randint(3, 32, (n_p,), generator=g).tolist()
        for k in range(6):
            prompts.append(p)
            n = int(torch.randint(1, most + 1, (), generator=g))
            resps.append(resps[-3] if k in (3, 5) else torch.randint(3, 32, (n,), generator=g).tolist())
    order = torch.randperm(len(prompts), generator=g).tolist()  # groups need not be contiguous
    prompts, resps = [prompts[i] for i in order], [resps[i] for i in order]
    rlp = [(-torch.rand(len(r), generator=g) - 0.1).tolist() for r in resps]
    return build_batch(prompts, resps, rlp, torch.randn(len(prompts), generator=g).tolist(), pad_id=0)


@pytest.mark.parametrize("micro", [0, 4])
def test_packed_trainer_equals_unpacked_in_logprobs_entropy_loss_and_gradient(micro):
    from minirl.config import recipes
    from minirl.train.objective import loss_for

    batch = _grouped_batch(0)
    fn = loss_for(recipes.load(None).loss)
    out = {}
    for pack in (False, True):
        tr = Trainer(TINY, lr=1e-3, seed=0, pack_prompts=pack)
        with torch.no_grad():  # a random model, far from uniform, so a wrong mask shows
            for p in tr.model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.1)
        assert (tr._packed(batch) is not None) == pack
        old, ent, _ = tr.logprobs(batch)
        loss, m = tr.forward_backward(batch.with_old_logp(old), fn, micro_batch_tokens=micro * batch.tokens_BL.shape[1])
        grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        out[pack] = old, ent, loss, m, grads
    m_ = batch.mask_BT.bool()
    (lp0, e0, l0, m0, g0), (lp1, e1, l1, m1, g1) = out[False], out[True]
    torch.testing.assert_close(lp1[m_], lp0[m_], rtol=0, atol=1e-5)
    torch.testing.assert_close(e1[m_], e0[m_], rtol=0, atol=1e-5)
    assert float(lp0[m_].std()) > 0.3  # the check has teeth: log-probs differ across tokens
    assert l1 == pytest.approx(l0, rel=1e-4, abs=1e-7) and m1["loss/tokens"] == m0["loss/tokens"]
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_replayed_routes_keep_the_unpacked_layout():
    batch = _grouped_batch(1)
    tr = Trainer(TINY, lr=1e-3, seed=0)
    assert tr._packed(batch) is not None
    _, _, routes = tr.logprobs(batch, record_routes=True)  # R2 records in the batch's own [B, L-1] layout
    assert routes.shape[1:3] == batch.mask_BT.shape
    tr.replay.set_replay(routes)
    assert tr._packed(batch) is None
    tr.replay.set_replay(None)


def test_repeated_kv_heads_attend_as_sdpas_own_gqa():
    """The CUDA branch of the masked attention repeats KV heads instead of `enable_gqa`."""
    import torch.nn.functional as F

    from minirl.models.titan import repeat_kv_heads

    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    mask |= torch.eye(6, dtype=torch.bool)
    gqa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, *repeat_kv_heads(k, v, 4), attn_mask=mask), gqa)
    swapped = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), attn_mask=mask)
    assert not torch.allclose(swapped, gqa)  # the other head order is a different model
