"""#66: rollouts ahead of the trainer on this machine: k = 0, 1, 2, 4 at equal wall time.

    .venv/bin/python tests/bench/async_cpu.py [--wall 40] [--seeds 3] [--ks 0,1,2,4] [--inflight] \
        [--default WS] [--scratchpad WS]

Each run is a `minirl run` of a copy of a workspace (the embedded default, and the scratchpad
task, whose response lengths vary: `minirl init WS --task scratchpad`, built when missing) with
`train.time_limit_s = --wall` and `train.seed` = the seed; the k's of one seed run back to back,
in an order that rotates with the seed (no k always first on a cold page cache). Prints per task
and k, mean ± spread over seeds: RL steps/s over the RL clock (`timing/loop_s`), the trainer's idle
share (every wait on the engine: `timing/trainer_wait_s`; at k = 0 the rollout phase), the engine's
idle share (k ≥ 1: the wall time outside its calls), the mean
staleness of the trained batches, the held-out score at the end (equal wall time) and the guard's
rollbacks over the seeds. With
`--inflight` each k ≥ 1 also runs with `rollout.inflight_updates = true` (arm "k+": the engine
keeps stepping across calls, the batches of several steps sampled together, syncs loaded between
two forward steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(ws: Path, k: int, seed: int, wall: float, inflight: bool) -> dict:
    sets = {"train.seed": seed, "rollout.max_staleness": k, "train.time_limit_s": wall, "train.steps": 100_000,
            "checkpoint.every": 100_000, "rollout.inflight_updates": str(inflight).lower()}
    args = [sys.executable, "-m", "cli.main", "run", str(ws), *[x for kv in sets.items() for x in ("--set", f"{kv[0]}={kv[1]}")]]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"k={k} seed={seed}: exit {r.returncode}\n{r.stderr[-2000:]}")
    run = max((ws / "runs").iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    last = rows[-1]
    loop = last["timing/loop_s"]  # the RL clock; the phases are parts of it, never added to it (#74)
    metric = next(m for m in summary["heldout"]["end"] if m.startswith("avg@"))
    return {
        "steps": len(rows),
        "steps_per_s": len(rows) / loop,
        "trainer_idle": last.get("timing/trainer_wait_s", last.get("timing/rollout_s", 0.0)) / loop,
        "engine_idle": max(0.0, 1 - last["timing/engine_busy_s"] / loop) if k else None,
        "staleness": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in rows),
        "rollbacks": sum(r.get("guard/action") in ("rollback", "stop") for r in rows),
        "heldout": summary["heldout"]["end"][metric],
        "start": summary["heldout"]["start"][metric],
    }


def _fmt(xs: list[float | None], f: str) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    return (f"{f} ± {f}").format(statistics.mean(xs), statistics.pstdev(xs)) if len(xs) > 1 else f.format(xs[0])


def _label(arm: tuple[int, bool]) -> str:
    return f"{arm[0]}{'+' if arm[1] else ''}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wall", type=float, default=40.0, help="seconds of RL per run")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ks", default="0,1,2,4")
    ap.add_argument("--default", type=Path, default=Path("minirl-bench-default"))
    ap.add_argument("--scratchpad", type=Path, default=Path("minirl-bench-scratchpad"))
    ap.add_argument("--tasks", default="default,scratchpad")
    ap.add_argument("--inflight", action="store_true", help="each k ≥ 1 also with rollout.inflight_updates (arm k+)")
    a = ap.parse_args()
    ks = [(int(k), False) for k in a.ks.split(",")]
    ks += [(k, True) for k, _ in ks if k and a.inflight]
    for task in a.tasks.split(","):
        src = a.default if task == "default" else a.scratchpad
        if not (src / "minirl.toml").exists():
            init = [sys.executable, "-m", "cli.main", "init", str(src)] + ([] if task == "default" else ["--task", task])
            subprocess.run(init, cwd=ROOT, check=True, capture_output=True)
        results: dict[tuple[int, bool], list[dict]] = {k: [] for k in ks}
        for seed in range(a.seeds):
            order = ks[seed % len(ks):] + ks[:seed % len(ks)]
            for k in order:
                with tempfile.TemporaryDirectory() as tmp:
                    ws = Path(tmp) / "ws"
                    shutil.copytree(src, ws, ignore=shutil.ignore_patterns("runs", "evals", "doctor", "lab"))
                    results[k].append(_run(ws, k[0], seed, a.wall, inflight=k[1]))
                r = results[k][-1]
                print(f"  {task} seed {seed} k={_label(k)}: {r['steps']} steps, {r['steps_per_s']:.2f}/s, held-out "
                      f"{r['start']:.3f} → {r['heldout']:.3f}, {r['rollbacks']} rollback(s)", flush=True)
        print(f"\n{task}: {a.wall:g} s of RL per run, {a.seeds} seeds (mean ± spread)")
        print(f"{'k':>2} {'steps/s':>13} {'trainer idle':>13} {'engine idle':>13} {'staleness':>9} {'held-out':>15} "
              f"{'rollbacks':>9}")
        for k in ks:
            rs = results[k]
            print(f"{_label(k):>2} {_fmt([r['steps_per_s'] for r in rs], '{:.2f}'):>13} "
                  f"{_fmt([r['trainer_idle'] for r in rs], '{:.0%}'):>13} {_fmt([r['engine_idle'] for r in rs], '{:.0%}'):>13} "
                  f"{statistics.mean(r['staleness'] for r in rs):>9.2f} {_fmt([r['heldout'] for r in rs], '{:.3f}'):>15} "
                  f"{sum(r['rollbacks'] for r in rs):>9}")
        print()


if __name__ == "__main__":
    main()
