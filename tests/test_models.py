"""The tiny Qwen3-MoE: TorchTitan <-> HF conversion through TorchTitan's adapter, and parity with
transformers' own Qwen3MoeForCausalLM on the converted folder."""

import pytest
import torch

from minirl.hf_io import hf_to_titan, load_hf_weights, titan_to_hf
from minirl.models import QWEN3_30B_A3B, TINY, ModelShape, hf_config_dict, param_count, titan_config
from minirl.train import Trainer


def test_tiny_is_a_real_qwen3_moe():
    cfg = titan_config(TINY)
    layer = cfg.layers[0]
    assert layer.moe.num_experts == 8 and layer.moe.router.top_k == 2
    assert layer.moe.router.score_func == "softmax" and layer.moe.router.route_norm
    assert layer.attention.qk_norm is not None


def test_param_count_formula_matches_the_built_model():
    model = titan_config(TINY).build()
    assert param_count(TINY) == sum(p.numel() for p in model.parameters())


def test_30b_shape_has_the_published_size():
    assert 30.0e9 < param_count(QWEN3_30B_A3B) < 31.0e9  # "30B" total, per the model card


def test_round_trip_titan_hf_titan_is_exact():
    tr = Trainer(TINY, lr=1e-3, seed=1)
    sd = {k: v.clone() for k, v in tr.model.state_dict().items()}
    hf = titan_to_hf(TINY, sd)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in hf
    assert hf["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (TINY.moe_hidden_dim, TINY.dim)
    back = hf_to_titan(TINY, hf)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_transformers_parity_on_converted_folder(tiny_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    tr = Trainer(TINY, lr=1e-3)
    tr.load_hf(tiny_dir)
    x = torch.randint(3, TINY.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(x).logits - tr.model(x)).abs().max().item()
    assert diff < 1e-4, diff
    # and the folder's safetensors are what the trainer exports
    exported = tr.hf_state_dict()
    on_disk = load_hf_weights(tiny_dir)
    assert exported.keys() == on_disk.keys()
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)


def test_a_model_too_large_for_one_process_is_refused_before_any_download():
    from minirl.errors import UsageError
    from minirl.preflight import check_fits

    check_fits(TINY, "tiny-qwen3-moe")
    with pytest.raises(UsageError, match=r"30\.53B parameters: one process needs ~512 GiB .* multi-GPU path"):
        check_fits(QWEN3_30B_A3B, "Qwen3-30B-A3B")


DENSE = ModelShape(vocab_size=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96,
                   max_seq_len=64, rope_theta=1e4)
OTHER_MOE = ModelShape(vocab_size=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, moe_hidden_dim=32,
                       num_experts=16, top_k=4, max_seq_len=64, rope_theta=1e4)


@pytest.mark.parametrize("shape", [TINY, DENSE, OTHER_MOE], ids=["tiny", "dense", "moe-16x4"])
def test_shape_round_trips_through_config_json(shape):
    cfg = hf_config_dict(shape, bos_id=1, eos_id=2, pad_id=0)
    assert ModelShape.from_hf_config(cfg) == shape
    assert param_count(shape) == sum(p.numel() for p in titan_config(shape).build().parameters())


@pytest.mark.parametrize("cfg, message", [
    ({"architectures": ["LlamaForCausalLM"]}, "supported: Qwen3MoeForCausalLM, Qwen3ForCausalLM"),
    ({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}, "missing 'num_attention_heads'"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [0]}, "dense layers"),
])
def test_unsupported_configs_fail_in_one_line(cfg, message):
    from minirl.errors import UsageError

    with pytest.raises(UsageError, match=message):
        ModelShape.from_hf_config(cfg)
