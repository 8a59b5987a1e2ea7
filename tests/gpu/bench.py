"""GPU bench (figures, not a test): training tokens/s and MFU of the MiniRL step on the 0.76B
Qwen3-MoE (kit.moe_shape) in bf16, with and without routing replay, one GPU and FSDP2 at world
size 1, and the kernels that take the time (torch.profiler).

    python tests/gpu/bench.py [--steps 3] [--out DIR]     (MINIRL_GPU_DRY=1: the tiny model on the CPU)

Steps, as `minirl run` takes them:
    on-policy    N = 1: one fused forward gives π_old and the loss, backward, optimizer step (3 forward-equivalents)
    pi_old+upd   a π_old forward, then the update's forward and backward (4; N > 1 without replay)
    r2           the same with routes recorded in the π_old forward and replayed in the update (R2)
tokens/s counts the batch's rows × positions (prompt and response; padding excluded); MFU is the
model FLOPs of those tokens over the step time and the GPU's dense bf16 peak. Shared-prompt
packing (on-policy only: replay turns it off) skips repeated prompt tokens, so there the MFU is
an effective one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
with contextlib.suppress(ImportError):
    import torch211_shim  # noqa: F401  (the device image only; see conftest.py)

from tests.gpu import kit  # noqa: E402

MODES = {"on-policy": 3, "pi_old+upd": 4, "r2": 4}  # forward-equivalents a step


def _sync():
    if kit.device().type == "cuda":
        torch.cuda.synchronize()


def make_step(tr, batch, loss_fn, mode: str):
    def step():
        if mode == "on-policy":
            tr.forward_backward(batch, loss_fn, with_logp=True)
        else:
            old, _, routes = tr.logprobs(batch, record_routes=mode == "r2")
            tr.forward_backward(batch.with_old_logp(old), loss_fn, routes=routes)
        tr.optim_step()

    return step


def top_kernels(step, n: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    cuda = kit.device().type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        step()
        _sync()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if cuda:  # the kernels themselves, not the operators that launched them (their time is the same)
        from torch.autograd import DeviceType

        events = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA] or events
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [{"name": e.key[:90], "ms": getattr(e, attr) / 1e3, "calls": e.count, "share": getattr(e, attr) / total}
            for e in events[:n]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    ap.add_argument("--out", type=Path, default=None, help="folder for bench.json")
    a = ap.parse_args()

    from minirl.train.trainer import Trainer

    dev = kit.device()
    if kit.DRY:
        shape = kit.shapes()["tiny"]
        batch = kit.rl_batch(shape, prompts=4, group=4, prompt_len=6, response_len=10)
    else:
        if dev.type != "cuda":
            print(f"bench: {kit.NO_GPU}", file=sys.stderr)
            return 2
        shape = kit.moe_shape()
        batch = kit.rl_batch(shape, prompts=4, group=8, prompt_len=128, response_len=896)
    batch = kit.with_rollout_logp(batch, torch.full(batch.mask_BT.shape, -2.0))
    loss_fn = kit.minirl_loss()
    tokens = int((batch.seq_len_B - 1).sum())
    peak = kit.peak_flops()
    results, kernels = [], {}
    # "whole-head": one GPU with the output head over whole [tokens, vocab] logits (head_chunk=0), as
    # before #55's chunked head (train/head.py), which the other paths take at this batch's size
    for path in ("one-gpu", "fsdp2", "whole-head"):
        if path == "fsdp2":
            import torch.distributed as dist

            if not dist.is_initialized():
                if dev.type == "cuda":
                    torch.cuda.set_device(0)
                dist.init_process_group("cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo",
                                        store=dist.HashStore(), rank=0, world_size=1)
        tr = Trainer(shape, lr=1e-6, seed=0, device=dev, param_dtype="bfloat16", shard=path == "fsdp2",
                     head_chunk=0 if path == "whole-head" else None)
        for mode, fwd in MODES.items():
            if path == "whole-head" and mode != "on-policy":
                continue
            step = make_step(tr, batch, loss_fn, mode)
            step()  # warm-up: kernels chosen, Adam's moments allocated
            _sync()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            _sync()
            dt = (time.perf_counter() - t0) / a.steps
            flops = kit.step_flops(shape, batch) * fwd / 4
            row = {"path": path, "mode": mode, "step_s": dt, "tokens": tokens, "tokens_per_s": tokens / dt,
                   "tflops_per_s": flops / dt / 1e12, "mfu": flops / dt / peak if peak else None,
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}
            results.append(row)
            print(f"{path:10s} {mode:11s} {dt * 1e3:8.1f} ms/step {row['tokens_per_s']:10.0f} tok/s "
                  f"{row['tflops_per_s']:7.1f} TFLOP/s" + (f"  MFU {row['mfu']:.1%}" if peak else "")
                  + (f"  peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] else ""), flush=True)
            if path == "one-gpu" and mode in ("on-policy", "r2"):
                kernels[mode] = top_kernels(step)
        del tr
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for mode, ks in kernels.items():
        print(f"\ntop kernels, one-gpu {mode} step:")
        for k in ks:
            print(f"  {k['ms']:9.2f} ms {k['share']:6.1%} x{k['calls']:<5d} {k['name']}")
    report = {"shape": dataclasses.asdict(shape), "rows": len(batch),
              "padded_len": int(batch.tokens_BL.shape[1]), "tokens": tokens, "peak_bf16_flops": peak,
              "results": results, "top_kernels": kernels, "machine": kit.describe()}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench.json").write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
