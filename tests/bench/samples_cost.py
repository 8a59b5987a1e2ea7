"""Benchmark: what keeping samples (and the token record) costs a run. Prints figures, asserts nothing.

    .venv/bin/python tests/bench/samples_cost.py WORKSPACE [--steps 300] [--repeats 3] [--record]

Alternates `minirl run` on a copy of the workspace with `metrics.samples_groups = 0` (no samples) and
the recipe's own (the default: 2 groups a step), and with --record also `metrics.record_tokens = STEPS`
(every token of every step recorded), --repeats times each; the figure is the run's RL-loop time
(summary.json's phases_s.loop: no start-up, no held-out evaluation) and the size of what it wrote.
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


def one(ws: Path, steps: int, sets: list[str]) -> tuple[float, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ws"
        shutil.copytree(ws, copy, ignore=shutil.ignore_patterns("runs", "evals", "doctor", "lab"))
        args = [a for s in sets for a in ("--set", s)]
        r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(copy), "--steps", str(steps), *args],
                           cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-2000:])
        run = next((copy / "runs").iterdir())
        loop = json.loads((run / "summary.json").read_text())["phases_s"]["loop"]
        size = lambda name: (run / name).stat().st_size if (run / name).exists() else 0  # noqa: E731
        return loop, size("samples.jsonl"), size("tokens.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    arms = {"no samples": ["metrics.samples_groups=0"], "samples (default)": []}
    if a.record:
        arms["samples + token record"] = [f"metrics.record_tokens={a.steps}"]
    got: dict[str, list] = {name: [] for name in arms}
    for rep in range(a.repeats):
        for name, sets in arms.items():
            got[name].append(one(a.workspace, a.steps, sets))
            loop, samples, tokens = got[name][-1]
            print(f"repeat {rep + 1}, {name}: loop {loop:.1f} s, samples {samples / 1e3:.0f} kB, "
                  f"tokens {tokens / 1e3:.0f} kB", flush=True)
    base = statistics.mean(x[0] for x in got["no samples"])
    for name, xs in got.items():
        loops = [x[0] for x in xs]
        print(f"{name}: loop {statistics.mean(loops):.2f} s (runs {', '.join(f'{v:.1f}' for v in loops)}), "
              f"{statistics.mean(loops) / base - 1:+.1%} against no samples")


if __name__ == "__main__":
    main()
