"""Benchmark: the RL loop on a quiet machine and beside one busy process. Prints figures, asserts nothing.

    .venv/bin/python tests/bench/busy.py WORKSPACE [--steps 40] [--repeats 3] [--also ENV=VALUE[,ENV=VALUE...]]

Each repeat runs `minirl run` on a copy of the workspace for --steps steps twice: alone, and beside
a process that keeps one core busy (`python -c "while True: pass"`, as a user's other job would).
The figure is the run's own RL-loop time (summary.json's phases_s.loop: rollouts, grading and
updates, no start-up or held-out evaluation). `--also ENV=VALUE[,ENV=VALUE...]` adds the same pair under that
environment (repeatable), e.g. the settings before a change, so both are measured alike,
alternating, on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import host  # tests/bench/host.py, beside this file

ROOT = Path(__file__).resolve().parents[2]


def loop_seconds(ws: Path, steps: int, env: dict, busy: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ws"
        shutil.copytree(ws, copy, ignore=shutil.ignore_patterns("runs", "evals", "doctor", "lab"))
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            subprocess.run([sys.executable, "-m", "cli.main", "run", str(copy), "--steps", str(steps)], cwd=ROOT,
                           env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        summary = json.loads(next((copy / "runs").glob("*/summary.json")).read_text())
        return {**summary["phases_s"], "env": summary["env"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--also", action="append", default=[], metavar="ENV=VALUE[,ENV=VALUE...]")
    a = ap.parse_args()
    settings = {"as shipped": {}}
    for item in a.also:
        settings[item] = dict(pair.partition("=")[::2] for pair in item.split(","))
    commit = host.commit()  # before the runs: what they measured
    got: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(a.repeats):  # alternating, so a slow minute hits every figure alike
        for name, env in settings.items():
            for busy in (False, True):
                got.setdefault((name, busy), []).append(loop_seconds(a.workspace, a.steps, env, busy))
    print(f"commit {commit}; host (the first run): {host.machine(got[('as shipped', False)][0]['env'])}")
    print(f"{a.steps} steps, {a.repeats} repeat(s), {os.cpu_count()} cores; RL loop seconds, min / median / max")
    for name in settings:
        quiet = [p["loop"] for p in got[(name, False)]]
        busy = [p["loop"] for p in got[(name, True)]]
        part = lambda key, b: statistics.median(p[key] for p in got[(name, b)])  # noqa: E731
        print(f"{name:28s} quiet {min(quiet):6.1f} / {statistics.median(quiet):6.1f} / {max(quiet):6.1f}   "
              f"one core busy {min(busy):6.1f} / {statistics.median(busy):6.1f} / {max(busy):6.1f}   "
              f"ratio {statistics.median(busy) / statistics.median(quiet):.2f}x   "
              f"(rollout {part('rollout', False):.1f} -> {part('rollout', True):.1f}, "
              f"update {part('update', False):.1f} -> {part('update', True):.1f})")


if __name__ == "__main__":
    main()
