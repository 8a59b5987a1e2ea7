"""Benchmark: the trainer's peak memory with whole logits against the chunked output head
(train/head.py), on a model with Qwen3's vocabulary. Prints figures, asserts nothing.

    .venv/bin/python tests/bench/head_memory.py [--layers 2] [--positions 4096]

The 0.76B Qwen3-MoE of the GPU check (tests/gpu/kit.py: dim 1024, 64 experts of width 256,
151,936-token vocabulary) cut to --layers decoder layers, float32 on this CPU. Each arm runs in a
process of its own: π_old for a batch of --positions response tokens, then one MiniRL update;
its maximum RSS is read as it exits (the process's own, so the arms do not share a high-water mark)
beside the same for the model and Adam alone. Whole logits are [positions, vocab] in float32 here,
with their gradient; the chunked head holds 1,024 positions of them at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def arm(layers: int, positions: int, chunk: int, steps: bool) -> dict:
    import resource

    import torch

    sys.path.insert(0, str(ROOT))
    from minirl.train.batch import build_batch
    from minirl.train.trainer import Trainer
    from tests.gpu import kit

    torch.manual_seed(0)
    shape = dataclasses.replace(kit.moe_shape(), n_layers=layers)
    tr = Trainer(shape, lr=1e-6, seed=0, head_chunk=chunk)
    for p in tr.model.parameters():  # Adam's moments, as in any step after the first
        tr.optim.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    out = {"chunk": chunk, "rss_model_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if steps:
        g = torch.Generator().manual_seed(0)
        rows, length = 8, positions // 8
        prompts = [torch.randint(3, shape.vocab_size, (16,), generator=g).tolist() for _ in range(rows)]
        resps = [torch.randint(3, shape.vocab_size, (length - 16,), generator=g).tolist() for _ in range(rows)]
        b = build_batch(prompts, resps, [[-1.0] * len(r) for r in resps], [0.5, -0.5] * (rows // 2), pad_id=0)
        t0 = time.perf_counter()
        old, _, _ = tr.logprobs(b)
        tr.forward_backward(b.with_old_logp(old), kit.minirl_loss())
        tr.optim_step()
        out |= {"step_s": time.perf_counter() - t0, "positions": int(b.mask_BT.numel())}
    out["rss_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)  # a child: this chunk
    ap.add_argument("--model-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm is not None:
        print(json.dumps(arm(a.layers, a.positions, a.arm, steps=not a.model_only)))
        return

    def child(*extra: str) -> dict:
        r = subprocess.run([sys.executable, __file__, "--layers", str(a.layers), "--positions", str(a.positions),
                            *extra], capture_output=True, text=True, check=True, cwd=ROOT)
        return json.loads(r.stdout.strip().splitlines()[-1])

    base = child("--arm", "0", "--model-only")
    print(f"model ({a.layers} layers, vocab 151,936, fp32) + Adam state, no step: {base['rss_peak_mib']:,.0f} MiB")
    for chunk, name in ((0, "whole logits"), (1024, "chunked head, 1,024 positions")):
        got = child("--arm", str(chunk))
        print(f"{name:>31}: peak RSS {got['rss_peak_mib']:,.0f} MiB (+{got['rss_peak_mib'] - base['rss_peak_mib']:,.0f} "
              f"over the model), one step {got['step_s']:.1f} s, {got['positions']:,} positions", flush=True)


if __name__ == "__main__":
    main()
