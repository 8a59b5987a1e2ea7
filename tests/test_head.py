"""The output head's log-probs and entropy a chunk of positions at a time (train/head.py): the
values and every gradient of the whole computation, and never more than a chunk of logits."""

from __future__ import annotations

import pytest
import torch

from minirl.train.head import head_logprobs


class Head(torch.nn.Linear):
    """A head that remembers the most rows it was given at once."""

    most = 0

    def forward(self, h):
        Head.most = max(Head.most, h.shape[0])
        return super().forward(h)


@pytest.mark.parametrize("chunk,T", [(1, 1.0), (5, 1.0), (23, 1.0), (64, 1.0), (5, 0.6), (23, 1.7)])
def test_chunked_logprobs_entropy_and_their_gradients_are_the_whole_computations(chunk, T):
    """Of softmax(head(h) / T): the sampling temperature's policy, values and gradients."""
    g = torch.Generator().manual_seed(0)
    K, D, V = 23, 16, 50
    head = Head(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(0.25 * torch.randn(V, D, generator=g))  # logits of a few units, as a model's
    h = torch.randn(K, D, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (K,), generator=g)
    w_lp, w_h = torch.randn(K, generator=g), torch.randn(K, generator=g)

    x = torch.nn.functional.linear(h, head.weight) / T
    logp_all = torch.log_softmax(x, dim=-1)
    want_lp = logp_all[torch.arange(K), targets]
    want_h = -(logp_all.exp() * logp_all).sum(-1)
    (w_lp * want_lp + w_h * want_h).sum().backward()
    want_gh, want_gw = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None

    Head.most = 0
    lp, ent = head_logprobs(h, targets, head, chunk=chunk, temperature=T)
    assert Head.most == min(chunk, K)  # no more than one chunk of logits at a time
    torch.testing.assert_close(lp, want_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, want_h, rtol=1e-6, atol=1e-6)
    Head.most = 0
    (w_lp * lp + w_h * ent).sum().backward()
    assert Head.most == min(chunk, K)  # the backward too
    torch.testing.assert_close(h.grad, want_gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, want_gw, rtol=1e-6, atol=1e-6)


def test_rows_repeated_for_several_targets_sum_their_gradients():
    """A packed prompt's last position predicts each of its responses' first tokens: its hidden
    state is gathered once per target, and its gradient is the sum of theirs."""
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 12, bias=False)
    h = torch.randn(3, 8, generator=g, requires_grad=True)
    src, targets = torch.tensor([0, 0, 0, 1, 2]), torch.tensor([4, 5, 6, 7, 8])
    lp, _ = head_logprobs(h[src], targets, head, chunk=2, with_entropy=False)
    lp.sum().backward()
    want = torch.log_softmax(head(h.detach())[src], -1)[torch.arange(5), targets]
    torch.testing.assert_close(lp, want, rtol=1e-6, atol=1e-6)
    hh = h.detach().requires_grad_(True)
    torch.log_softmax(head(hh)[src], -1)[torch.arange(5), targets].sum().backward()
    torch.testing.assert_close(h.grad, hh.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_a_trainer_with_the_chunked_head_computes_and_learns_what_the_whole_logits_do(pack):
    """The tiny model forced to a 5-position head chunk: its log-probs, entropies, loss and every
    gradient are those of the whole logits (fp32)."""
    from minirl.config import recipes
    from minirl.models.shapes import TINY
    from minirl.train.batch import build_batch
    from minirl.train.objective import loss_for
    from minirl.train.trainer import Trainer

    g = torch.Generator().manual_seed(2)
    prompts = [[4, 5, 16]] * 3 + [[7, 8, 9, 16]] * 3
    resps = [[int(x) for x in torch.randint(3, 30, (n,), generator=g)] + [2] for n in (1, 3, 2, 4, 1, 2)]
    b = build_batch(prompts, resps, [[-1.0 - 0.1 * i for i in range(len(r))] for r in resps],
                    [0.5, -0.5, 1.0, -1.0, 0.2, -0.2], pad_id=0)
    fn = loss_for(recipes.load(None).loss)
    grads, figures = [], []
    for chunk in (0, 5):
        tr = Trainer(TINY, lr=1e-2, seed=0, head_chunk=chunk, pack_prompts=pack)
        assert (tr._packed(b) is not None) == pack
        old, ent, _ = tr.logprobs(b)
        loss, _ = tr.forward_backward(b.with_old_logp(old), fn)
        figures.append((old, ent, loss))
        grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters()})
    (old0, ent0, loss0), (old5, ent5, loss5) = figures
    torch.testing.assert_close(old5, old0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent5, ent0, rtol=1e-6, atol=1e-6)
    assert loss5 == pytest.approx(loss0, rel=1e-6)
    for n, g0 in grads[0].items():
        torch.testing.assert_close(grads[1][n], g0, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [5, 64])
def test_over_the_samplers_kept_set_logprobs_entropy_and_gradients_are_the_masked_softmaxs(chunk):
    """#97: where the sampler cut (kept > 0: that many of the most likely tokens), log π, the entropy and
    every gradient are those of softmax over the kept set only, through both paths (the chunked head and
    the whole logits, a packed row predicting two targets among them); uncut rows (kept 0) are as before;
    a target outside the kept set keeps its own logit over the kept set's log-sum-exp, and is counted."""
    from minirl.train.head import target_logprobs
    from minirl.train.objective import entropy_from_logits

    g = torch.Generator().manual_seed(1)
    K, D, V, T = 23, 16, 50, 0.7
    head = Head(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(0.25 * torch.randn(V, D, generator=g))
    h = torch.randn(K, D, generator=g, requires_grad=True)
    kept = torch.randint(0, 12, (K,), generator=g)  # 0: nothing cut at that row
    x0 = torch.nn.functional.linear(h, head.weight).detach() / T
    order = x0.argsort(-1, descending=True)
    targets = torch.where(torch.rand(K, generator=g) < 0.8, order[torch.arange(K), (kept - 1).clamp(min=0) // 2],
                          order[:, -1])  # mostly inside the kept set, a few outside
    w_lp, w_h = torch.randn(K, generator=g), torch.randn(K, generator=g)

    x = torch.nn.functional.linear(h, head.weight) / T
    edge = x.detach().sort(-1, descending=True).values.gather(-1, (kept.clamp(min=1) - 1)[:, None])
    outside = (kept > 0)[:, None] & (x.detach() < edge)
    lse = torch.logsumexp(x.masked_fill(outside, float("-inf")), -1)
    want_lp = x[torch.arange(K), targets] - lse
    logp = (x - lse[:, None]).masked_fill(outside, float("-inf"))
    p = logp.exp()
    want_h = -(p * logp.masked_fill(outside, 0.0)).sum(-1)
    (w_lp * want_lp + w_h * want_h).sum().backward()
    want_gh, want_gw = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None

    stats = {}
    lp, ent = head_logprobs(h, targets, head, chunk=chunk, temperature=T, kept_K=kept, stats=stats)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_h, rtol=1e-5, atol=1e-5)
    (w_lp * lp + w_h * ent).sum().backward()
    torch.testing.assert_close(h.grad, want_gh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.weight.grad, want_gw, rtol=1e-5, atol=1e-5)
    cut_out = int((outside[torch.arange(K), targets] & (kept > 0)).sum())
    assert stats["cut_tokens"] == int((kept > 0).sum()) and stats["outside_kept"] == cut_out > 0

    # the whole logits: position n predicts target rows_K[k]; row 3 predicts two targets (a packed prompt)
    logits = (torch.nn.functional.linear(h, head.weight).detach()).requires_grad_(True)
    rows = torch.cat([torch.arange(K), torch.tensor([3])])
    both = torch.cat([targets, targets[3:4]])
    got = target_logprobs(logits, rows, both, chunk_tokens=chunk, temperature=T, kept_N=kept)
    ref_x = (logits / T)
    ref_lse = torch.logsumexp(ref_x.masked_fill(outside, float("-inf")), -1)
    want = ref_x[rows, both] - ref_lse[rows]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn(K + 1, generator=g)
    (g_got,) = torch.autograd.grad((weights * got).sum(), logits)
    (g_want,) = torch.autograd.grad((weights * want).sum(), logits)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits.detach()[None], temperature=T, kept_BT=kept[None])[0],
                               want_h.detach(), rtol=1e-5, atol=1e-5)
