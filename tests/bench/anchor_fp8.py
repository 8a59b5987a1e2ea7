"""#79: the clip's anchor for tokens sampled behind, at a rollout precision, at equal steps.

    .venv/bin/python tests/bench/anchor_fp8.py --default WS --scratchpad WS [--precision fp8] \
        [--steps 300] [--seeds 3] [--ks 0,1,2] [--arms sampler,proximal,proximal-mask] [--out FILE]

Each cell is a `minirl run` of the workspace (`--steps`, `train.seed` = the seed, the guard on as
shipped) at `rollout.precision` and `rollout.max_staleness = k`, one batch at a time (seeded: a cell
repeats exactly). The arms, for tokens sampled behind (k ≥ 1; at k = 0 nothing is behind, so k = 0
runs the default once as the synchronous reference):

    sampler        the clip's ratio anchored at the sampler's log μ (loss.clip_against = "sampler")
    proximal       anchored at π_old at the trained weights, the IS weight π_θ/μ truncated at
                   loss.tis_cap (decoupled PPO's proximal anchor with a behaviour-ratio truncation)
    proximal-mask  the same with tokens whose weight passes the cap masked out (AReaL's decoupled
                   form: behav_imp_weight_cap filters tokens; loss.is_mode = "mask")

Results go to `--out` (JSON, one entry a cell; a cell already there is not run again) and a table
is printed per task: held-out gain (points) per seed and its mean as a share of k = 0's, paired
per seed; rollbacks; and the step means of the clip split by cause (objective.clip_causes), the
KL(μ‖π_old) and the parity. A run's checkpoints and HF folder are removed once read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {"sampler": {"loss.clip_against": "sampler", "loss.is_mode": "truncate"},
        "proximal": {"loss.clip_against": "proximal", "loss.is_mode": "truncate"},
        "proximal-mask": {"loss.clip_against": "proximal", "loss.is_mode": "mask"}}
SPLIT = ("loss/clip_frac", "loss/clip_frac_stale", "loss/clip_frac_fresh", "loss/clip_frac_mismatch",
         "loss/clip_frac_movement", "loss/stale_frac", "loss/mismatch_out_of_band", "train/kl_mu_pi_old")


def run_cell(ws: Path, *, precision: str, k: int, arm: str, seed: int, steps: int) -> dict:
    sets = {"train.seed": seed, "train.steps": steps, "rollout.precision": precision, "rollout.max_staleness": k,
            **ARMS[arm]}
    args = [sys.executable, "-m", "cli.main", "run", str(ws), *[x for kv in sets.items() for x in ("--set", f"{kv[0]}={kv[1]}")]]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{ws.name} k={k} {arm} seed={seed}: exit {r.returncode}\n{r.stderr[-2000:]}")
    run = max((ws / "runs").iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    metric = next(m for m in summary["heldout"]["end"] if m.startswith("avg@"))
    parity = [m["sync/parity_abs_dlogp"] for m in rows if "sync/parity_abs_dlogp" in m]
    out = {"run": str(run), "steps": len(rows), "start": summary["heldout"]["start"][metric],
           "end": summary["heldout"]["end"][metric], "status": summary["status"],
           "rollbacks": sum(m.get("guard/action") in ("rollback", "stop") for m in rows),
           "staleness": statistics.fmean(m.get("rollout/staleness_mean", 0.0) for m in rows),
           "parity": statistics.fmean(parity) if parity else None,
           **{key: statistics.fmean(m.get(key, 0.0) for m in rows) for key in SPLIT}}
    for sub in ("checkpoints", "hf"):
        shutil.rmtree(run / sub, ignore_errors=True)
    return out


def table(task: str, cells: dict, seeds: list[int], arms: list[tuple[int, str]]) -> list[str]:
    def gain(c: dict) -> float:
        return 100 * (c["end"] - c["start"])

    ref = {s: cells.get(f"{task}/0/sampler/{s}") for s in seeds}
    lines = [f"### {task}", "", "| k | arm | gains (points, per seed) | mean, of k = 0 | paired | rollbacks | "
             "clip: stale / fresh | clip: mismatch / movement | stale tokens | π_old/μ out of band | KL(μ‖π_old) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, arm in arms:
        got = [(s, cells.get(f"{task}/{k}/{arm}/{s}")) for s in seeds]
        got = [(s, c) for s, c in got if c is not None]
        if not got:
            continue
        gains = [gain(c) for _, c in got]
        base = [gain(ref[s]) for s, _ in got if ref[s] is not None]
        share = (f"{statistics.fmean(gains):+.1f}, {statistics.fmean(gains) / statistics.fmean(base):.0%}"
                 if len(base) == len(gains) and statistics.fmean(base) > 0 else f"{statistics.fmean(gains):+.1f}")
        paired = [gain(c) / gain(ref[s]) for s, c in got if ref[s] is not None and gain(ref[s]) > 0]
        pr = f"{min(paired):.0%}–{max(paired):.0%}" if paired and k else "—"
        mean = lambda key: statistics.fmean(c[key] for _, c in got)  # noqa: E731
        lines.append(f"| {k} | {arm if k else 'synchronous'} | {' / '.join(f'{g:.1f}' for g in gains)} | {share} | {pr} | "
                     f"{sum(c['rollbacks'] for _, c in got)} | {mean('loss/clip_frac_stale'):.4f} / "
                     f"{mean('loss/clip_frac_fresh'):.4f} | {mean('loss/clip_frac_mismatch'):.4f} / "
                     f"{mean('loss/clip_frac_movement'):.4f} | {mean('loss/stale_frac'):.2f} | "
                     f"{mean('loss/mismatch_out_of_band'):.4f} | {mean('train/kl_mu_pi_old'):.2e} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--default", type=Path)
    ap.add_argument("--scratchpad", type=Path)
    ap.add_argument("--precision", default="fp8")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ks", default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", type=Path, default=Path("anchor-fp8.json"))
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    tasks = {name: ws for name, ws in (("default", a.default), ("scratchpad", a.scratchpad)) if ws is not None}
    seeds = list(range(a.seeds))
    arms = [(int(k), arm) for k in a.ks.split(",") for arm in (a.arms.split(",") if int(k) else ["sampler"])]
    cells = json.loads(a.out.read_text()) if a.out.exists() else {}
    if not a.report_only:
        # seed by seed, so that paired comparisons complete in order
        for seed in seeds:
            for task, ws in tasks.items():
                for k, arm in arms:
                    key = f"{task}/{k}/{arm}/{seed}"
                    if key in cells:
                        continue
                    cells[key] = run_cell(ws, precision=a.precision, k=k, arm=arm, seed=seed, steps=a.steps)
                    a.out.write_text(json.dumps(cells, indent=1))
                    c = cells[key]
                    print(f"{key}: {c['start']:.3f} -> {c['end']:.3f}, rollbacks {c['rollbacks']}, clip "
                          f"{c['loss/clip_frac']:.4f}", flush=True)
    print(f"rollout.precision = {a.precision}, {a.steps} steps, seeds {seeds}\n")
    for task in tasks:
        print("\n".join(table(task, cells, seeds, arms)) + "\n")


if __name__ == "__main__":
    main()
