"""The guard's slide rule replayed offline on recorded runs (#64): where would it trip, and how close
to tripping does a healthy run come. Not a test: figures for docs/runs.md.

    .venv/bin/python tests/bench/guard_slide.py RUN [RUN ...] [--window 30] [--z 4] [--drop 0.25]

For each run folder (metrics.jsonl, recipe.toml) the real `Guard` of minirl/run/guard.py decides
step by step on the logged signals (KL, entropy, reward, loss, grad norm), once with today's rules
alone (slide_window = 0) and once with the slide rule, and the script prints: the first step each
would act on (the patience included), the largest slide statistic z the run reached (how many
standard errors its recent reward window fell below its best) and its step, and the largest
fraction of the best window's mean a later window lost. A
run that was rolled back is replayed as it ran (its logged signals after the rollback), so the
second half of such a row says what the rule saw, not what it would have changed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from minirl.run.guard import Guard  # noqa: E402


def replay(run: Path, *, window: int, z: float, drop: float) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rec = tomllib.loads((run / "recipe.toml").read_text())
    settings = {**rec.get("guard", {}), "enabled": True, "max_rollbacks": 10**6}
    out = {"run": run.name, "steps": len(rows), "prompts": rec["train"]["prompts_per_step"],
           "reward_first": rows[0]["rollout/reward_mean"], "reward_last": rows[-1]["rollout/reward_mean"],
           "rolled_back": sum(1 for r in rows if r.get("guard/action") == "rollback")}
    for label, w in (("today", 0), ("slide", window)):
        g = Guard.from_settings(settings, slide_window=w, slide_z=z, slide_drop_frac=drop,
                                prompts=rec["train"]["prompts_per_step"])
        first, peak, peak_at, lost = None, 0.0, None, 0.0
        for r in rows:
            v = g.decide(kl=r["train/kl_mu_pi_old"], entropy=r["train/entropy"], reward=r["rollout/reward_mean"],
                         loss=r["train/loss"], grad_norm=r["train/grad_norm"])
            if w and g.slide[0] > peak:  # the statistic the rule itself judged this step
                peak, peak_at = g.slide[0], r["step"]
            lost = max(lost, g.slide[1])
            if first is None and v.action in ("rollback", "stop"):
                first = (r["step"], v.reason)
        out[label] = {"first_trip": first[0] if first else None, "reason": first[1][:90] if first else ""}
        if w:
            out[label] |= {"max_z": round(peak, 2), "max_z_at": peak_at, "max_drop": round(lost, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--z", type=float, default=4.0)
    ap.add_argument("--drop", type=float, default=0.25)
    a = ap.parse_args()
    print("| run | steps | reward first → last | rolled back | today's guard acts at | slide rule acts at | max z (step) "
          "| largest drop from the best window |")
    print("|---|---|---|---|---|---|---|---|")
    for run in a.runs:
        r = replay(run, window=a.window, z=a.z, drop=a.drop)
        print(f"| {r['run']} | {r['steps']} | {r['reward_first']:.3f} → {r['reward_last']:.3f} | {r['rolled_back']} | "
              f"{r['today']['first_trip'] or '-'} | {r['slide']['first_trip'] or '-'} | "
              f"{r['slide']['max_z']} ({r['slide']['max_z_at']}) | {r['slide']['max_drop']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
