"""train.offload = "optimizer" on the GPU (#55): between updates the GPU holds the weights and not
Adam's moments (they wait in pinned host memory), a step's peak is within what the plan says for
the offloaded trainer (test_memory.py's margins), and what the round trip costs: the copies'
seconds and rate (the plan assumes 25 GB/s a GPU) and the step's time beside one without offload."""

from __future__ import annotations

import time

import pytest
import torch

from tests.gpu import kit

pytestmark = pytest.mark.gpu

PLAN_MARGIN, PLAN_OVER = 0.2, 1.5  # as test_memory.py
PROMPTS, GROUP = 4, 8


def _cuda(device) -> bool:
    return device.type == "cuda"


def test_offloaded_moments_leave_the_gpu_between_updates_within_the_plan(device, shape, one_rank_group):
    from minirl.config import recipes
    from minirl.setup.plan import GiB, make_plan
    from minirl.train import offload
    from minirl.train.trainer import Trainer

    prompt_len, response_len = (64, 448) if shape.max_seq_len >= 512 else (8, 24)  # dry mode: the tiny model's context
    rec = recipes.load(None, [f"train.prompts_per_step={PROMPTS}", f"train.group_size={GROUP}",
                             f"data.max_prompt_tokens={prompt_len}", f"rollout.max_tokens={response_len}",
                             "rollout.sleep_level=2", "train.offload=optimizer"])
    batch = kit.rl_batch(shape, prompts=PROMPTS, group=GROUP, prompt_len=prompt_len, response_len=response_len)
    batch = kit.with_rollout_logp(batch, torch.zeros(batch.mask_BT.shape) - 12.0)
    loss_fn = kit.minirl_loss()
    figures = {"tokens": int(batch.tokens_BL.numel())}
    for mode in ("none", "optimizer"):
        tr = Trainer(shape, lr=1e-6, seed=0, device=device, param_dtype="bfloat16", shard=True, offload=mode)

        def step(tr=tr):
            old, _, _ = tr.logprobs(batch)
            tr.forward_backward(batch.with_old_logp(old), loss_fn)
            tr.optim_step()

        step()  # Adam's moments allocated (and, offloaded, sent to the host)
        if _cuda(device):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            figures[f"{mode}_between_updates_gib"] = torch.cuda.memory_allocated() / GiB
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        if _cuda(device):
            torch.cuda.synchronize()
            figures[f"{mode}_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        figures[f"{mode}_step_s"] = (time.perf_counter() - t0) / 3
        if mode == "optimizer":
            moments = sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                          for s in tr.optim.state.values() for k, v in s.items() if k != "step")
            t0 = time.perf_counter()
            offload.to_device(tr.optim)
            if _cuda(device):
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            offload.to_host(tr.optim)
            t2 = time.perf_counter()
            figures |= {"moments_gib": moments / GiB, "to_device_s": t1 - t0, "to_host_s": t2 - t1,
                        "h2d_gb_s": moments / (t1 - t0) / 1e9, "d2h_gb_s": moments / (t2 - t1) / 1e9}
        del tr, step  # the closure holds the trainer too: both go before the next one is built
        if _cuda(device):
            torch.cuda.empty_cache()
    figures["offload_over_none_time"] = figures["optimizer_step_s"] / figures["none_step_s"]
    if _cuda(device):
        plan = make_plan(rec, shape, model="tests/gpu", gpu_gib=torch.cuda.get_device_properties(0).total_memory / GiB)
        figures |= {"plan_training_gib": plan.phases_gib["training (no AC)"],
                    "plan_weights_gib": plan.memory_gib["fp32 weights (sharded)"],
                    "plan_host_gib": plan.memory_gib["host memory: Adam moments offloaded"],
                    "plan_offload_s_per_step": plan.offload_s_per_step, "plan_components_gib": plan.memory_gib}
    kit.record(f"optimizer offload [{shape.n_layers} layers, fsdp2, world 1, bf16]", figures)
    if _cuda(device):
        # between updates: the weights, not the moments (twice their size)
        assert figures["optimizer_between_updates_gib"] < figures["plan_weights_gib"] + 0.25 * figures["moments_gib"]
        assert figures["none_between_updates_gib"] > figures["plan_weights_gib"] + 0.75 * figures["moments_gib"]
        assert figures["plan_host_gib"] == pytest.approx(figures["moments_gib"], rel=1e-6)
        peak = figures["optimizer_peak_gib"]
        assert (1 - PLAN_MARGIN) * peak <= figures["plan_training_gib"] <= PLAN_OVER * peak, figures
