"""Benchmark: what a lab miniature's shape costs on this machine. Prints figures, asserts nothing.

    .venv/bin/python tests/bench/miniature_shapes.py [--rows 64] [--dev 16] [--repeats 3]

Per shape (the scratchpad workspace's and the long miniature's; `--shape L,E,K` adds one):
1. one cold-start SFT step (forward, backward, optimizer) on `--rows` rows of the task's prompt
   plus response length, median of `--repeats` after a warm-up;
2. one dev check (`sft.sampled_accuracy`: decoding with a KV cache) on `--dev`
   prompts of one length, to the task's response length, and its cost per decoding forward.
The tokens are random: the figures are the shape's, not the task's.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from minirl.models.shapes import TINY  # noqa: E402
from minirl.train.batch import build_batch  # noqa: E402
from minirl.train.sft import sampled_accuracy, sft_loss  # noqa: E402
from minirl.train.trainer import Trainer  # noqa: E402

# (name, layers, experts, top_k, prompt tokens, response tokens): the recipes' shapes and lengths
SHAPES = [("scratchpad (tiny-scratchpad)", 4, 8, 2, 12, 33), ("scratchpad-long (tiny-scratchpad-long)", 6, 16, 4, 26, 99)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--dev", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", action="append", default=[], help="layers,experts,top_k (long task lengths)")
    args = ap.parse_args()
    shapes = SHAPES + [(f"custom {s}", *map(int, s.split(",")), 26, 99) for s in args.shape]
    rng = random.Random(0)
    print(f"{'shape':42} {'SFT step':>10} {'dev check':>10} {'per forward':>12}")
    for name, layers, experts, top_k, n_p, n_t in shapes:
        ctx = -(-(n_p + n_t + 9) // 32) * 32
        shape = dataclasses.replace(TINY, max_seq_len=max(64, ctx), n_layers=layers, num_experts=experts, top_k=top_k)
        trainer = Trainer(shape, lr=1e-3, seed=0)
        rows = [([rng.randrange(3, 14) for _ in range(n_p)], [rng.randrange(3, 14) for _ in range(n_t)])
                for _ in range(args.rows)]
        batch = build_batch([p for p, _ in rows], [t for _, t in rows], None, None, pad_id=0)
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            trainer.forward_backward(batch, sft_loss)
            trainer.optim_step()
            times.append(time.perf_counter() - t0)
        step = statistics.median(times[1:])
        t0 = time.perf_counter()
        sampled_accuracy(trainer, rows[: args.dev], eos_id=1, max_tokens=n_t + 8)
        check = time.perf_counter() - t0
        print(f"{name:42} {step:9.2f}s {check:9.1f}s {check / (n_t + 8):11.3f}s", flush=True)


if __name__ == "__main__":
    main()
