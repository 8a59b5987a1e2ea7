"""#66, #74: the staleness controller at cluster scale, by simulation: the real controller
(minirl/rollout/controller.py) and the real dispatch (remote.py `shares`) under a simulated clock,
one trainer and 8 rollout engines (tests/async_sim.py), in minirl's two modes, for k = 0, 1, 2, and
again with one assumption changed at a time (the sensitivity table of docs/results/async.md).

    .venv/bin/python tests/bench/async_cluster.py [--steps 60] [--seeds 3] [--sigma 1.0]

The cluster is the 0.76B MoE of the GPU visits at the paper's batch (B = 64 prompts × G = 16):
- a decode step at 256 running: 16.4 ms (one H200, FP8, CUDA graphs, 256 × 1,024 tokens:
  ../shared/gpu-visits/2026-11-28/moe-r3.json, 83.9 s of rollout for 5 steps); how it splits into a
  floor (a lone straggler still pays the weights' read) and a cost per running sequence was never
  measured: 10 ms + the rest per sequence, and 2 ms below;
- at most 256 running per engine: the KV limit, in sequences (128 below);
- the trainer: 38k tokens/s a GPU for π_old's forward and the update together (the same run: 14.6
  + 19.7 s for 5 × 262k tokens), 8 GPUs assumed to scale linearly (FSDP2);
- a weight update 0.62 s (the same run's sync, 3.1 s for 5), the engines paused;
- a prompt's prefill: none (0.5 ms a sequence below; never measured alone).
Response lengths (tokens) are an assumption, not a measurement: lognormal with median 1,500 and
σ = --sigma (1.0: the long right tail of reasoning models' responses), capped at 8,192.

Prints, per scenario and k: trained tokens/s, its ratio to k = 0, the trainer's idle share, the
engines' idle share and the share of their slots in use, and the staleness of trained tokens; every
run is checked to drop nothing (the trained lengths equal the generated ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.async_sim import Cluster, simulate  # noqa: E402

STEP_S, FLOOR_S = 0.0164, 0.010


def scenarios(base: Cluster) -> dict[str, Cluster]:
    """minirl's default mode, then each assumption changed alone."""
    per_seq = lambda floor: (STEP_S - floor) / 256
    return {
        "one call at a time (minirl's default)": base,
        "in-flight updates (rollout.inflight_updates)": dataclasses.replace(base, inflight=True),
        "one call at a time, floor 2 ms": dataclasses.replace(base, step_floor_s=0.002, step_per_seq_s=per_seq(0.002)),
        "in-flight, floor 2 ms": dataclasses.replace(base, inflight=True, step_floor_s=0.002,
                                                     step_per_seq_s=per_seq(0.002)),
        "one call at a time, one engine": dataclasses.replace(base, engines=1),
        "in-flight, one engine": dataclasses.replace(base, inflight=True, engines=1),
        "one call at a time, KV for 128": dataclasses.replace(base, slots=128),
        "in-flight, KV for 128": dataclasses.replace(base, inflight=True, slots=128),
        "one call at a time, prefill 0.5 ms": dataclasses.replace(base, prefill_s=0.0005),
        "in-flight, prefill 0.5 ms": dataclasses.replace(base, inflight=True, prefill_s=0.0005),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--median", type=float, default=1500.0)
    ap.add_argument("--cap", type=int, default=8192)
    ap.add_argument("--ks", default="0,1,2")
    a = ap.parse_args()

    mu = math.log(a.median)
    base = Cluster(engines=8, slots=256, step_floor_s=FLOOR_S, step_per_seq_s=(STEP_S - FLOOR_S) / 256,
                   train_tokens_per_s=8 * 38_000.0, sync_s=0.62, prompts=64, group=16, inflight=False,
                   lengths=lambda rng: min(a.cap, 1 + int(rng.lognormvariate(mu, a.sigma))))
    print(f"8 engines × 256 slots, decode {STEP_S * 1e3:g} ms a step at 256 running, trainer 304k tokens/s, sync "
          f"0.62 s; B = 64, G = 16; lengths lognormal(median {a.median:g}, σ {a.sigma:g}) capped at {a.cap}; "
          f"{a.steps} steps × {a.seeds} seeds")
    print(f"{'scenario':<46} {'k':>2} {'tokens/s':>10} {'× k=0':>6} {'trainer idle':>12} {'engines idle':>12} "
          f"{'slots used':>10} {'staleness':>9}")
    for name, cluster in scenarios(base).items():
        rate0 = None
        for k in map(int, a.ks.split(",")):
            runs = [simulate(k, a.steps, cluster, seed=s) for s in range(a.seeds)]
            for r in runs:
                assert Counter(r.trained_lengths) == Counter(r.generated_lengths)
            rate = statistics.mean(r.tokens_per_s for r in runs)
            rate0 = rate0 or rate
            print(f"{name if k == 0 else '':<46} {k:>2} {rate:>10,.0f} {rate / rate0:>6.2f} "
                  f"{statistics.mean(r.trainer_idle_s / r.wall_s for r in runs):>12.0%} "
                  f"{statistics.mean(1 - r.engine_busy_frac for r in runs):>12.0%} "
                  f"{statistics.mean(r.slot_use for r in runs):>10.0%} "
                  f"{statistics.mean(r.mean_staleness for r in runs):>9.2f}")


if __name__ == "__main__":
    main()
