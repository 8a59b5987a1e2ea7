"""How large a rollout engine is made for a job, in one place: the context it serves, the sequences
it schedules at once, the KV cache that holds them and the working memory around it. The plan
(setup/plan.py), the validator and the engine (rollout/vllm.py) all ask here, so the figures a dry
run prints are the ones the run gives vLLM.

On a GPU vLLM takes `gpu_memory_utilization` × the device's memory for itself (its weights, its
working memory, and the KV cache in what is left), and refuses to start when less than that is free
(vllm/v1/worker/utils.py, `request_memory`). That fraction is therefore a budget decided before the
engine starts, beside whatever the trainer holds by then: the plan derives it (`rollout.memory_fraction
= 0`) or checks the recipe's.
"""

from __future__ import annotations

import os

from minirl.models.shapes import ModelShape

CPU_KV_BLOCK = 128  # tokens in a block of vLLM's CPU KV cache by default (vllm/platforms/cpu.py): minirl's largest
CPU_KV_ALIGN = 32  # vLLM's CPU attention kernels take blocks of a multiple of 32 tokens
CUDA_KV_BLOCK = 16  # vLLM's default block on CUDA attention backends
MIN_SEQS = 256  # an engine schedules at least this many sequences at once (vLLM's own default)
# vLLM's memory on a GPU besides weights and KV cache: the profile run's activations, workspaces
# and CUDA graphs (vLLM counts the graphs inside its budget: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS),
# plus the sampler's fp32 [sequences, vocab] tensors. An assumption until a GPU measures it (the
# GPU check records what vLLM reports): 2 GiB, and three such tensors.
WORKING_FIXED = 2 * 2**30
SAMPLER_COPIES = 3


def max_samples_per_prompt() -> int:
    """The most samples of one prompt vLLM takes in a request (SamplingParams' n: VLLM_MAX_N_SEQUENCES,
    16,384 unless set): the bound of train.group_size and eval.k."""
    return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))


def max_model_len(rec) -> int:
    """Positions one sequence of the run may take: the longest prompt, the longest response and the
    position the last sampled token is fed at; a multi-turn episode's replies besides (env.max_turns − 1
    of env.max_reply_tokens at most)."""
    replies = (rec.env.max_turns - 1) * rec.env.max_reply_tokens if rec.env.name else 0
    return rec.data.max_prompt_tokens + rec.rollout.max_tokens + 1 + replies


def max_num_seqs(rec, engines: int = 1) -> int:
    """Sequences a run's engine may schedule at once: its share of a step's B × G (the step's
    sequences over the job's `engines`), at least MIN_SEQS; an engine that keeps stepping across
    calls (rollout.inflight_updates) holds the k + 1 batches the bound lets be in flight."""
    batches = rec.rollout.max_staleness + 1 if rec.rollout.inflight_updates else 1
    return max(MIN_SEQS, -(-rec.train.prompts_per_step * rec.train.group_size * batches // engines))


def kv_cache_bytes(model: ModelShape, sequences: int, tokens: int, dtype_bytes: int, *, block: int,
                   tensor_parallel: int = 1) -> int:
    """The KV cache (per GPU of a tensor-parallel engine, whose KV heads it splits) that holds
    `sequences` sequences of up to `tokens` tokens at once: whole blocks for each, and the one block
    vLLM keeps empty."""
    blocks = sequences * -(-tokens // block) + 1
    return blocks * block * model.kv_bytes_per_token(dtype_bytes) // tensor_parallel


def cpu_kv_block(tokens: int) -> int:
    """Tokens in a block of a CPU engine's KV cache for sequences of up to `tokens` tokens: the
    fewest multiple of 32 that holds a whole sequence, at most vLLM's 128. A decode step's attention
    reads, and its cache write touches, the blocks a sequence holds; a block no longer than the
    sequence is less of both and a smaller cache (docs/results/speed.md)."""
    return min(CPU_KV_BLOCK, -(-tokens // CPU_KV_ALIGN) * CPU_KV_ALIGN)


def cpu_kv_cache_bytes(model: ModelShape, sequences: int, tokens: int, dtype_bytes: int, *, block: int = 0) -> int:
    """The KV cache vLLM's CPU backend needs to hold `sequences` sequences of up to `tokens` tokens
    at once, in blocks of `block` tokens (0: `cpu_kv_block(tokens)`, the engine's own)."""
    return kv_cache_bytes(model, sequences, tokens, dtype_bytes, block=block or cpu_kv_block(tokens))


def working_bytes(model: ModelShape, sequences: int) -> int:
    """vLLM's working memory on a GPU for an engine scheduling `sequences` at once (an estimate:
    WORKING_FIXED and SAMPLER_COPIES say of what)."""
    return WORKING_FIXED + SAMPLER_COPIES * sequences * model.vocab_size * 4


def fraction(engine_bytes: float, total_bytes: float, *, limit: float | None = None) -> float:
    """`gpu_memory_utilization` for an engine of `engine_bytes` on a device of `total_bytes`: rounded
    up to a thousandth, but never asking more than `limit` bytes (vLLM asks ⌈total × fraction⌉ and
    refuses to start when less is free), never above 1."""
    up = -(-round(engine_bytes / total_bytes * 1e6) // 1000) / 1000
    if limit is not None:
        up = min(up, int(limit / total_bytes * 1000) / 1000)
    return min(1.0, up)
