"""Benchmark: LoRA RL against full RL on one workspace, side by side. Prints figures, asserts nothing.

    .venv/bin/python tests/bench/lora_vs_full.py WORKSPACE [--steps 300] [--seeds 3] [--rank 16] [--lr-factor 10 | --lr X]
                                                 [--warmup 0] [--only lora]

Each seed runs `minirl run` on a copy of the workspace twice, alternating: the recipe as it is
(every weight trains) and with [train.lora] (rank --rank, α = 2·rank, all targets, train.lr ×
--lr-factor as "LoRA Without Regret" advises, or --lr; warmed up over --warmup steps). The best
measured on the embedded default: --lr 5e-4 (docs/results/lora.md).
Per arm: held-out gain (after RL − cold start, avg@k), RL-loop steps/s, the maximum RSS of the
run's process, seconds per weight sync, and the size of the newest checkpoint folder. #54's bar:
LoRA's mean gain ≥ 75% of full RL's. --only runs one arm (the other's figures already known).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from metrics_digest import digest  # noqa: E402  (a sibling script)


def one_run(ws: Path, steps: int, seed: int, sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ws"
        shutil.copytree(ws, copy, ignore=shutil.ignore_patterns("runs", "evals", "doctor", "lab"))
        args = ["run", str(copy), "--steps", str(steps), "--set", f"train.seed={seed}"]
        args += [x for s in sets for x in ("--set", s)]
        rss_file = Path(tmp) / "maxrss"
        # the run's own maximum RSS, written as it exits (RUSAGE_CHILDREN would give the largest child so far)
        launcher = ("import atexit, resource, runpy, sys; f = sys.argv.pop(1); atexit.register(lambda: open(f, 'w')"
                    ".write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))); "
                    "runpy.run_module('cli.main', run_name='__main__')")
        subprocess.run([sys.executable, "-c", launcher, str(rss_file), *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)
        rss = int(rss_file.read_text())  # KiB
        run = next((copy / "runs").iterdir())
        summary = json.loads((run / "summary.json").read_text())
        ckpt = max((run / "checkpoints").glob("step_*"))
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file() and "hf" not in f.relative_to(ckpt).parts)
        phases = summary["phases_s"]
        print(f"  {run.name}: metrics digest {digest(run)}", flush=True)  # full arm, seed 0: README's run
        h = summary["heldout"]
        return {"gain": h["end"][h["metric"]] - h["start"][h["metric"]],
                "steps_per_s": steps / phases["loop"], "sync_s": phases.get("sync", 0.0) / steps,
                "max_rss_mib": rss / 1024, "ckpt_mib": size / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr-factor", type=float, default=10.0)
    ap.add_argument("--lr", type=float, default=None, help="the LoRA arm's train.lr (instead of --lr-factor)")
    ap.add_argument("--warmup", type=int, default=0, help="the LoRA arm's train.warmup_steps")
    ap.add_argument("--only", choices=["full", "lora"], default=None, help="run one arm (the other's figures known)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from minirl.config import recipes

    lr = recipes.load(a.workspace / "minirl.toml").train.lr
    arms = {"full": [], f"lora r{a.rank}": [f"train.lora.rank={a.rank}", f"train.lora.alpha={2 * a.rank}",
                                            f"train.lr={a.lr or lr * a.lr_factor:g}", f"train.warmup_steps={a.warmup}"]}
    if a.only:
        arms = {k: v for k, v in arms.items() if k.startswith(a.only)}
    got: dict[str, list[dict]] = {name: [] for name in arms}
    for seed in range(a.seeds):
        for name, sets in arms.items():
            got[name].append(one_run(a.workspace, a.steps, seed, sets))
            print(f"seed {seed} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in got[name][-1].items()), flush=True)
    print(f"\n{a.steps} steps, {a.seeds} seed(s), {os.cpu_count()} cores; mean (min–max) over seeds")
    for name, runs in got.items():
        cells = []
        for k in runs[0]:
            vals = [r[k] for r in runs]
            cells.append(f"{k} {statistics.fmean(vals):.4g} ({min(vals):.4g}–{max(vals):.4g})")
        print(f"{name:>10}: " + "; ".join(cells))
    if len(got) == 2:
        full, low = (statistics.fmean(r["gain"] for r in runs) for runs in got.values())
        print(f"LoRA's gain / full RL's: {low / full:.0%} (#54's bar: ≥ 75%)" if full > 0 else "full RL gained nothing")


if __name__ == "__main__":
    main()
