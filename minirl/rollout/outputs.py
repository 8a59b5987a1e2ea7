"""vLLM's outputs in minirl's layouts: the sampled tokens' log μ, and CUDA vLLM's captured routes
as the R3 replay reads them (rollout/cpu/routes.py's layout). Pure conversions, no engine."""

from __future__ import annotations

from collections.abc import Sequence


def sampled_logprobs(token_ids: Sequence[int], flat) -> tuple[float, ...]:
    """log μ of each sampled token from vLLM's `FlatLogprobs` (asked with logprobs=0: the sampled
    token alone at each position, first in its range)."""
    starts = flat.start_indices
    if len(starts) != len(token_ids) or any(flat.token_ids[s] != t for s, t in zip(starts, token_ids)):
        raise RuntimeError(f"vLLM returned log-probs for {len(starts)} positions that are not the "
                           f"{len(token_ids)} sampled tokens")
    return tuple(flat.logprobs[s] for s in starts)


def moe_layer_ids(hf_config) -> list[int]:
    """Decoder layers with routed experts, by HF Qwen3-MoE's rule (all of them for dense-free MoE)."""
    n, experts = hf_config.num_hidden_layers, getattr(hf_config, "num_experts", 0) or 0
    if experts <= 0:
        return []
    step, dense = getattr(hf_config, "decoder_sparse_step", 1) or 1, set(getattr(hf_config, "mlp_only_layers", []) or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def routes_from_vllm(rows, moe_layers: Sequence[int]):
    """CUDA vLLM's `CompletionOutput.routed_experts` -> the CPU capture's layout.

    vLLM (0.32, `RoutedExpertsCapturer`): [positions, every decoder layer, top_k], uint8 (≤ 256
    experts) or uint16, one row per position fed through the model (prompt and response, the last
    sampled token excluded), dense layers' rows left zero. rollout/cpu/routes.py: [positions, MoE layers,
    top_k] int16. None (vLLM returned nothing) stays None; the caller's length check reports it."""
    if rows is None:
        return None
    import numpy as np

    rows = np.asarray(rows)
    if rows.ndim != 3 or rows.shape[1] <= max(moe_layers, default=-1):
        raise RuntimeError(f"vLLM routed_experts of shape {rows.shape}: expected [positions, layers, top_k] "
                           f"covering MoE layers {list(moe_layers)[:4]}...")
    return np.ascontiguousarray(rows[:, list(moe_layers)].astype(np.int16))
