"""Benchmark: what the `code` grader costs. Prints figures, asserts nothing.

    .venv/bin/python tests/bench/code_grader.py [--data ../shared/data/code/humaneval.jsonl] [--repeats 3]

1. HumanEval's 164 canonical solutions and 164 bare prompts through `CodeGrader.grade_batch`
   (328 gradings), wall time;
2. a batch of 256 responses (canonical solutions, cycled) against what 256 short Python processes
   cost on this machine: `python -I -c pass` started 256 times, one at a time and with the
   grader's parallelism, and the same in the sandbox with nothing to test;
3. what each protection layer adds to one run (prlimit, + namespaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rewards import sandbox  # noqa: E402
from rewards.code import CodeGrader  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def processes(n: int, parallel: int, cmd: list[str]) -> float:
    def one(_):
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=sandbox.ENV)

    with ThreadPoolExecutor(parallel) as pool:
        return timed(lambda: list(pool.map(one, range(n))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "code" / "humaneval.jsonl")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = [json.loads(x) for x in args.data.read_text().splitlines()]
    grader = CodeGrader()
    print(f"protections here: {sandbox.protections()}; parallel sandboxes: {grader.parallel}")
    both = [(r, r["canonical_solution"]) for r in rows] + [(r, "") for r in rows]
    batch = [(r, r["canonical_solution"]) for r in (rows * 2)[:256]]
    python = [sys.executable, "-I", "-c", "pass"]
    fig: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # alternating, so a slow minute hits every figure alike
        for name, fn in {
            "328 HumanEval gradings (164 canonical + 164 bare)": lambda: grader.grade_batch(both),
            "256 responses, one batch": lambda: grader.grade_batch(batch),
            "256 x `python -I -c pass`, one at a time": lambda: processes(256, 1, python),
            f"256 x `python -I -c pass`, {grader.parallel} at a time": lambda: processes(256, grader.parallel, python),
        }.items():
            fig.setdefault(name, []).append(timed(fn))
    for name, vals in fig.items():
        print(f"{name:60s} {min(vals):6.2f} / {statistics.median(vals):6.2f} / {max(vals):6.2f} s (min / median / max)")
    one = {"prlimit + namespaces + harness": lambda: sandbox.run({"program": "", "tests": []})}
    for name, fn in one.items():
        vals = [timed(fn) for _ in range(20)]
        print(f"one sandbox with nothing to test ({name}): median {1000 * statistics.median(vals):.1f} ms")


if __name__ == "__main__":
    main()
