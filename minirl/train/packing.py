"""Shared-prompt packing: a group's prompt is forwarded once, and its responses attend to it.

A GRPO batch repeats every prompt x for its G responses y_1..y_G. Attention being causal, the
hidden states of x do not depend on what follows it, so the G copies compute the same thing.
Packed, one row holds x once and then several responses, each without its last token (a last
token predicts nothing):

    tokens     x_0 x_1 x_2 | a_0 a_1 | b_0 b_1 b_2        (responses a = a_0..a_2, b = b_0..b_3)
    positions   0   1   2  |  3   4  |  3   4   5         (every response restarts after x)
    attends    causal over x; a_k sees x and a_<=k; b_k sees x and b_<=k, never a

so every response token gets the logits it gets in its own right-padded row (to float rounding;
tests/test_packing.py). The logits of x's last token predict the first token of every response in
the row. The idea is "Prefix Grouper" (Liu et al., 2025) on minirl's right-padded batches.

Two more things a response's logits do not depend on:
- a response its group already holds token for token (a twin; with the same kept counts where the
  sampler cut) computes what its first copy computes: it is not packed again, and its targets read
  the first copy's positions. Its loss terms stay its own (its row's advantage, log μ and mask, in
  the batch's layout), and their gradients add up at the shared positions: the batch's gradient
  to float rounding. A policy that has learned an answer writes it G times over;
- other prompts in the same row, which it never attends to: the chunks (a prompt and responses to
  it) are laid into rows as wide as the longest chunk, several to a row where they fit
  (`best_fit`), so rows with few distinct responses do not each pad to the longest.

On the embedded default (32 prompts × 8 responses, 8-token prompts, ~5-token responses) the model
sees at most ~1,300 positions instead of ~3,300, and fewer as its policy repeats its answers
(figures: docs/results/speed.md, docs/results/cpu-path.md).

The logits of a packed batch are read per target (`Trainer._forward_logp`): one logsumexp per
packed position, picked by index, so no [targets, vocab] copy of them is made.

Packing trades positions for attention: a packed row attends over all S² pairs of its dense
mask, where an unpacked row's causal attention skips half of its T². A batch is packed only where
its estimated cost, positions + `pair_cost` × attention pairs, is at least 10% below the unpacked
one (`pair_cost`: one pair's attention work over one position's matmuls, from the model's shape,
`models.attention_pair_cost`). For the tiny model that packs the default task (cost 0.41 of
unpacked) and not the long-response one (1.3: 12-token prompts, ~35-token responses; slower
packed), nor a batch without shared prompts. For a 30B-A3B the attention of a pair
weighs ~1e-4 of a position, so rows up to `max_len` pack wherever prompts are shared. Rows longer
than `max_len` are never packed: the mask is dense.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

MAX_LEN = 1024  # positions per packed row


@dataclass(frozen=True, slots=True)
class Packed:
    """A batch of B right-padded rows of length L (T = L - 1 fed positions), packed into C rows of S.

    tokens_CS:     int64 [C, S]        the packed rows, padded with the pad id
    positions_CS:  int64 [C, S]        RoPE position of each token in its own sequence
    attend_C1SS:   bool  [C, 1, S, S]  attend_C1SS[c, 0, a, b]: position a may attend to position b
    src_N:         int64 [N]           flat index into C·S of the position whose logits predict target n
    dst_N:         int64 [N]           flat index into B·T of target n in the batch's own layout
    target_N:      int64 [N]           the token predicted
    """

    tokens_CS: torch.Tensor
    positions_CS: torch.Tensor
    attend_C1SS: torch.Tensor
    src_N: torch.Tensor
    dst_N: torch.Tensor
    target_N: torch.Tensor
    B: int
    T: int

    def unpack(self, values_N: torch.Tensor) -> torch.Tensor:
        """Per-target values laid out like the batch, [B, T], zero where nothing is predicted
        (prompt and padding positions). Differentiable."""
        out = values_N.new_zeros(self.B * self.T)
        return out.index_put((self.dst_N,), values_N).view(self.B, self.T)

    def to(self, device: torch.device) -> "Packed":
        moved = {f: getattr(self, f).to(device, non_blocking=True)
                 for f in ("tokens_CS", "positions_CS", "attend_C1SS", "src_N", "dst_N", "target_N")}
        return Packed(**moved, B=self.B, T=self.T)


def best_fit(lengths: list[int], width: int) -> list[list[int]]:
    """Indices of `lengths` in bins of `width`, longest first, each into the fullest bin it fits
    (best-fit decreasing: few bins, in n log n).

    >>> best_fit([5, 9, 4, 3, 6], 9)
    [[1], [4, 3], [0, 2]]
    """
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        at = bisect.bisect_left(room, (lengths[k], -1))
        if at == len(room):
            bins.append([])
            left, c = width, len(bins) - 1
        else:
            left, c = room.pop(at)
        bins[c].append(k)
        bisect.insort(room, (left - lengths[k], c))
    return bins


def pack_shared_prompts(
    tokens_BL: torch.Tensor,
    prompt_len_B: torch.Tensor,
    seq_len_B: torch.Tensor,
    *,
    pad_id: int = 0,
    max_len: int = MAX_LEN,
    pair_cost: float = 0.0,
    kept_BT: torch.Tensor | None = None,
) -> Packed | None:
    """Rows with the same prompt (anywhere in the batch) share one copy of it per packed row, as
    many responses to a row as fit in `max_len` positions, and a response its group already holds
    token for token (a twin: with the same kept counts where the sampler cut, `kept_BT`) reads the
    first copy's positions. Packed rows take several prompts where they fit (see the module
    docstring). None where packing does not pay: the caller forwards the batch as it is."""
    B, L = tokens_BL.shape
    T = L - 1
    rows = tokens_BL.tolist()
    kept = kept_BT.tolist() if kept_BT is not None else None
    n_p_B, n_B = prompt_len_B.tolist(), seq_len_B.tolist()
    if T > max_len or B == 0 or min(n_p_B) < 1:
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(B):
        groups.setdefault(tuple(rows[i][: n_p_B[i]]), []).append(i)

    twins: dict[int, list[int]] = {}  # a group's first copy of a response -> the rows that repeat it
    chunks: list[tuple[tuple[int, ...], list[int], int]] = []  # (prompt, its distinct rows, length) per chunk
    for prompt, members in groups.items():
        n_p = len(prompt)
        first: dict[tuple, int] = {}
        length, current = n_p, []
        for i in members:
            key = (tuple(rows[i][n_p : n_B[i]]), tuple(kept[i][n_p - 1 : n_B[i] - 1]) if kept else ())
            if key in first:
                twins[first[key]].append(i)
                continue
            first[key] = i
            twins[i] = []
            cost = max(n_B[i] - n_p - 1, 0)  # the response's tokens but its last
            if current and length + cost > max_len:
                chunks.append((prompt, current, length))
                length, current = n_p, []
            current.append(i)
            length += cost
        chunks.append((prompt, current, length))
    S = max(length for *_, length in chunks)  # the longest chunk: no packed row is longer
    bins = best_fit([length for *_, length in chunks], S)
    C = len(bins)
    if C * S + pair_cost * C * S * S > 0.9 * (B * T + pair_cost * B * T * T / 2):
        return None

    # per position: its segment, a prompt or a response, named by where it starts in the row (-2: padding),
    # and the segment of the prompt it belongs to (-3: padding)
    tokens, positions, segment, own_prompt = [], [], [], []
    src, dst, target = [], [], []
    for c, members in enumerate(bins):
        base = c * S
        tok, pos, seg, own = [], [], [], []
        for k in members:
            prompt, distinct, _ = chunks[k]
            n_p, p_seg = len(prompt), len(tok)
            start = base + p_seg
            tok += prompt
            pos += range(n_p)
            seg += [p_seg] * n_p
            own += [p_seg] * n_p
            for i in distinct:
                resp = rows[i][n_p : n_B[i]]
                m = len(resp)
                if m == 0:
                    continue
                r_seg = len(tok)
                tok += resp[:-1]
                pos += range(n_p, n_p + m - 1)
                seg += [r_seg] * (m - 1)
                own += [p_seg] * (m - 1)
                # response token k is predicted by the prompt's last token (k = 0) or by token k - 1
                for r in (i, *twins[i]):
                    src += [start + n_p - 1, *range(base + r_seg, base + r_seg + m - 1)]
                    dst += range(r * T + n_p - 1, r * T + n_p - 1 + m)
                    target += resp
        pad = S - len(tok)
        tokens.append(tok + [pad_id] * pad)
        positions.append(pos + [0] * pad)
        segment.append(seg + [-2] * pad)
        own_prompt.append(own + [-3] * pad)
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    tokens, positions, segment, own_prompt = as_long(tokens), as_long(positions), as_long(segment), as_long(own_prompt)
    idx = torch.arange(S)
    causal_SS = idx[None, :] <= idx[:, None]
    seg_b = segment[:, None, :]
    # a token sees its own segment and its own prompt, causally: a response never another response or
    # another prompt of the row; padding sees the padding before it
    attend = causal_SS[None] & ((seg_b == segment[:, :, None]) | (seg_b == own_prompt[:, :, None]))
    return Packed(tokens, positions, attend[:, None], as_long(src), as_long(dst), as_long(target), B=B, T=T)
