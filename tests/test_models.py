"""The tiny Qwen3-MoE: TorchTitan <-> HF conversion through TorchTitan's adapter, and parity with
transformers' own Qwen3MoeForCausalLM on the converted folder."""

import pytest
import torch

from minirl.models.shapes import QWEN3_30B_A3B, TINY, ModelShape, hf_config_dict, param_count
from minirl.models.titan import titan_config
from minirl.train.hf_io import hf_to_titan, load_hf_weights, titan_to_hf
from minirl.train.trainer import Trainer


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


def test_the_trainers_policy_gradient_equals_transformers(tiny_dir):
    """The update is the reference implementation's: one REINFORCE-style loss on the same batch
    through the trainer and through transformers' Qwen3MoeForCausalLM gives the same gradient for
    every parameter, router and experts included (transformers keeps experts stacked)."""
    from transformers import AutoModelForCausalLM

    from minirl.train.batch import build_batch

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    tr = Trainer(TINY, lr=1e-3)
    tr.load_hf(tiny_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20, (8,), generator=g).tolist() for _ in range(16)]
    responses = [torch.randint(3, 20, (3,), generator=g).tolist() + [2] for _ in range(16)]
    batch = build_batch(prompts, responses, None, torch.randn(16, generator=g).tolist(), pad_id=0)

    def loss(lp, b):
        return -(lp * b.mask_BT).sum(-1).mul(b.adv_B).mean()

    tr.forward_backward(batch, lambda lp, b: (loss(lp, b), {}))
    ours = titan_to_hf(TINY, {k: p.grad for k, p in tr.model.named_parameters()})
    tokens = batch.tokens_BL
    lp = torch.log_softmax(hf(input_ids=tokens[:, :-1]).logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    loss(lp, batch).backward()
    theirs = {k: p.grad for k, p in hf.named_parameters()}
    assert theirs["model.layers.0.mlp.gate.weight"].norm() > 0  # the router learns in both
    for k, want in theirs.items():
        if k.endswith("experts.gate_up_proj"):  # [E, 2I, D]: gate rows, then up rows
            pre, n = k.rsplit(".", 1)[0], want.shape[0]
            got = torch.stack([torch.cat([ours[f"{pre}.{e}.gate_proj.weight"], ours[f"{pre}.{e}.up_proj.weight"]])
                               for e in range(n)])
        elif k.endswith("experts.down_proj"):  # [E, D, I]
            pre, n = k.rsplit(".", 1)[0], want.shape[0]
            got = torch.stack([ours[f"{pre}.{e}.down_proj.weight"] for e in range(n)])
        else:
            got = ours[k]
        assert (got - want).norm() <= 1e-4 * want.norm() + 1e-7, k


def test_a_model_too_large_for_this_node_is_refused_before_any_download(monkeypatch):
    """#63: the host-memory check is the plan's (`host_memory`) for this job's layout: one CPU
    process holds the 30B's fp32 training state and its engine; a LoRA run under torchrun holds
    its rank's share; on GPUs what is offloaded, and rank 0's read of the checkpoint."""
    from minirl.config import recipes
    from minirl.errors import UsageError
    from minirl.setup.footprint import host_memory
    from minirl.setup.limits import Platform
    from minirl.setup.preflight import check_fits

    cpu = Platform("cpu", 1, 2, 24.0)
    check_fits(recipes.load(None, []), TINY, cpu)
    big = recipes.load(recipes.shipped("qwen3-30b-a3b"), ["rollout.sleep_level=0", "parallel.nodes=1",
                                                        "parallel.gpus_per_node=1", "parallel.ep=1", "rollout.tensor_parallel=1"])
    with pytest.raises(UsageError, match=r"30\.53B parameters\): this job needs ~\d[\d,]* GiB of this node's host memory at "
                                         r"its peak \(checkpoint read at start \(rank 0\) 110\.9, trainer"):
        check_fits(big, QWEN3_30B_A3B, cpu)
    # the same recipe on GPUs holds only the read and the offloaded moments in host memory: 8 ranks a node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    eight = recipes.with_sets(big, {"rollout.sleep_level": 2})
    need = host_memory(recipes.with_sets(eight, {"parallel.gpus_per_node": 8}), QWEN3_30B_A3B, device="cuda")
    assert need["Adam moments offloaded"] == pytest.approx(8 * 30.53e9, rel=0.01) and need["peak"] == need["Adam moments offloaded"]
    with pytest.raises(UsageError, match=r"~227 GiB .* 8 rank\(s\) on cuda"):
        check_fits(eight, QWEN3_30B_A3B, Platform("cuda", 8, 16, 80.0))


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


def test_decoding_with_the_kv_cache_gives_the_full_recomputes_logits():
    """The cold start's dev check decodes one token at a time from cached keys and values
    (models.kv_cache): every step's logits match a full forward over the whole sequence so far,
    and leaving the cache restores plain causal forwards."""
    from minirl.models.titan import kv_cache

    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.model.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, TINY.vocab_size, (3, 7), generator=g)
    with torch.no_grad():
        with kv_cache(tr.model):
            steps, new = [], x
            for t in range(6):
                at = None if t == 0 else torch.full((1, 1), x.shape[1] - 1)
                steps.append(tr.model(new, positions=at)[:, -1])
                new = torch.randint(3, TINY.vocab_size, (3, 1), generator=g)
                x = torch.cat([x, new], dim=1)
        full = tr.model(x)
    for t, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 6 + t], rtol=1e-4, atol=1e-4)
    assert all(m.kv is None for m in tr.model.modules() if hasattr(m, "kv"))
