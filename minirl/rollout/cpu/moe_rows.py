"""vLLM's CPU MoE experts computed once per distinct row of a forward.

vLLM samples a prompt's n completions as n requests: a step's prefill forwards each prompt n times,
and completions that have sampled the same tokens so far forward the same rows again at each
decode step. An expert output is a function of its row alone (the CPU kernel computes each row on
its own, whatever else the call holds: tests/test_rollout.py holds a rollout with this to one
without, bit for bit), so the experts can run on the distinct rows and each copy read its row's
result: the same numbers for fewer rows of the costliest kernel of a tiny MoE's forward.

Rows are matched by a hash and then compared whole; where the rows are all distinct, or a hash
matched two rows that differ, the call is vLLM's own on every row. Installed once per process by a
CPU engine (rollout/vllm.py); `active` turns it off for a comparison.
"""

from __future__ import annotations

import functools

import torch

from minirl.rollout import vllm_internals

active = True  # tests compare an engine's rollout with this on and off
_HASH_SPAN = 2**20  # the hash's weights: an int16 word × 2^20 × 2^18 words stays below 2^53, exact in fp64


def distinct_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first, copy) for the rows of a 2-D tensor: the index of each distinct row's first occurrence
    and, for every row, which distinct row it is (x == x[first][copy], bit for bit). None where every
    row is distinct, where the hash joins rows that differ, or where the rows cannot be read as at most
    2^18 16-bit words (the hash's exact range)."""
    if x.dim() != 2 or not x.is_contiguous() or x.element_size() % 2 or x.shape[0] < 2:
        return None
    if x.shape[1] * x.element_size() // 2 > 2**18:
        return None
    words = x.view(torch.int16)
    weights = _weights(words.shape[1])
    # integer words × integer weights, summed in fp64 below 2^53: exact in any order, so equal rows
    # hash equal; unequal rows that collide are caught by the comparison below
    key = words.to(torch.float64) @ weights
    keys, copy = torch.unique(key, return_inverse=True)
    rows = x.shape[0]
    if keys.numel() == rows:
        return None
    first = torch.full((keys.numel(),), rows, dtype=torch.long).scatter_reduce_(0, copy, torch.arange(rows), "amin")
    if not torch.equal(torch.index_select(words, 0, first[copy]), words):
        return None
    return first, copy


@functools.cache
def _weights(width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(width)
    return torch.randint(1, _HASH_SPAN, (width,), generator=gen).to(torch.float64)


def _on_distinct_rows(apply):
    """vLLM's `apply(output, hidden_states, w1, w2, topk_weights, topk_ids, ...)`, which writes
    `output` in place, run on the distinct rows of `hidden_states` where their copies' routes are
    theirs too (the router's, from the same row)."""

    def distinct_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs):
        found = distinct_rows(hidden_states) if active and output.is_contiguous() else None
        if found is None:
            return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs)
        first, copy = found
        weights, ids = topk_weights[first], topk_ids[first]
        if not (torch.equal(weights[copy], topk_weights) and torch.equal(ids[copy], topk_ids)):
            return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs)
        out = output.new_empty((first.numel(), *output.shape[1:]))
        apply(self, out, hidden_states[first], w1, w2, weights.contiguous(), ids.contiguous(), *args, **kwargs)
        torch.index_select(out, 0, copy, out=output)

    return distinct_apply


def install() -> None:
    """The CPU experts on distinct rows in this process, once."""
    vllm_internals.around_cpu_experts(_on_distinct_rows)
