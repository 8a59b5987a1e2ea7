"""#79: the guard's parity rule replayed on runs' logged parity checks: how close healthy runs come.

    .venv/bin/python tests/bench/guard_parity.py RUN_OR_RUNS_DIR... [--set guard.KEY=VALUE ...]

Each run's `sync/parity_abs_dlogp` rows go through the real `Guard.observe_parity` (with the
recipe's [guard] section, or `--set` over it), in order; printed per run: its precision, k and
task, the parity checks, their range, the largest ratio of a check to the median of the good ones
before it (what `guard.parity_growth` is held against, once 3 are in) and the checks the rule
calls bad. A healthy run should have none; the largest ratio over healthy runs is the margin the
default leaves.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def replay(run: Path, sets: list[str]) -> dict:
    from minirl.config import recipes
    from minirl.run.guard import Guard

    rec = recipes.load(run / "recipe.toml", sets)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    # rows of older commits logged a check that was not due as NaN (the 2026-11-28 GPU visit): no check
    parities = [m["sync/parity_abs_dlogp"] for m in rows if math.isfinite(m.get("sync/parity_abs_dlogp", math.nan))]
    g = Guard.from_settings(rec.guard)
    ratios, bad = [], []
    for p in parities:
        if len(g.parities) >= 3:
            ratios.append(p / statistics.median(g.parities))
        g.observe_parity(p)
        if g.parity_bad:
            bad.append(round(p, 4))
    return {"run": run.name, "precision": rec.rollout.precision, "k": rec.rollout.max_staleness,
            "task": rec.cold_start.task, "checks": len(parities), "min": min(parities, default=None),
            "max": max(parities, default=None), "max_ratio": max(ratios, default=None), "bad": bad}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()
    runs = [r for p in a.runs for r in ([p] if (p / "metrics.jsonl").exists() else sorted(p.iterdir()))
            if (r / "metrics.jsonl").exists() and (r / "recipe.toml").exists()]
    got = [replay(r, a.sets) for r in runs]
    print("| run | task | precision | k | checks | parity min–max | largest ratio to the median before | bad |")
    print("|---|---|---|---|---|---|---|---|")
    for g in got:
        if not g["checks"]:
            continue
        ratio = f"{g['max_ratio']:.2f}" if g["max_ratio"] is not None else "—"
        print(f"| {g['run']} | {g['task']} | {g['precision']} | {g['k']} | {g['checks']} | {g['min']:.2e}–{g['max']:.2e} "
              f"| {ratio} | {g['bad'] or 'none'} |")
    ratios = [g["max_ratio"] for g in got if g["max_ratio"] is not None]
    if ratios:
        print(f"\nlargest ratio over these runs: {max(ratios):.2f}; runs with a bad check: {sum(bool(g['bad']) for g in got)}")


if __name__ == "__main__":
    main()
