"""Models: the Qwen3 / Qwen3-MoE shape of a checkpoint, its TorchTitan config and its HF config.

A model is known by its `config.json`: `ModelShape.from_hf_config` reads any size of the two
families (Qwen3ForCausalLM, dense; Qwen3MoeForCausalLM), and the TorchTitan model and the HF
config both derive from that shape. Short names (`Qwen3-30B-A3B`, `Qwen3-0.6B`, ...) map to their
Hub ids; `minirl.models.hub` fetches them.

The tiny default is the Qwen3-MoE architecture in miniature (QK-norm attention with GQA, a softmax
top-k router with route normalisation, 8 experts), so every code path the 30B-A3B run takes
(state-dict adapter, router, experts, vLLM's Qwen3MoeForCausalLM) is exercised on a laptop.

TorchTitan imports stay in this module and in `train.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from minirl.disk.files import read_json
from minirl.errors import UsageError

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The few numbers that define a Qwen3 or Qwen3-MoE; the TorchTitan and HF configs derive from
    them. Dense models have num_experts = 0 and their FFN width in hidden_dim."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    moe_hidden_dim: int = 0
    num_experts: int = 0
    top_k: int = 0
    hidden_dim: int = 0  # dense FFN width
    max_seq_len: int
    rope_theta: float
    tie_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of every layer for one token: the unit of an engine's KV cache."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "ModelShape":
        """The shape a HF `config.json` describes; anything outside the two families fails in one line."""
        archs = cfg.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise UsageError(f"{source}: architectures {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        moe = "Qwen3MoeForCausalLM" in archs
        try:
            if moe and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
                raise UsageError(f"{source}: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) "
                                 "is not supported")
            heads = int(cfg["num_attention_heads"])
            return cls(
                vocab_size=int(cfg["vocab_size"]), dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
                n_heads=heads, n_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                moe_hidden_dim=int(cfg["moe_intermediate_size"]) if moe else 0,
                # transformers 5 writes num_local_experts, the Hub's Qwen3-MoE configs num_experts
                num_experts=int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]) if moe else 0,
                top_k=int(cfg["num_experts_per_tok"]) if moe else 0,
                hidden_dim=0 if moe else int(cfg["intermediate_size"]),
                max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
                rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e6))),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise UsageError(f"{source}: missing {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise UsageError(f"{source}: {e}") from None


TINY = ModelShape(
    vocab_size=32, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
    moe_hidden_dim=128, num_experts=8, top_k=2, max_seq_len=64, rope_theta=10000.0,
)
QWEN3_30B_A3B = ModelShape(
    vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    moe_hidden_dim=768, num_experts=128, top_k=8, max_seq_len=40960, rope_theta=1000000.0,
)

def _qwen3(dim: int, layers: int, heads: int, kv: int, hidden: int, tied: bool) -> ModelShape:
    return ModelShape(vocab_size=151936, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, head_dim=128,
                      hidden_dim=hidden, max_seq_len=40960, rope_theta=1000000.0, tie_embeddings=tied)


# The published shapes of the short names (their config.json), so a plan needs no download;
# tests/test_plan.py checks each against TorchTitan's own flavor of the same model.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "Qwen3-0.6B": _qwen3(1024, 28, 16, 8, 3072, True),
    "Qwen3-1.7B": _qwen3(2048, 28, 16, 8, 6144, True),
    "Qwen3-4B": _qwen3(2560, 36, 32, 8, 9728, True),
    "Qwen3-8B": _qwen3(4096, 36, 32, 8, 12288, False),
    "Qwen3-14B": _qwen3(5120, 40, 40, 8, 17408, False),
    "Qwen3-30B-A3B": QWEN3_30B_A3B,
    "Qwen3-235B-A22B": ModelShape(
        vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
        moe_hidden_dim=1536, num_experts=128, top_k=8, max_seq_len=40960, rope_theta=1000000.0),
}

TINY_ID = "tiny-qwen3-moe"  # the embedded default, built by `minirl init`, never fetched
# Short names -> Hugging Face repo ids (the base models the paper's recipe starts from).
HUB_IDS: dict[str, str] = {
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B-Base",
    "Qwen3-1.7B": "Qwen/Qwen3-1.7B-Base",
    "Qwen3-4B": "Qwen/Qwen3-4B-Base",
    "Qwen3-8B": "Qwen/Qwen3-8B-Base",
    "Qwen3-14B": "Qwen/Qwen3-14B-Base",
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B-Base",
    "Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B",
}


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
            w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            offs_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.to(w1.dtype)
            gate_RF = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs_E)
            up_RF = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs_E)
            return torch._grouped_mm(F.silu(gate_RF) * up_RF, w2.transpose(-2, -1), offs=offs_E).type_as(x_RD)

    return FP32GroupedExperts


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
    bf16 grouped GEMM (CUDA).
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
        if fp32_experts is not None:
            old = layer.moe.routed_experts.inner_experts
            layer.moe.routed_experts.inner_experts = fp32_experts.Config(
                **{f.name: getattr(old, f.name) for f in dataclasses.fields(old)}
            )
        if attn_backend == "sdpa":
            layer.attention.inner_attention = _masked_sdpa_cls().Config()
        # HF/vLLM Qwen3-MoE has no aux-free expert bias; keep routing identical across engines.
        layer.moe.load_balance_coeff = None
    return _model_config(shape, layers)


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


def hf_config_dict(shape: ModelShape, *, bos_id: int, eos_id: int, pad_id: int) -> dict:
    """The `config.json` of the equivalent HF `Qwen3MoeForCausalLM` (or `Qwen3ForCausalLM`, dense)."""
    family = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": shape.moe_hidden_dim,
        "intermediate_size": shape.moe_hidden_dim,
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
    } if shape.is_moe else {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": shape.hidden_dim,
    }
    return {
        **family,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_seq_len,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": shape.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def read_shape(folder) -> ModelShape:
    """The shape of the HF model folder's config.json."""
    from pathlib import Path


    path = Path(folder) / "config.json"
    return ModelShape.from_hf_config(read_json(path, "model config"), source=str(path))


def attention_pair_cost(shape: ModelShape) -> float:
    """Attention's multiply-adds for one (query, key) pair (QKᵀ and PV over every head and layer)
    over one position's matmul multiply-adds (projections, the top-k experts or the MLP, the LM
    head): how `packing.py` weighs a packed row's dense S × S attention against the positions it
    saves. ~3e-3 for the tiny default, ~1e-4 for Qwen3-30B-A3B."""
    attn = shape.dim * shape.head_dim * (2 * shape.n_heads + 2 * shape.n_kv_heads)
    if shape.is_moe:
        ffn = shape.top_k * 3 * shape.dim * shape.moe_hidden_dim + shape.dim * shape.num_experts
    else:
        ffn = 3 * shape.dim * shape.hidden_dim
    per_position = shape.n_layers * (attn + ffn) + shape.dim * shape.vocab_size
    return shape.n_layers * 2 * shape.n_heads * shape.head_dim / per_position


def lora_param_count(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA adapter parameters (A [r, in] and B [out, r] per adapted matrix; per expert for the
    routed experts' three) on the named targets (train/lora.py), for plans (no build needed)."""
    q_out, kv_out, d = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim, shape.dim
    sides = {"q": d + q_out, "k": d + kv_out, "v": d + kv_out, "o": q_out + d,
             "mlp": 3 * (d + shape.hidden_dim) if not shape.is_moe else 0,
             "experts": shape.num_experts * 3 * (d + shape.moe_hidden_dim) if shape.is_moe else 0}
    return shape.n_layers * rank * sum(sides[t] for t in targets)


def active_params(shape: ModelShape) -> int:
    """Parameters a token passes through: all but the experts it is not routed to."""
    if not shape.is_moe:
        return param_count(shape)
    experts = shape.n_layers * shape.num_experts * 3 * shape.dim * shape.moe_hidden_dim
    return param_count(shape) - experts * (shape.num_experts - shape.top_k) // shape.num_experts


def param_count(shape: ModelShape) -> int:
    """Total parameters, for plans and model cards (no build needed)."""
    attn = shape.dim * shape.head_dim * (2 * shape.n_heads + 2 * shape.n_kv_heads) + 2 * shape.head_dim
    if shape.is_moe:
        ffn = shape.num_experts * 3 * shape.dim * shape.moe_hidden_dim + shape.dim * shape.num_experts
    else:
        ffn = 3 * shape.dim * shape.hidden_dim
    per_layer = attn + ffn + 2 * shape.dim
    emb = shape.vocab_size * shape.dim * (1 if shape.tie_embeddings else 2)
    return shape.n_layers * per_layer + emb + shape.dim


# the weights LoRA may adapt (train/lora.py; train.lora.targets names them): attention, a dense
# feed-forward, routed experts; never the router or the embeddings
LORA_TARGETS = ("q", "k", "v", "o", "mlp", "experts")


def lora_targets(targets: str, model: ModelShape | None = None) -> tuple[str, ...]:
    """train.lora.targets as names, in LORA_TARGETS' order; "all": every target `model` has."""
    names = {t.strip() for t in targets.split(",") if t.strip()}
    if "all" in names:
        names = set(lora_widths(model)) if model is not None else set(LORA_TARGETS)
    return tuple(t for t in LORA_TARGETS if t in names)


def lora_widths(model: ModelShape) -> dict[str, int]:
    """Each target's smallest matrix side in this model (what bounds the rank), for the targets it has."""
    attn = {"q": min(model.dim, model.n_heads * model.head_dim), "k": min(model.dim, model.n_kv_heads * model.head_dim),
            "v": min(model.dim, model.n_kv_heads * model.head_dim), "o": min(model.dim, model.n_heads * model.head_dim)}
    if model.is_moe:
        return {**attn, "experts": min(model.dim, model.moe_hidden_dim)}
    return {**attn, "mlp": min(model.dim, model.hidden_dim)}
