"""#66: the engine on a rollout "GPU" (on a CPU, a process fed by broadcast over gloo) against the
engine process fed by shared-memory snapshots, at k = 1 on the embedded default.

    .venv/bin/python tests/bench/rollout_gpu_cpu.py WS [--steps 100] [--reps 2]

WS: a workspace `minirl init` made (the embedded default). Each run is a `minirl run` of a fresh
copy of it, `--steps` steps at rollout.max_staleness = 1 without periodic evaluation; the two arms
alternate `--reps` times. Prints per run, from its last row: steps/s (RL loop), the sync's
milliseconds a step, the trainer's total wait for batches, and the held-out score at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {"shared memory": [], "broadcast": ["--rollout-gpus", "1"]}


def _run(ws: Path, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ws"
        shutil.copytree(ws, copy, ignore=shutil.ignore_patterns("runs", "evals"))
        r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(copy), "--steps", str(steps),
                            "--set", "rollout.max_staleness=1", "--set", "eval.every=0", *extra],
                           cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{extra}: exit {r.returncode}\n{r.stderr[-2000:]}")
        run = max((copy / "runs").iterdir())
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        summary = json.loads((run / "summary.json").read_text())
    return {"steps/s": round(last["step"] / last["timing/loop_s"], 2),
            "sync ms a step": round(1000 * last["timing/sync_s"] / last["step"], 1),
            "rollout wait s": round(last["timing/rollout_s"], 2),
            "held-out": summary["heldout"]["end"][f"avg@{summary['heldout']['end']['k']}"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    for rep in range(a.reps):
        for arm, extra in ARMS.items():
            print(f"rep {rep + 1} {arm:14s}", json.dumps(_run(a.workspace, a.steps, extra)), flush=True)


if __name__ == "__main__":
    main()
