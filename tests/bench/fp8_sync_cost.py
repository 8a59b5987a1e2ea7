"""Benchmark: the cost of FP8-quantizing the rollout weights at every sync (`minirl.fp8`), here on
the CPU, and what it means for Qwen3-30B-A3B under the planned sharding.

    .venv/bin/python tests/bench/fp8_sync_cost.py

Measures, median of 5 (after one warm-up):
- the tiny default's whole weights (the real sync input);
- one Qwen3-30B-A3B MoE layer's expert projections (128 × 3 matrices, 2048 × 768: 604M parameters,
  random bf16; no engine needed), batched as `fp8_roundtrip` does, against one torchao
  `quantize_` per matrix (what the emulation did before) on 16 of them;
- Qwen3-0.6B's projection weights (0.44B parameters, every shape of a dense Qwen3).
Then extrapolates to one GPU's share of Qwen3-30B-A3B on the plan of recipes/qwen3-30b-a3b.toml
(2 × 8 GPUs, vLLM TP 2) with this CPU's throughput and with the H100 figure of PLATFORM.md, and
sets both against the plan's step time at an assumed MFU. Prints figures, asserts nothing.
"""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    from minirl.config import recipes
    from minirl.models.shapes import KNOWN_SHAPES, TINY
    from minirl.rollout.fp8 import fp8_roundtrip, is_fp8_target
    from minirl.setup.plan import make_plan
    from minirl.train.trainer import Trainer

    torch.manual_seed(0)
    print(f"torch threads: {torch.get_num_threads()}")
    tiny = Trainer(TINY, lr=0.0).hf_state_dict()
    n_tiny = sum(w.numel() for k, w in tiny.items() if is_fp8_target(k, w))
    t = timed(lambda: fp8_roundtrip(tiny))
    print(f"tiny default: {n_tiny:,} projection params, {t * 1e3:.1f} ms per sync")

    s = KNOWN_SHAPES["Qwen3-30B-A3B"]
    layer = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.randn(*shape, dtype=torch.bfloat16) * 0.02
             for e in range(s.num_experts)
             for p, shape in (("gate_proj", (s.moe_hidden_dim, s.dim)), ("up_proj", (s.moe_hidden_dim, s.dim)),
                              ("down_proj", (s.dim, s.moe_hidden_dim)))}
    n_layer = sum(w.numel() for w in layer.values())
    t_layer = timed(lambda: fp8_roundtrip(layer), repeats=3)
    rate = n_layer / t_layer
    print(f"Qwen3-30B-A3B, one layer's experts: {n_layer / 1e6:.0f}M params, batched {t_layer:.2f} s "
          f"({rate / 1e6:.0f}M params/s)")

    some = list(layer.values())[:16]

    def per_matrix():
        for w in some:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(w)
            quantize_(lin, Float8WeightOnlyConfig())
            lin.weight.dequantize()

    t_pm = timed(per_matrix, repeats=3) / len(some)
    print(f"  one quantize_ per matrix: {t_pm * 1e3:.1f} ms per matrix, {t_pm * 3 * s.num_experts:.2f} s for the "
          f"layer ({t_pm * 3 * s.num_experts / t_layer:.1f}x the batched cast)")
    w = layer["model.layers.0.mlp.experts.0.down_proj.weight"]
    q = fp8_roundtrip({"x.down_proj.weight": w})["x.down_proj.weight"]
    print(f"  relative error of the FP8 round trip: {float((q.float() - w.float()).norm() / w.float().norm()):.4f}")
    del layer

    d = KNOWN_SHAPES["Qwen3-0.6B"]
    dense = {}
    for i in range(d.n_layers):
        for p, shape in (("q_proj", (d.n_heads * d.head_dim, d.dim)), ("k_proj", (d.n_kv_heads * d.head_dim, d.dim)),
                         ("v_proj", (d.n_kv_heads * d.head_dim, d.dim)), ("o_proj", (d.dim, d.n_heads * d.head_dim)),
                         ("gate_proj", (d.hidden_dim, d.dim)), ("up_proj", (d.hidden_dim, d.dim)),
                         ("down_proj", (d.dim, d.hidden_dim))):
            dense[f"model.layers.{i}.{p}.weight"] = torch.randn(*shape, dtype=torch.bfloat16) * 0.02
    n_dense = sum(w.numel() for w in dense.values())
    t_dense = timed(lambda: fp8_roundtrip(dense), repeats=3)
    print(f"Qwen3-0.6B projections: {n_dense / 1e6:.0f}M params, {t_dense:.2f} s per sync "
          f"({n_dense / t_dense / 1e6:.0f}M params/s)")
    del dense

    rec = recipes.load(recipes.for_model("Qwen3-30B-A3B"), [])
    plan = make_plan(rec, s, model="Qwen3-30B-A3B")
    per_gpu = plan.params / rec.rollout.tensor_parallel  # each GPU's engine shard (projections ≈ all of it)
    flops = plan.train_flops_per_step + plan.rollout_flops_per_step
    world = plan.mesh["world"]
    for mfu in (0.2, 0.4):
        step_s = flops / (world * 989e12 * mfu)  # H100 dense bf16 peak
        cpu_s = per_gpu / rate
        h100_s = 0.4 / rec.rollout.tensor_parallel  # PLATFORM.md: 0.4 s for all 48 layers on one H100
        print(f"Qwen3-30B-A3B on {world} GPUs (vLLM TP {rec.rollout.tensor_parallel}), step ≈ {step_s:.0f} s at "
              f"{mfu:.0%} MFU: quantizing one GPU's {per_gpu / 1e9:.1f}B params costs {cpu_s:.0f} s at this CPU's "
              f"rate ({100 * cpu_s / step_s:.1f}% of a step), {h100_s:.2f} s at the H100's "
              f"({100 * h100_s / step_s:.3f}%)")


if __name__ == "__main__":
    main()
