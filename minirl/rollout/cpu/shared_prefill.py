"""A forward's repeated prompts computed once, on a CPU engine.

vLLM samples a prompt's n completions as n requests, and the step that admits them forwards the
prompt n times. A request whose tokens are all in this forward (none computed before it: no cached
prefix, no earlier chunk) has rows that are a function of its tokens alone, and in a decoder whose
only op across rows is attention, every op but attention computes each row on its own. So the
model runs on the distinct requests' rows, and each attention layer widens its queries, keys and
values back to every row: each copy writes its own KV slots and reads them, as vLLM's own forward
does, and its later decode steps are vLLM's. The copies' output rows are their first copy's.

Where rows are computed alike whatever else a call holds (the suite holds a rollout with this to
one without, bit for bit: tests/test_rollout.py), the numbers are vLLM's; where a kernel rounded a
row differently for another row count, the copies' tokens and log μ still come from the logits
they were sampled from. Installed per worker by a CPU engine (rollout/vllm.py) for the model
classes named below, without LoRA and without R3's route capture (whose rows are the forward's);
`active` turns it off for a comparison.
"""

from __future__ import annotations

import numpy as np
import torch

from minirl.rollout import vllm_internals

active = True  # tests compare an engine's rollout with this on and off
# decoders whose only op across a forward's rows is vLLM's `Attention` layer
MODELS = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (first, copy) of the forward in flight


def repeated_rows(ids: list[int], starts: list[int], seq_lens: list[int], rows: int) -> np.ndarray | None:
    """For each of a forward's `rows`, the row it repeats (itself where it repeats none): request i holds
    rows starts[i]:starts[i+1] and seq_lens[i] tokens in all, and a request with all of them here repeats
    the first such request with the same tokens. None where no request repeats another.

    >>> repeated_rows([5, 6, 7, 5, 6, 9, 5, 6], [0, 2, 3, 5, 6, 8], [2, 4, 2, 7, 2], 9).tolist()
    [0, 1, 2, 0, 1, 5, 0, 1, 8]
    """
    first_of: dict[tuple[int, ...], int] = {}
    src = None
    for i, n in enumerate(seq_lens):
        a, b = starts[i], starts[i + 1]
        if b - a != n:
            continue  # part of its sequence was computed before: its rows read KV not in this forward
        f = first_of.setdefault(tuple(ids[a:b]), a)
        if f != a:
            src = np.arange(rows) if src is None else src
            src[a:b] = np.arange(f, f + n)
    return src


def _plan(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first, copy) of this forward's rows from the attention metadata vLLM set for it: the rows to
    compute and, for every row, which of them it is. None where no request repeats another."""
    layout = vllm_internals.forward_requests()
    if layout is None or positions.dim() != 1:
        return None
    starts, seq_lens = layout
    src = repeated_rows(input_ids.tolist(), starts, seq_lens, input_ids.shape[0])
    if src is None:
        return None
    first, copy = np.unique(src, return_inverse=True)
    return torch.from_numpy(first), torch.from_numpy(copy)


def _forward_distinct(model_forward):
    """The runner's `_model_forward` on the distinct requests' rows, widened back to every row."""

    def forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        global _rows
        plan = None
        if (active and getattr(self, "minirl_shared_prefill", False) and input_ids is not None
                and positions is not None and intermediate_tensors is None and inputs_embeds is None):
            plan = _plan(input_ids, positions)
        if plan is None:
            return model_forward(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        first, copy = plan
        _rows = plan
        try:
            out = model_forward(self, input_ids[first], positions[first], None, None, **kwargs)
        finally:
            _rows = None
        return torch.index_select(out, 0, copy)  # the hidden states: one pipeline stage, none other (install)

    return forward


def _attention_widened(attention_forward):
    """vLLM's `Attention.forward(query, key, value, ...)` on every row of the forward in flight."""

    def forward(self, query, key, value, output_shape=None, output_dtype=None):
        if _rows is None:
            return attention_forward(self, query, key, value, output_shape, output_dtype)
        first, copy = _rows

        def wide(x):
            return None if x is None else torch.index_select(x, 0, copy)

        shape = None if output_shape is None else torch.Size((copy.numel(), *output_shape[1:]))
        out = attention_forward(self, wide(query), wide(key), wide(value), shape, output_dtype)
        return torch.index_select(out, 0, first)

    return forward


def install(worker) -> bool:
    """Repeated requests forwarded once by this worker's runner, where its model is one of MODELS in one
    pipeline stage (whose forward returns the hidden states), it serves no LoRA and captures no routes
    (installing the capture turns this off); whether it is on."""
    runner = worker.model_runner
    on = (type(runner.get_model()).__name__ in MODELS and getattr(runner, "lora_config", None) is None
          and runner.parallel_config.pipeline_parallel_size == 1
          and getattr(worker, "_minirl_routes", None) is None)  # R3's capture (cpu/routes.py) reads every row
    if on:
        vllm_internals.around_model_forward(_forward_distinct, _attention_widened)
    runner.minirl_shared_prefill = on
    return on
