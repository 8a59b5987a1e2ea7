"""The TorchTitan model of a `ModelShape` (its `Qwen3Model.Config`), and the modules minirl puts in it
for a CPU trainer.

TorchTitan's Qwen3 / Qwen3-MoE model is built for CUDA; three of its modules are swapped for
subclasses here, each computing the same function: routed experts in the parameters' dtype
(`_fp32_grouped_experts_cls`), attention with the explicit mask of shared-prompt packing and an
optional KV cache (`_masked_sdpa_cls`, `kv_cache`), and on a CPU the MoE's token gather and combine by
index (`_index_dispatcher_cls`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

from minirl.models.shapes import ModelShape


@functools.cache
def _fp32_grouped_experts_cls():
    """TorchTitan's GroupedExperts casts to bf16 for its CUDA grouped GEMM. On CPU that path is ~2x
    slower than fp32 (strided bf16 matmuls) and adds a second precision gap inside the trainer, so
    the CPU trainer computes experts in the parameters' dtype. Same weights, same routing."""
    import torch
    import torch.nn.functional as F
    from torchtitan.models.common.moe import GroupedExperts

    class FP32GroupedExperts(GroupedExperts):
        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            from torch.distributed.tensor import DTensor

            # under expert parallelism the weights are DTensors sharded over experts: compute on
            # this rank's experts, as the parent class does
            w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                          for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            offs_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.to(w1.dtype)
            gate_RF = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs_E)
            up_RF = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs_E)
            return torch._grouped_mm(F.silu(gate_RF) * up_RF, w2.transpose(-2, -1), offs=offs_E).type_as(x_RD)

    return FP32GroupedExperts


@functools.cache
def _index_dispatcher_cls():
    """TorchTitan's token dispatcher, gathering and combining by index on a CPU. Its own gathers the
    tokens for their experts with `x[idx]`, whose backward is an accumulating `index_put`, and sums
    each token's expert outputs with a deterministic `scatter_add` (for CUDA, where `index_add_` uses
    atomics). On a CPU `index_select` and `index_add` run the same additions in the same order, in a
    fraction of the time (docs/results/speed.md): bit for bit the same outputs and gradients
    (tests/test_train.py). On other devices, and to exchange tokens under expert parallelism, it
    is TorchTitan's own."""
    import torch
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    class IndexAdd(torch.autograd.Function):
        """`zeros(rows, D).index_add(0, index_N, source_ND)` keeping only the index for backward.
        Autograd's own `index_add` also saves `source` (its formula reads only the source's shape):
        the routed outputs, top_k rows of D a token in every MoE layer, which TorchTitan's scatter
        does not keep and the plan's activations do not count (docs/cluster.md). The gradient is
        autograd's formula for it, `grad.index_select(0, index_N)`: the same bits."""

        @staticmethod
        def forward(ctx, index_N, source_ND, like_TD):
            ctx.save_for_backward(index_N)
            return torch.zeros_like(like_TD).index_add(0, index_N, source_ND)

        @staticmethod
        def backward(ctx, grad_TD):
            (index_N,) = ctx.saved_tensors
            return None, grad_TD.index_select(0, index_N), None

    class IndexTokenDispatcher(AllToAllTokenDispatcher):
        @dataclass(kw_only=True, slots=True)
        class Config(AllToAllTokenDispatcher.Config):
            pass

        def _local_reorder(self, x_TD, topk_scores_TK, topk_expert_ids_TK):
            if x_TD.device.type != "cpu":
                return super()._local_reorder(x_TD, topk_scores_TK, topk_expert_ids_TK)
            order_N = torch.argsort(topk_expert_ids_TK.view(-1), stable=True)  # N = T·K, grouped by expert
            scores_N = topk_scores_TK.view(-1).index_select(0, order_N)
            token_N = order_N // self.top_k
            return x_TD.index_select(0, token_N), token_N, scores_N

        def combine(self, routed_output_RD, metadata, x_TD):
            if self.ep_mesh is not None or x_TD.device.type != "cpu":
                return super().combine(routed_output_RD, metadata, x_TD)
            scored_RD = (routed_output_RD.to(torch.float32)
                         * metadata.topk_scores_experts_sorted_N.reshape(-1, 1)).to(routed_output_RD.dtype)
            return IndexAdd.apply(metadata.token_indices_experts_sorted_N, scored_RD, x_TD.detach())

    return IndexTokenDispatcher


def repeat_kv_heads(k_BNLH, v_BNLH, n_heads: int):
    """K and V with each KV head repeated for its query heads (head h reads KV head h // (n_heads /
    n_kv_heads)), as SDPA's `enable_gqa` reads them."""
    return tuple(t.repeat_interleave(n_heads // t.shape[1], dim=1) for t in (k_BNLH, v_BNLH))


@functools.cache
def _masked_sdpa_cls():
    """TorchTitan's SDPA inner attention, plus an explicit boolean mask when one is passed (a
    [B, 1, L, L] tensor as `attention_masks`): the shared-prompt packing of `packing.py`. Without
    one it is the stock causal SDPA. Inside `kv_cache(model)` it keeps the keys and values it has
    seen, for decoding one token at a time."""
    import torch
    import torch.nn.functional as F
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class MaskedSDPA(ScaledDotProductAttention):
        @dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            pass

        kv: list | None = None  # [k_BLNH, v_BLNH] so far, inside kv_cache(); None: no cache

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                    is_causal=True, **kwargs):
            if self.kv is not None:
                if self.kv:  # one new token: it sees every cached position (a causal mask would hide them)
                    assert q_BLNH.shape[1] == 1, "the cache decodes one token per call after the prompt"
                    k_BLNH, v_BLNH = (torch.cat([old, new], dim=1) for old, new in zip(self.kv, (k_BLNH, v_BLNH)))
                    is_causal = False
                self.kv[:] = [k_BLNH, v_BLNH]
            if attention_masks is None:
                return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa,
                                       is_causal=is_causal, **kwargs)
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
            if enable_gqa and q.device.type != "cpu":
                # CUDA's kernel for masks (memory-efficient) takes no GQA; the math fallback would
                # keep every S × S score for backward. Repeat the KV heads instead (CPU flash
                # takes both)
                k, v, enable_gqa = *repeat_kv_heads(k, v, q.shape[1]), False
            out_BNLH = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale,
                                                      enable_gqa=enable_gqa)
            return out_BNLH.transpose(1, 2)

    return MaskedSDPA


@contextlib.contextmanager
def kv_cache(model):
    """Decode with a KV cache: inside, the model's first call reads the prompt (causal) and each
    later call one new token per row at `positions` [[t]], attending to everything before it; the
    keys and values are dropped on leaving. For sampling outside an engine (the cold start's dev
    check): vLLM is the engine for rollouts."""
    inner = [m for m in model.modules() if isinstance(m, _masked_sdpa_cls())]
    if not inner:
        raise ValueError("kv_cache needs the model built with attn_backend='sdpa' (MaskedSDPA)")
    for m in inner:
        m.kv = []
    try:
        yield
    finally:
        for m in inner:
            m.kv = None


def titan_config(shape: ModelShape, *, attn_backend: str = "sdpa", expert_dtype: str = "float32"):
    """The TorchTitan `Qwen3Model.Config` for `shape`.

    expert_dtype "float32" computes routed experts in fp32 (CPU); "bfloat16" keeps TorchTitan's
    bf16 grouped GEMM (CUDA). The MoE's tokens reach their experts through `_index_dispatcher_cls`
    (TorchTitan's standard exchange, by index on a CPU).
    attn_backend "sdpa" swaps each layer's inner attention for plain causal SDPA: TorchTitan's LM
    backends (flex, varlen) have no backward on CPU (PLATFORM.md). Batches are right-padded and
    causal, so padding never leaks into real positions; packed batches (packing.py) pass their mask.
    """
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_layers, _build_qwen3_moe_layers

    common = dict(
        n_layers=shape.n_layers, dim=shape.dim, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim, fuse_qkv=False, attn_backend="flex" if attn_backend == "sdpa" else attn_backend,
        rope=CosSinRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta),
    )
    if not shape.is_moe:
        layers = _build_qwen3_layers(hidden_dim=shape.hidden_dim, **common)
        for layer in layers:
            if attn_backend == "sdpa":
                layer.attention.inner_attention = _masked_sdpa_cls().Config()
        return _model_config(shape, layers)
    layers = _build_qwen3_moe_layers(moe_hidden_dim=shape.moe_hidden_dim, num_experts=shape.num_experts,
                                     top_k=shape.top_k, moe_comm_backend="standard", **common)
    fp32_experts = _fp32_grouped_experts_cls() if expert_dtype == "float32" else None
    for layer in layers:
        routed = layer.moe.routed_experts
        if fp32_experts is not None:
            routed.inner_experts = _same_fields(routed.inner_experts, fp32_experts.Config)
        routed.token_dispatcher = _same_fields(routed.token_dispatcher, _index_dispatcher_cls().Config)
        if attn_backend == "sdpa":
            layer.attention.inner_attention = _masked_sdpa_cls().Config()
        # HF/vLLM Qwen3-MoE has no aux-free expert bias; keep routing identical across engines.
        layer.moe.load_balance_coeff = None
    return _model_config(shape, layers)


def _same_fields(config, cls):
    """`config` as a `cls` (a subclass of its config class) with the same fields."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def _model_config(shape: ModelShape, layers: list):
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _qwen3_norm

    return Qwen3Model.Config(
        vocab_size=shape.vocab_size,
        dim=shape.dim,
        norm=_qwen3_norm(shape.dim),
        enable_weight_tying=shape.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size, embedding_dim=shape.dim, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )
