"""LoRA on the GPU (#54): one process, as recipes/qwen3-30b-a3b-lora.toml runs on one GPU. The base
is held in bf16 only, the step's peak memory is within what `minirl run --dry-run` plans for the
same batch (the margins of test_memory.py), and the step time is set beside full RL's on the same
batch (FSDP2 at world size 1, the cluster's path), figures only."""

from __future__ import annotations

import time

import pytest
import torch

from tests.gpu import kit

pytestmark = pytest.mark.gpu

PLAN_MARGIN, PLAN_OVER = 0.2, 1.5  # as test_memory.py
PROMPTS, GROUP = 4, 8
RANK = 16


def _steps(tr, batch, loss_fn, n: int) -> float:
    """Seconds per on-policy step (π_old, then the update), the mean of `n` after a first one."""
    def step():
        old, _, _ = tr.logprobs(batch)
        tr.forward_backward(batch.with_old_logp(old), loss_fn)
        tr.optim_step()

    step()  # Adam's moments allocated; kernels chosen
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def test_lora_holds_a_bf16_base_within_the_plan_and_its_step_time_beside_full_rls(device, shape, one_rank_group):
    from minirl.config import recipes
    from minirl.setup.plan import GiB, make_plan
    from minirl.train import lora as lora_mod
    from minirl.train.lora import is_adapter
    from minirl.train.trainer import Trainer

    prompt_len, response_len = (64, 448) if shape.max_seq_len >= 512 else (8, 24)  # dry mode: the tiny model's context
    sets = [f"train.prompts_per_step={PROMPTS}", f"train.group_size={GROUP}", f"data.max_prompt_tokens={prompt_len}",
            f"rollout.max_tokens={response_len}", "rollout.sleep_level=2", f"train.lora.rank={RANK}",
            f"train.lora.alpha={2 * RANK}", "parallel.gpus_per_node=1"]
    rec = recipes.load(None, sets)
    batch = kit.rl_batch(shape, prompts=PROMPTS, group=GROUP, prompt_len=prompt_len, response_len=response_len)
    batch = kit.with_rollout_logp(batch, torch.zeros(batch.mask_BT.shape) - 12.0)
    loss_fn = kit.minirl_loss()

    lora = Trainer(shape, lr=1e-5, seed=0, device=device, param_dtype="bfloat16", lora=lora_mod.settings(rec, shape))
    base = {p.dtype for n, p in lora.model.named_parameters() if not is_adapter(n)}
    assert base == {torch.bfloat16}  # no float32 copy of the base
    lora_s = _steps(lora, batch, loss_fn, 3)
    figures = {"lora_step_s": lora_s, "rank": RANK, "tokens": int(batch.tokens_BL.numel())}
    if device.type == "cuda":
        plan = make_plan(rec, shape, model="tests/gpu", gpu_gib=torch.cuda.get_device_properties(0).total_memory / GiB)
        peak = torch.cuda.max_memory_allocated() / GiB
        planned = plan.phases_gib["training (no AC)"]  # the engine asleep meanwhile
        figures |= {"lora_peak_gib": peak, "lora_plan_gib": planned, "plan_over_peak": planned / peak,
                    "plan_components_gib": plan.memory_gib}
    del lora
    if device.type == "cuda":
        torch.cuda.empty_cache()
    full = Trainer(shape, lr=1e-6, seed=0, device=device, param_dtype="bfloat16", shard=True)
    figures["full_step_s"] = _steps(full, batch, loss_fn, 3)
    if device.type == "cuda":
        figures["full_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    figures["lora_over_full_time"] = figures["lora_step_s"] / figures["full_step_s"]
    kit.record(f"LoRA r{RANK} vs full RL [{shape.n_layers} layers, one process, bf16]", figures)
    if device.type == "cuda":
        assert (1 - PLAN_MARGIN) * figures["lora_peak_gib"] <= figures["lora_plan_gib"] <= PLAN_OVER * figures[
            "lora_peak_gib"], figures
