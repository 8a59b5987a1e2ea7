"""Benchmark: where minirl's step goes, and minirl against TRL's GRPOTrainer to the same accuracy.

    .venv/bin/python tests/bench/speed.py demo [--runs 6] [--target 0.65] [--seconds 120]

One command, four parts; it prints figures and asserts nothing (speed belongs here, never in a
timed test):
1. time to target: `minirl run` and TRL's GRPOTrainer (tests/bench/trl_grpo.py), alternately,
   `--runs` times each, on copies of the workspace (its runs/ stays untouched). Same cold start,
   data, reward, G, prompts per step, lr, max tokens and T. Run i of each side uses seed i
   (`--same-seed`: every run seed `--seed`): the spread then covers trajectories, not only timing. Both score the held-out set avg@k
   every `--eval-every` steps with the training clock stopped; the RL wall time to the first
   score ≥ `--target` is reported min / median / max, with engine start-up apart and included.
2. minirl's step-time breakdown (rollout, grading, π_old, update, sync, parity, checkpoints and
   the loop's own overhead) as shares of the RL clock, from the same runs' summaries.
3. peak RSS of each side's process (os.wait4).
4. scaling: minirl's step time against G (4 → 32), response length and model size (the tiny
   default, ~4× and ~16× parameters), from short runs of untrained models of those sizes.
`--record R.json` keeps every run of both sides (curves, steps, memory, seeds, commit, host) and `--plot P.png`
draws held-out against RL time and steps (tests/bench/speed_plot.py, which redraws from a record).

TRL is installed into .bench/trl on first use (`pip install --target`, pinned, no
dependencies: it runs on minirl's own torch and transformers), and only the TRL process has it
on its PYTHONPATH; it is never a dependency of minirl.
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
import time
from pathlib import Path

import host  # tests/bench/host.py, beside this file

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
MINIRL = str(Path(PY).with_name("minirl"))
TRL_DIR = ROOT / ".bench" / "trl"
TRL_PINS = ["trl==1.16.0", "accelerate==1.15.0"]
QUIET = {**os.environ, "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}


def ensure_trl() -> Path:
    stamp = TRL_DIR / ".pins"
    if not (stamp.exists() and stamp.read_text() == " ".join(TRL_PINS)):
        print(f"installing {' '.join(TRL_PINS)} into {TRL_DIR} (benchmark only)", flush=True)
        shutil.rmtree(TRL_DIR, ignore_errors=True)
        subprocess.run([PY, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(TRL_DIR), *TRL_PINS],
                       check=True)
        stamp.write_text(" ".join(TRL_PINS))
    return TRL_DIR


def timed_process(cmd: list[str], *, env: dict, log: Path) -> tuple[float, float]:
    """Run cmd; (wall seconds, peak RSS in GB of that process and its children waited for)."""
    t0 = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:3]} failed ({os.waitstatus_to_exitcode(status)}); see {log}")
    return time.time() - t0, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def workspace_copy(ws: Path, into: Path) -> Path:
    dst = into / ws.name
    shutil.copytree(ws, dst, ignore=shutil.ignore_patterns("runs"))
    return dst


def minirl_once(ws: Path, tmp: Path, a, sets: list[str], tag: str, seed: int) -> dict:
    w = workspace_copy(ws, tmp / tag)
    # time_limit_s is wall time (held-out evals included): give it room, then cut at the RL clock
    cmd = [MINIRL, "run", str(w), "--steps", "100000", "--set", f"train.time_limit_s={1.6 * a.seconds + 10:.0f}",
           "--set", f"eval.every={a.eval_every}", "--set", f"eval.max_problems={a.eval_problems}",
           "--set", f"train.seed={seed}"]
    for s in sets:
        cmd += ["--set", s]
    wall, rss = timed_process(cmd, env=QUIET, log=tmp / f"{tag}.log")
    run = next((w / "runs").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    key = summary["heldout"]["metric"]
    curve = [[0, 0.0, summary["heldout"]["start"][key]]]
    curve += [[r["step"], r["timing/loop_s"], r[f"heldout/{key}"]] for r in rows
              if f"heldout/{key}" in r and r["timing/loop_s"] <= a.seconds]
    ph = summary["phases_s"]
    shutil.rmtree(w, ignore_errors=True)
    return {"side": "minirl", "startup_s": ph["startup"], "curve": curve, "steps": summary["steps"],
            "rl_s": ph["loop"], "wall_s": wall, "rss_gb": rss, "phases": ph, "env": summary["env"], "seed": seed,
            "metric": key}


def trl_once(ws: Path, tmp: Path, a, tag: str, seed: int) -> dict:
    out = tmp / f"{tag}.json"
    env = {**QUIET, "PYTHONPATH": str(ensure_trl())}
    cmd = [PY, str(ROOT / "tests/bench/trl_grpo.py"), str(ws), "--seconds", str(a.seconds), "--eval-every",
           str(a.eval_every), "--eval-problems", str(a.eval_problems), "--seed", str(seed), "--out", str(out)]
    wall, rss = timed_process(cmd, env=env, log=tmp / f"{tag}.log")
    return {**json.loads(out.read_text()), "wall_s": wall, "rss_gb": rss, "seed": seed}


def to_target(res: dict, target: float) -> float | None:
    return next((rl_s for _, rl_s, v in res["curve"] if v >= target), None)


def steps_to_target(res: dict, target: float) -> int | None:
    return next((step for step, _, v in res["curve"] if v >= target), None)


def step_ms(res: dict) -> float | None:
    return 1000 * res["rl_s"] / res["steps"] if res["steps"] else None


def mmm(xs: list[float], fmt: str = "{:.1f}") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "not reached"
    return " / ".join(fmt.format(v) for v in (min(xs), statistics.median(xs), max(xs)))


PHASES = ["rollout", "grade", "old_logp", "update", "sync", "parity", "checkpoint"]


def breakdown(results: list[dict]) -> None:
    print("\n## minirl step-time breakdown (share of the RL clock; median over runs)")
    shares = {p: [] for p in [*PHASES, "loop overhead"]}
    per_step = {p: [] for p in shares}
    for r in results:
        ph, loop, n = r["phases"], r["phases"]["loop"], max(r["steps"], 1)
        for p in PHASES:
            shares[p].append(ph.get(p, 0.0) / loop)
            per_step[p].append(1e3 * ph.get(p, 0.0) / n)
        other = loop - sum(ph.get(p, 0.0) for p in PHASES)
        shares["loop overhead"].append(other / loop)
        per_step["loop overhead"].append(1e3 * other / n)
    print(f"{'phase':16s} {'share':>8s} {'ms/step':>9s}")
    for p in shares:
        print(f"{p:16s} {100 * statistics.median(shares[p]):7.1f}% {statistics.median(per_step[p]):9.1f}")
    steps_s = [r["steps"] / r["phases"]["loop"] for r in results]
    print(f"steps per second: {mmm(steps_s, '{:.2f}')}  (min / median / max)")
    print(f"weight sync: {mmm(per_step['sync'], '{:.1f}')} ms per step, "
          f"{mmm([100 * s for s in shares['sync']], '{:.2f}')} % of the step")
    print("loop overhead = the RL clock less rollout, grading, π_old, update, sync, parity and checkpoints "
          "(sampling prompts, advantages, batching, metrics, the row write)")


def race(ws: Path, tmp: Path, a) -> list[dict]:
    print(f"## time to held-out avg@k ≥ {a.target}: minirl vs TRL GRPOTrainer, {a.runs} alternating runs each, "
          f"budget {a.seconds:.0f} s of RL, held-out scored every {a.eval_every} steps on {a.eval_problems} problems")
    mine, theirs = [], []
    for i in range(a.runs):
        seed = a.seed if a.same_seed else a.seed + i  # run i of each side: the same seed
        mine.append(minirl_once(ws, tmp, a, a.minirl_set, f"minirl{i}", seed))
        print(f"  minirl run {i + 1}: {mine[-1]['steps']} steps, to target {to_target(mine[-1], a.target)} s, "
              f"curve {[(s, round(v, 3)) for s, _, v in mine[-1]['curve']]}", flush=True)
        if not a.skip_trl:
            theirs.append(trl_once(ws, tmp, a, f"trl{i}", seed))
            print(f"  TRL run {i + 1}: {theirs[-1]['steps']} steps, to target {to_target(theirs[-1], a.target)} s, "
                  f"curve {[(s, round(v, 3)) for s, _, v in theirs[-1]['curve']]}", flush=True)
    print(f"\n{'min / median / max':38s} {'minirl':>26s} {'TRL GRPOTrainer':>26s}")
    sides = [("minirl", mine), ("TRL", theirs)]

    def row(label, fn, fmt="{:.1f}"):
        print(f"{label:38s} " + " ".join(f"{mmm([fn(r) for r in rs], fmt):>26s}" for _, rs in sides))

    row("RL wall time to target (s)", lambda r: to_target(r, a.target))
    row("  + engine start-up (s)", lambda r: None if to_target(r, a.target) is None else
        to_target(r, a.target) + r["startup_s"])
    row("start-up before the first step (s)", lambda r: r["startup_s"])
    row("steps to target", lambda r: steps_to_target(r, a.target), "{:.0f}")
    row("steps per second", lambda r: r["steps"] / r["rl_s"] if r["rl_s"] else None, "{:.2f}")
    row("held-out at the end of the budget", lambda r: r["curve"][-1][2], "{:.3f}")
    row("whole process, wall (s)", lambda r: r["wall_s"])
    row("peak RSS (GB)", lambda r: r["rss_gb"], "{:.2f}")
    t_m = [to_target(r, a.target) for r in mine]
    t_t = [to_target(r, a.target) for r in theirs]
    if theirs and None not in t_m and None not in t_t:
        med = statistics.median
        s_m = med([to_target(r, a.target) + r["startup_s"] for r in mine])
        s_t = med([to_target(r, a.target) + r["startup_s"] for r in theirs])
        print(f"ratio minirl / TRL, median RL wall time to target: {med(t_m) / med(t_t):.2f} "
              f"(with start-up: {s_m / s_t:.2f})")
        # the ratio is (time a step) x (steps to the target): which of the two moved it
        ms = [med([step_ms(r) for r in rs]) for rs in (mine, theirs)]
        st = [med([steps_to_target(r, a.target) for r in rs]) for rs in (mine, theirs)]
        print(f"  time a step, median: {ms[0]:.0f} against {ms[1]:.0f} ms ({ms[0] / ms[1]:.2f}); "
              f"steps to target, median: {st[0]:.0f} against {st[1]:.0f} ({st[0] / st[1]:.2f})")
    return mine, theirs


def keep(mine: list[dict], theirs: list[dict], a) -> None:
    """--record: every run of both sides as JSON (what speed_plot.py redraws); --plot: the figure."""
    record = {"commit": host.commit(), "host": host.machine(mine[0]["env"]), "target": a.target,
              "metric": mine[0]["metric"], "seconds": a.seconds, "eval_every": a.eval_every, "runs": mine + theirs}
    if a.record:
        a.record.write_text(json.dumps(record, indent=1))
        print(f"record: {a.record}")
    if a.plot:
        import speed_plot  # tests/bench/speed_plot.py, beside this file

        print(f"plot: {speed_plot.draw(record, a.plot)}")


def scaling(ws: Path, tmp: Path, a) -> None:
    """Step time against G, response length and model size, from short runs (untrained models for
    length and size: an untrained model rarely says EOS, so its responses run to max_tokens)."""
    from minirl.models.shapes import TINY
    from minirl.train.hf_io import save_hf_folder
    from minirl.train.trainer import Trainer

    print("\n## scaling: minirl step time (ms, median of steps 4..N; the step's own phases)")

    def step_ms(w: Path, sets: list[str], steps: int, tag: str) -> dict:
        cmd = [MINIRL, "run", str(w), "--steps", str(steps), "--set", "eval.max_problems=16",
               "--set", "checkpoint.every=1000", *[x for s in sets for x in ("--set", s)]]
        timed_process(cmd, env=QUIET, log=tmp / f"{tag}.log")
        run = sorted((w / "runs").iterdir())[-1]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        loop = [b["timing/loop_s"] - a_["timing/loop_s"] for a_, b in zip(rows[2:], rows[3:])]
        return {"step": 1e3 * statistics.median(loop), "len": statistics.median(r["rollout/resp_len"] for r in rows)}

    w = workspace_copy(ws, tmp / "scale")
    for G in (4, 8, 16, 32):
        r = step_ms(w, [f"train.group_size={G}"], 12, f"scaleG{G}")
        print(f"  G = {G:2d} (32 prompts, trained tiny): {r['step']:7.1f} ms per step, responses {r['len']:.1f} tokens")

    def untrained(shape, name: str) -> Path:
        tr = Trainer(shape, lr=0.0, seed=1)
        folder = tmp / name
        save_hf_folder(folder, shape, tr.full_state_dict(), tokenizer_dir=ws / "model" / "coldstart")
        return folder, sum(p.numel() for p in tr.model.parameters())

    import dataclasses

    sizes = [("tiny", TINY), ("~4x", dataclasses.replace(TINY, dim=128, moe_hidden_dim=256)),
             ("~16x", dataclasses.replace(TINY, dim=256, moe_hidden_dim=512))]
    for label, shape in sizes:
        folder, n = untrained(shape, f"model-{label}")
        for max_tokens in ((8, 24, 40) if label == "tiny" else (8,)):
            r = step_ms(w, [f"model.path={folder}", f"rollout.max_tokens={max_tokens}"], 10, f"scale{label}{max_tokens}")
            print(f"  {label:5s} ({n / 1e6:.1f}M params), max_tokens {max_tokens:2d}: {r['step']:7.1f} ms per step, "
                  f"responses {r['len']:.1f} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--runs", type=int, default=6,
                    help="alternating runs a side; threshold crossings come in steps of --eval-every, "
                         "so a ratio near a bound needs six or more")
    ap.add_argument("--target", type=float, default=0.65)
    ap.add_argument("--seconds", type=float, default=120.0, help="RL budget per run")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-problems", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--same-seed", action="store_true",
                    help="every run uses --seed (by default run i of each side uses seed + i: the spread "
                         "then covers the trajectories too, not only timing; one seeded trajectory's "
                         "threshold crossing is one draw)")
    ap.add_argument("--minirl-set", action="append", default=[], help="recipe override for minirl's side")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--record", type=Path, help="write every run of both sides here (JSON: curves, steps, memory)")
    ap.add_argument("--plot", type=Path, help="draw held-out against RL time and steps here (PNG; speed_plot.py)")
    a = ap.parse_args()
    ws = a.workspace.resolve()
    if not (ws / "minirl.toml").exists():
        raise SystemExit(f"{ws} is not a minirl workspace (minirl init {a.workspace} first)")
    print(f"commit: {host.commit()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="minirl-bench-") as d:
        tmp = Path(d)
        mine, theirs = race(ws, tmp, a)
        print(f"host (minirl's first run): {host.machine(mine[0]['env'])}")
        keep(mine, theirs, a)
        breakdown(mine)
        print(f"peak RSS of the default run: {mmm([r['rss_gb'] for r in mine], '{:.2f}')} GB")
        if not a.skip_scaling:
            scaling(ws, tmp, a)


if __name__ == "__main__":
    main()
