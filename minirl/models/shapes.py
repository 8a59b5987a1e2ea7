"""Models: the Qwen3 / Qwen3-MoE shape of a checkpoint, its sizes and its HF config.

A model is known by its `config.json`: `ModelShape.from_hf_config` reads any size of the two
families (Qwen3ForCausalLM, dense; Qwen3MoeForCausalLM), and the TorchTitan model (models/titan.py)
and the HF config both derive from that shape. Short names (`Qwen3-30B-A3B`, `Qwen3-0.6B`, ...)
map to their Hub ids; `minirl.models.hub` fetches them.

The tiny default is the Qwen3-MoE architecture in miniature (QK-norm attention with GQA, a softmax
top-k router with route normalisation, 8 experts), so every code path the 30B-A3B run takes
(state-dict adapter, router, experts, vLLM's Qwen3MoeForCausalLM) is exercised on a laptop.
"""

from __future__ import annotations

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
