"""vLLM's C RMSNorm kernels for its CPU backend, as vLLM IR providers.

vLLM registers its `_C.rms_norm` / `_C.fused_add_rms_norm` providers ("vllm_c") for GPUs only, so
an eager CPU engine computes every RMSNorm natively: a cast to fp32, `pow`, `mean`, `rsqrt`, two
multiplications and two casts back, ~8 small ops where the CPU build ships one kernel. A Qwen3 layer
has four norms (input, post-attention, q and k), so the tiny default runs ~17 a forward.

Registering the same kernels for the CPU ("minirl_cpu", put first by `PRIORITY`, vLLM's own
`kernel_config.ir_op_priority`) makes a rollout faster, and the engine closer to the fp32 trainer
(docs/results/cpu-path.md): the kernel rounds once, after the weight; the native op rounds the
normalised activations to bf16 before multiplying by the weight.

The CPU kernels index rows as if contiguous: a strided view (Qwen3's q/k heads, split out of the
fused qkv projection) is copied first, or its rows are read from the wrong place. The in-place
fused add takes contiguous operands only; anything else stays with vLLM's native op.

Built without AVX-512 (AVX2 only), the kernels convert fp32 to bf16 by truncating, not rounding
to nearest: every bf16 norm is biased toward zero and the engine ends farther from the trainer than
with the native op. A probe at import asks the kernel itself, and bf16 stays with the native op
where it truncates; fp32 is unaffected. Importing this module registers the providers (once per
process).
"""

from __future__ import annotations

from typing import Callable

import torch

from minirl.rollout import vllm_internals

PROVIDER = "minirl_cpu"
PRIORITY = {"rms_norm": [PROVIDER], "fused_add_rms_norm": [PROVIDER]}  # vLLM appends its native op
DTYPES: tuple[torch.dtype, ...] = (torch.float32,)  # and bf16 where the kernels round to nearest (_register)


def rounds_to_nearest(fused_add: Callable[..., None]) -> bool:
    """Whether a fused-add kernel rounds its fp32 sum to bf16 to nearest: 1 + 2⁻⁸·1.5 lies between
    two bf16 values, nearer the upper; truncation gives the lower."""
    x = torch.full((1, 8), 2.0**-8 * 1.5, dtype=torch.float32).to(torch.bfloat16)
    residual = torch.ones(1, 8, dtype=torch.bfloat16)
    fused_add(x, residual, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    return bool((residual == 1 + 2.0**-7).all())


def _fits(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None) -> bool:
    return variance_size is None and weight is not None and weight.dtype == x.dtype and x.dtype in DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
             variance_size: int | None = None) -> torch.Tensor:
    """x / sqrt(mean(x²) + ε) · weight over the last dimension, in fp32, rounded once."""
    x = x.contiguous()
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual ← x + residual; x ← rms_norm(residual) · weight, both in place."""
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def _register() -> None:
    global DTYPES
    vllm_internals.load_kernels()
    if rounds_to_nearest(torch.ops._C.fused_add_rms_norm):
        DTYPES = (torch.bfloat16, torch.float32)
    vllm_internals.register_norm(
        "rms_norm", PROVIDER, rms_norm,
        lambda x, weight, epsilon, variance_size=None: _fits(x, weight, variance_size))
    vllm_internals.register_norm(
        "fused_add_rms_norm", PROVIDER, fused_add_rms_norm,
        lambda x, x_residual, weight, epsilon, variance_size=None: (
            _fits(x, weight, variance_size) and x_residual.dtype == x.dtype
            and x.is_contiguous() and x_residual.is_contiguous()),
        inplace=True)


_register()
