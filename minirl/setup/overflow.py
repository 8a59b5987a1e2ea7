"""What a plan's refusal says (setup/plan.py, setup/engine_share.py): the GPU memory a plan may use, the
largest part of a phase that overflows and the setting that shrinks it, and the most that fits."""

from __future__ import annotations

import math

GiB = 2**30
HEADROOM = 0.9  # of a GPU's memory a plan may use (allocator fragmentation, CUDA context, NCCL buffers)


def most_gib(nbytes: float) -> str:
    """GiB to one decimal, rounded down: the most a refusal names must fit (#82).

    >>> most_gib(1.99 * GiB)
    '1.9'
    """
    return f"{math.floor(max(0.0, nbytes) / GiB * 10) / 10:.1f}"


# what shrinks each part of a phase (the refusal's advice)
REMEDY = {
    "fp32 weights (sharded)": "more GPUs (--nodes, --gpus-per-node): FSDP2 shards it over all of them",
    "fp32 gradients (sharded)": "more GPUs (--nodes, --gpus-per-node): FSDP2 shards it over all of them",
    "Adam moments (sharded)": 'train.offload = "optimizer" (host memory between updates), or more GPUs',
    "gathered bf16 layers": "raise parallel.ep (a GPU gathers only its share of the experts)",
    "activations (no AC)": 'set train.activation_checkpoint = "full", or lower train.micro_batch_tokens',
    "activations (full AC)": "lower train.micro_batch_tokens",
    "logits": "lower train.micro_batch_tokens",
    "weight sync bucket": "lower rollout.sync_bucket_mib",
    "weight broadcast bucket": "lower rollout.sync_bucket_mib",
    "weight copies queued for the engine (k ≥ 1)": "lower rollout.max_staleness",
    "vLLM working memory (estimate)":
        "fewer sequences a step (train.prompts_per_step × train.group_size: the sampler's rows)",
    "largest parameter gathered in fp32": "a GPU with more memory (it is gathered whole)",
    "base weights (bf16, frozen, sharded)": "more GPUs (--nodes, --gpus-per-node): FSDP2 shards it over all of them",
    "base weights (fp32, frozen, sharded)": 'train.param_dtype = "bfloat16" (the frozen base in bf16), or more GPUs',
    "fp32 LoRA adapters (sharded)": "a lower train.lora.rank, or fewer train.lora.targets",
    "fp32 LoRA gradients (sharded)": "a lower train.lora.rank, or fewer train.lora.targets",
    "Adam moments of the adapters (sharded)": 'train.offload = "optimizer", or a lower train.lora.rank',
}


def largest_part(parts: dict[str, float], r, *, offloaded: dict | None = None) -> str:
    """'the largest part is NAME (X GiB): what shrinks it'; `offloaded`: the parts already in host
    memory between updates."""
    name, size = max(parts.items(), key=lambda kv: kv[1])
    if name in (offloaded or {}):  # back on the GPU only for the step
        return f"the largest part is {name} ({size / GiB:.1f} GiB, on the GPU for the step): more GPUs"
    if name.startswith("vLLM weights"):
        fixes = [f"raise rollout.tensor_parallel ({r.tensor_parallel})"] if r.tensor_parallel < 8 else []
        fixes += ['set rollout.precision = "fp8"'] if r.precision != "fp8" else []
        remedy = " or ".join(fixes) or "more GPUs per engine"
    else:
        remedy = REMEDY.get(name, "more GPUs")
    return f"the largest part is {name} ({size / GiB:.1f} GiB): {remedy}"
