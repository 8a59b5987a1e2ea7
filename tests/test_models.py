"""The tiny Qwen3-MoE: TorchTitan <-> HF conversion through TorchTitan's adapter, and parity with
transformers' own Qwen3MoeForCausalLM on the converted folder."""

import torch

from minirl.hf_io import hf_to_titan, load_hf_weights, titan_to_hf
from minirl.models import QWEN3_30B_A3B, TINY, param_count, titan_config
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
