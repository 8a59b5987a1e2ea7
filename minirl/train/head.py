"""log π(y_t) and the entropy H_t from the final hidden states through the output head, a chunk of
positions at a time both ways: no step holds the logits of more than one chunk.

The logits of a micro-batch are [positions, vocab]: at Qwen3's 151,936 tokens and 32k positions,
9.3 GiB in bf16, as much again for their gradient, and the float32 work of the softmax on top;
the head itself is a [vocab, dim] matrix of 0.6 GiB. Here each chunk's logits are made by the head,
reduced to what the objective reads (the target's log-prob, the log-sum-exp, the entropy) and
dropped; the backward makes them once more and sends their gradient through the head:

    log π(y) = x_y − logsumexp(x),      H = −Σ_v p_v log p_v,      x = head(h), p = softmax(x)
    ∂ log π(y) / ∂x = onehot(y) − p,    ∂H / ∂x = −p ⊙ (log p + H)

(one more head product per chunk in backward: the trade of a fused linear cross-entropy). The head
is called as a module, so FSDP2 gathers its weight as for any forward and reduces its gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def head_logprobs(h_KD: torch.Tensor, targets_K: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], *,
                  chunk: int, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log π(targets_K), H) per row of h_KD, [K] each in float32: row k is the hidden state whose
    logits `head(h)` predict target k (a prompt's last position appears once per response it
    starts). Differentiable in h_KD and in the head's parameters."""
    device = h_KD.device.type
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    logp, ent = _HeadLogProbs.apply(h_KD, targets_K, head, chunk, with_entropy, autocast)
    return logp, (ent if with_entropy else None)


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_KD, targets_K, head, chunk, with_entropy, autocast):
        K = h_KD.shape[0]
        lse = torch.empty(K, dtype=torch.float32, device=h_KD.device)  # logsumexp(x), for the backward
        target = torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else torch.empty(0, device=h_KD.device)
        rows = torch.arange(K, device=h_KD.device)
        for s in range(0, K, chunk):
            x = head(h_KD[s : s + chunk]).float()
            logp = torch.log_softmax(x, dim=-1)  # as the whole computation has it (objective.entropy_from_logits)
            lse[s : s + chunk] = x[:, 0] - logp[:, 0]
            del x
            target[s : s + chunk] = logp[rows[: logp.shape[0]], targets_K[s : s + chunk]]
            if with_entropy:
                ent[s : s + chunk] = -logp.exp().mul_(logp).sum(dim=-1)
        ctx.save_for_backward(h_KD, targets_K, lse, ent)
        ctx.head, ctx.chunk, ctx.autocast = head, chunk, autocast
        ctx.set_materialize_grads(False)  # an output the loss does not read (the entropy) gets None, not zeros
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return target, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h_KD, targets_K, lse, ent = ctx.saved_tensors
        K, chunk = h_KD.shape[0], ctx.chunk
        grad_h = torch.empty_like(h_KD)
        rows = torch.arange(K, device=h_KD.device)
        enabled, dtype = ctx.autocast
        for s in range(0, K, chunk):
            e = min(s + chunk, K)
            h = h_KD[s:e].detach().requires_grad_(True)
            with torch.enable_grad(), torch.autocast(h.device.type, dtype=dtype, enabled=enabled):
                x = ctx.head(h)
            # in place where it can: three [chunk, vocab] float32 tensors at most (plan.py counts them)
            logp = x.detach().float().sub_(lse[s:e, None])
            p = logp.exp()
            if g_ent is not None and ent.numel():  # −p ⊙ (log p + H) · g_H, made in logp's storage
                g = logp.add_(ent[s:e, None]).mul_(p).mul_(-g_ent[s:e, None].float())
                if g_logp is not None:
                    g.sub_(p.mul_(g_logp[s:e, None].float()))
            elif g_logp is not None:
                g = p.mul_(-g_logp[s:e, None].float())
            else:
                g = p.zero_()
            if g_logp is not None:
                g[rows[: e - s], targets_K[s:e]] += g_logp[s:e].float()
            torch.autograd.backward(x, g.to(x.dtype))  # the head's parameters accumulate theirs here
            grad_h[s:e] = h.grad
        return grad_h, None, None, None, None, None
