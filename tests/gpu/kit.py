"""What the GPU checks and the GPU bench share: the device, the models, an RL batch, the figures.

`MINIRL_GPU_DRY=1` runs everything on the CPU with the tiny model only (the dry mode of
`run-on-device.sh`, which tests/test_gpu_kit.py runs in CI so the kit cannot rot).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from minirl.models.shapes import TINY, ModelShape, active_params, hf_config_dict, param_count

DRY = os.environ.get("MINIRL_GPU_DRY") == "1"
REPORT = os.environ.get("MINIRL_GPU_REPORT")  # folder of the run's report files, if any
NO_GPU = "no CUDA device: tests/gpu run on a GPU machine (bash tests/gpu/run-on-device.sh)"

# dense bf16 peak of the GPUs this kit has met (tensor cores, no sparsity): MFU's denominator
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def moe_shape() -> ModelShape:
    """A 0.76B Qwen3-MoE read from its config.json (8 layers, dim 1024, 64 experts of width 256,
    top-8, Qwen3's 151,936-token vocabulary): Qwen3-30B-A3B's family and routing at a size that one
    GPU trains at full batch and a CPU computes the fp32 reference of in seconds."""
    shape = ModelShape(vocab_size=151936, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=128,
                       moe_hidden_dim=256, num_experts=64, top_k=8, max_seq_len=4096, rope_theta=1e6)
    return ModelShape.from_hf_config(hf_config_dict(shape, bos_id=0, eos_id=1, pad_id=2), source="tests/gpu moe")


def shapes() -> dict[str, ModelShape]:
    return {"tiny": TINY, "moe": moe_shape()}


def device() -> torch.device:
    return torch.device("cpu" if DRY or not torch.cuda.is_available() else "cuda")


def rl_batch(shape: ModelShape, *, prompts: int, group: int, prompt_len: int, response_len: int, seed: int = 0):
    """A batch as a step of `minirl run` builds it: `prompts` prompts of `prompt_len` tokens, each
    with `group` responses of response_len/2..response_len tokens, group-mean advantages of random
    0/1 rewards, and rollout log-probs filled in later (`with_rollout_logp`)."""
    from minirl.train.batch import build_batch
    from minirl.train.objective import group_advantages

    g = torch.Generator().manual_seed(seed)
    hi = shape.vocab_size
    ps, rs = [], []
    for _ in range(prompts):
        p = torch.randint(3, hi, (prompt_len,), generator=g).tolist()
        for _ in range(group):
            n = int(torch.randint(response_len // 2, response_len + 1, (1,), generator=g))
            ps.append(p)
            rs.append(torch.randint(3, hi, (n,), generator=g).tolist())
    rewards = torch.randint(0, 2, (prompts, group), generator=g).float()
    adv = group_advantages(rewards).flatten().tolist()
    return build_batch(ps, rs, [[0.0] * len(r) for r in rs], adv, pad_id=0)


def with_rollout_logp(batch, logp_BT: torch.Tensor, *, noise: float = 0.05, seed: int = 0):
    """`batch` with rollout log-probs μ = π + noise on response positions: an engine close to the
    trainer, as in a run, so IS weights and clipping see ratios near 1."""
    g = torch.Generator().manual_seed(seed)
    mu = (logp_BT + noise * torch.randn(logp_BT.shape, generator=g)).clamp(max=0.0) * batch.mask_BT
    return dataclasses.replace(batch, rollout_logp_BT=mu)


def minirl_loss():
    """The loss of a `minirl run` step with the default recipe (MiniRL: IS weight, decoupled clip)."""
    from minirl.config import recipes
    from minirl.train.objective import loss_for

    return loss_for(recipes.load(None).loss)


def step_flops(shape: ModelShape, batch) -> float:
    """FLOPs of one on-policy MiniRL step on `batch`: the π_old forward, then forward and backward
    of the update (3 forwards' worth), at 2·active parameters a token plus causal attention."""
    B, L = batch.tokens_BL.shape
    tokens = B * (L - 1)
    attn = 4 * shape.n_layers * (L // 2) * shape.n_heads * shape.head_dim
    return 4.0 * tokens * (2 * active_params(shape) + attn)


def peak_flops() -> float | None:
    if not torch.cuda.is_available() or DRY:
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def describe() -> dict:
    """The machine and the software, for the report."""
    import platform

    info = {"python": platform.python_version(), "torch": torch.__version__, "dry": DRY,
            "device": torch.cuda.get_device_name() if device().type == "cuda" else "cpu"}
    for mod in ("torchtitan", "torchao", "transformers", "vllm"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - a report line, not a failure
            info[mod] = f"not importable: {type(e).__name__}"
    if device().type == "cuda":
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    info["moe_params"] = param_count(moe_shape())
    return info


def record(name: str, figures: dict) -> None:
    """Append one test's or bench's figures to the run's report (figures.jsonl), if there is one."""
    if REPORT:
        Path(REPORT).mkdir(parents=True, exist_ok=True)
        with open(Path(REPORT) / "figures.jsonl", "a") as f:
            f.write(json.dumps({"name": name, **figures}) + "\n")
