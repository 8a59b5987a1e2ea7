"""#66: the staleness controller at cluster scale, by simulation: the real controller
(minirl/rollout/controller.py) under a simulated clock, one trainer and 8 rollout engines that
keep sampling across weight updates (tests/async_sim.py), for k = 0…4.

    .venv/bin/python tests/bench/async_cluster.py [--steps 60] [--seeds 3] [--sigma 1.0]

The cluster is the 0.76B MoE of the GPU checks at the paper's batch (B = 64 prompts × G = 16),
with the figures measured on one H200 (docs/verification.md, `8470b41`):
- an engine (one GPU) decodes 256 sequences at 11,509 tokens/s in FP8: 22.2 ms a decode step at
  256 running; a decode step is modelled as 10 ms + 0.048 ms × running (memory-bound: a lone
  straggler still pays the weights' read), at most 256 running per engine;
- the trainer trains 50k tokens/s on one GPU (48–51k measured); it has 8, assumed to scale
  linearly (FSDP2): 400k tokens/s;
- a weight update costs 0.61 s (the FP8 in-place sync measured), engines and trainer paused.
Response lengths (tokens) are an assumption, not a measurement: lognormal with median 1,500 and
σ = --sigma (1.0: the long right tail of reasoning models' responses, a few 10× the median),
capped at 8,192, where the cap collects the tail as it does in RL runs.

Prints, per k: trained tokens/s, its ratio to k = 0, the trainer's idle share, the engines' idle
share (nothing to decode) and the share of their slots in use, the staleness of trained tokens (mean, max, histogram), and what was dropped (nothing:
the trained lengths are checked equal to the generated ones).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.async_sim import Cluster, simulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--median", type=float, default=1500.0)
    ap.add_argument("--cap", type=int, default=8192)
    a = ap.parse_args()

    import math

    mu = math.log(a.median)
    cluster = Cluster(engines=8, slots=256, step_floor_s=0.010, step_per_seq_s=(0.0222 - 0.010) / 256,
                      train_tokens_per_s=400_000.0, sync_s=0.61, prompts=64, group=16,
                      lengths=lambda rng: min(a.cap, 1 + int(rng.lognormvariate(mu, a.sigma))))
    print(f"cluster: 8 engines × 256 slots, trainer 400k tokens/s, sync 0.61 s; B = 64, G = 16; lengths "
          f"lognormal(median {a.median:g}, σ {a.sigma:g}) capped at {a.cap}; {a.steps} steps × {a.seeds} seeds")
    print(f"{'k':>2} {'tokens/s':>10} {'× k=0':>6} {'trainer idle':>12} {'engines idle':>12} {'slots used':>10} {'staleness':>9} "
          f"{'max':>3} {'dropped':>7}  histogram (updates behind: share of tokens)")
    base = None
    for k in range(5):
        runs = [simulate(k, a.steps, cluster, seed=s) for s in range(a.seeds)]
        rate = statistics.mean(r.tokens_per_s for r in runs)
        base = base or rate
        hist = Counter()
        for r in runs:
            hist.update(r.staleness)
            assert Counter(r.trained_lengths) == Counter(r.generated_lengths)
        dropped = sum(len(r.generated_lengths) - len(r.trained_lengths) for r in runs)
        total = sum(hist.values())
        shares = ", ".join(f"{s}: {n / total:.0%}" for s, n in sorted(hist.items()))
        print(f"{k:>2} {rate:>10,.0f} {rate / base:>6.2f} {statistics.mean(r.trainer_idle_s / r.wall_s for r in runs):>12.0%} "
              f"{statistics.mean(1 - r.engine_busy_frac for r in runs):>12.0%} "
              f"{statistics.mean(r.slot_use for r in runs):>10.0%} "
              f"{sum(s * n for s, n in hist.items()) / total:>9.2f} {max(hist):>3} {dropped:>7}  {shares}")


if __name__ == "__main__":
    main()
