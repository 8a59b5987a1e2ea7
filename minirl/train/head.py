"""log π(y_t) and the entropy H_t from the final hidden states through the output head, a chunk of
positions at a time both ways: no step holds the logits of more than one chunk.

The logits of a micro-batch are [positions, vocab]: at Qwen3's 151,936 tokens and 32k positions,
9.3 GiB in bf16, as much again for their gradient, and the float32 work of the softmax on top;
the head itself is a [vocab, dim] matrix of 0.6 GiB. Here each chunk's logits are made by the head,
reduced to what the objective reads (the target's log-prob, the log-sum-exp, the entropy) and
dropped; the backward makes them once more and sends their gradient through the head:

    log π(y) = x_y − logsumexp(x),      H = −Σ_v p_v log p_v,      x = head(h) / T, p = softmax(x)
    ∂ log π(y) / ∂x = onehot(y) − p,    ∂H / ∂x = −p ⊙ (log p + H)

T is the sampling temperature (`rollout.temperature`): the engine draws y from softmax(z / T), so
that is the policy π whose log-probs the loss and the guard read (as verl and prime-rl take them);
the division happens in float32, as vLLM's sampler divides, and at T = 1 not at all.

(one more head product per chunk in backward: the trade of a fused linear cross-entropy). The head
is called as a module, so FSDP2 gathers its weight as for any forward and reduces its gradient.

Where the logits do exist whole (the tiny model, whose head is never chunked: `head_chunk`),
`target_logprobs` reads log π(y) from them a chunk of positions at a time, both ways, so that
float32 exists for one chunk only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minirl.train.cuts import count, cut, edge_of

HEAD_CHUNK = 1024  # positions of the chunked output head at once: 1024 × 151,936 fp32 logits are 0.6 GiB
HEAD_CHUNK_ABOVE = 2**30  # bytes of a forward's bf16 logits above which the head runs chunked


def head_chunk(positions: int, vocab: int) -> int:
    """Positions per chunk of the output head for a forward of `positions`, or 0 for whole logits:
    chunked where the bf16 logits would pass HEAD_CHUNK_ABOVE (Qwen3's vocabulary at 3.5k
    positions), never on the tiny model, whose figures stay those of the whole logits. The
    trainer asks it for every forward; the plan (setup/plan.py) counts what it chose."""
    return HEAD_CHUNK if positions * vocab * 2 > HEAD_CHUNK_ABOVE else 0


def head_logprobs(h_KD: torch.Tensor, targets_K: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], *,
                  chunk: int, with_entropy: bool = True, temperature: float = 1.0, kept_K: torch.Tensor | None = None,
                  stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log π(targets_K), H) per row of h_KD, [K] each in float32, of softmax(head(h) / T): row k
    is the hidden state whose logits `head(h)` predict target k (a prompt's last position appears
    once per response it starts). Differentiable in h_KD and in the head's parameters. `kept_K`: the
    sampler's kept counts (0: nothing cut), over whose tokens π and H are renormalized; `stats` gathers
    the kept mass and the targets outside the trainer's own kept set."""
    device = h_KD.device.type
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    logp, ent = _HeadLogProbs.apply(h_KD, targets_K, head, chunk, with_entropy, autocast, float(temperature),
                                    kept_K, stats)
    return logp, (ent if with_entropy else None)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in float32 divided by T (none at T = 1: the figures of T = 1 stay bit for bit)."""
    x = x.float()
    return x if temperature == 1.0 else x / temperature


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_KD, targets_K, head, chunk, with_entropy, autocast, temperature, kept_K, stats):
        K = h_KD.shape[0]
        lse = torch.empty(K, dtype=torch.float32, device=h_KD.device)  # logsumexp(x), for the backward
        target = torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else torch.empty(0, device=h_KD.device)
        edges = torch.full_like(lse, float("-inf"))  # each row's cut edge (-inf: nothing cut)
        rows = torch.arange(K, device=h_KD.device)
        for s in range(0, K, chunk):
            x = _scaled(head(h_KD[s : s + chunk]), temperature)
            edge = edge_of(x, None if kept_K is None else kept_K[s : s + chunk])
            if edge is None:
                logp = torch.log_softmax(x, dim=-1)  # as the whole computation has it (objective.entropy_from_logits)
                lse[s : s + chunk] = x[:, 0] - logp[:, 0]
                target[s : s + chunk] = logp[rows[: logp.shape[0]], targets_K[s : s + chunk]]
            else:  # renormalized over the kept set; a target outside it keeps its own logit (counted)
                edges[s : s + chunk] = edge[:, 0]
                lse[s : s + chunk] = torch.logsumexp(cut(x, edge), dim=-1)
                picked = x[rows[: x.shape[0]], targets_K[s : s + chunk]]
                target[s : s + chunk] = picked - lse[s : s + chunk]
                count(stats, x, lse[s : s + chunk], picked, edge)
                logp = cut(x, edge).sub_(lse[s : s + chunk, None])
            del x
            if with_entropy:  # of the distribution the token was drawn from (0 · log 0 = 0 outside the kept set)
                p = logp.exp()
                ent[s : s + chunk] = -p.mul_(logp if edge is None else logp.masked_fill_(p == 0, 0.0)).sum(dim=-1)
        ctx.save_for_backward(h_KD, targets_K, lse, ent, edges)
        ctx.head, ctx.chunk, ctx.autocast, ctx.temperature = head, chunk, autocast, temperature
        ctx.set_materialize_grads(False)  # an output the loss does not read (the entropy) gets None, not zeros
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return target, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h_KD, targets_K, lse, ent, edges = ctx.saved_tensors
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
            logp = _scaled(x.detach(), ctx.temperature)
            was_cut = bool(torch.isfinite(edges[s:e]).any())
            if was_cut:  # outside the kept set: p = 0, no gradient
                logp = cut(logp, edges[s:e, None])
            logp = logp.sub_(lse[s:e, None])
            p = logp.exp()
            if was_cut:
                logp.masked_fill_(p == 0, 0.0)  # 0 · log 0 is 0 in the entropy's gradient
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
            if ctx.temperature != 1.0:  # ∂/∂head(h) = (1/T) ∂/∂x
                g.div_(ctx.temperature)
            torch.autograd.backward(x, g.to(x.dtype))  # the head's parameters accumulate theirs here
            grad_h[s:e] = h.grad
        return grad_h, None, None, None, None, None, None, None, None


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, *, chunk_tokens: int = 4096,
                   temperature: float = 1.0, kept_BT: torch.Tensor | None = None,
                   stats: dict | None = None) -> torch.Tensor:
    """log π(target_t) = x_t[target] − logsumexp_v x_t[v], x = logits / T, in float32; where the sampler
    cut its distribution (`kept_BT` > 0), the log-sum-exp over the kept set only."""
    B, T, V = logits_BTV.shape
    rows = torch.arange(B * T, device=logits_BTV.device)
    return target_logprobs(logits_BTV.reshape(B * T, V), rows, targets_BT.reshape(B * T), chunk_tokens=chunk_tokens,
                           temperature=temperature, kept_N=None if kept_BT is None else kept_BT.reshape(B * T),
                           stats=stats).view(B, T)


def target_logprobs(x_NV: torch.Tensor, rows_K: torch.Tensor, targets_K: torch.Tensor, *,
                    chunk_tokens: int = 4096, temperature: float = 1.0, kept_N: torch.Tensor | None = None,
                    stats: dict | None = None) -> torch.Tensor:
    """log softmax(x[rows_K] / T)[targets_K], [K] in float32: the log-prob of target k read from
    position rows_K[k] (a packed prompt position may predict several responses' first tokens);
    `kept_N`: the sampler's kept count at each position (0: nothing cut), over which it is renormalized."""
    return _TargetLogProbs.apply(x_NV, rows_K, targets_K, chunk_tokens, float(temperature), kept_N, stats)


class _TargetLogProbs(torch.autograd.Function):
    """`target_logprobs`, a chunk of positions at a time both ways, so float32 exists for one chunk
    only: a whole fp32 log-softmax over Qwen3's 151,936-token vocabulary is ~37 GiB at 64×1024
    tokens. The gradient, ∂ log p_k / ∂x_n = 1[n = row_k]·(onehot(target_k) − softmax(x_n)),
    is formed per chunk in float32 (1 − p cancels in bf16 for confident tokens) and written into
    one [N, V] buffer of x's dtype: slicing under autograd instead adds a zero-filled [N, V]
    gradient per chunk, which on an H100 (0.76B MoE, 16k tokens) dominated the step's kernels."""

    @staticmethod
    def forward(ctx, x_NV, rows_K, targets_K, chunk, temperature, kept_N, stats):
        N = x_NV.shape[0]
        lse_N = torch.empty(N, dtype=torch.float32, device=x_NV.device)
        edges = None if kept_N is None or not bool((kept_N > 0).any()) else torch.empty_like(lse_N)
        for s in range(0, N, chunk):
            x = _scaled(x_NV[s : s + chunk], temperature)
            edge = None if edges is None else edge_of(x, kept_N[s : s + chunk])
            lse_N[s : s + chunk] = torch.logsumexp(cut(x, edge), dim=-1)
            if edge is not None:  # over the kept set only
                edges[s : s + chunk] = edge[:, 0]
                here = (rows_K >= s) & (rows_K < s + chunk)
                r = rows_K[here] - s
                count(stats, x[r], lse_N[s : s + chunk][r], x[r, targets_K[here]], edge[r])
        ctx.save_for_backward(x_NV, rows_K, targets_K, lse_N, *(() if edges is None else (edges,)))
        ctx.chunk, ctx.temperature = chunk, temperature
        return _scaled(x_NV[rows_K, targets_K], temperature) - lse_N[rows_K]

    @staticmethod
    def backward(ctx, g_K):
        x_NV, rows_K, targets_K, lse_N, *saved = ctx.saved_tensors
        edges = saved[0] if saved else None
        N, chunk, T = x_NV.shape[0], ctx.chunk, ctx.temperature
        g_K = g_K.float() / T  # ∂/∂x = (1/T) ∂/∂(x / T)
        g_N = torch.zeros(N, dtype=torch.float32, device=x_NV.device).index_add_(0, rows_K, g_K)
        grad_NV = torch.empty_like(x_NV)
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            x = _scaled(x_NV[s:e], T) if edges is None else cut(_scaled(x_NV[s:e], T), edges[s:e, None])
            p = torch.exp(x - lse_N[s:e, None]).mul_(-g_N[s:e, None])  # −softmax · Σ_k g_k (0 outside a kept set)
            here = (rows_K >= s) & (rows_K < e)
            p.index_put_((rows_K[here] - s, targets_K[here]), g_K[here], accumulate=True)
            grad_NV[s:e] = p
        return grad_NV, None, None, None, None, None, None
