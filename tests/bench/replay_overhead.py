"""Benchmark: the step-time cost of R3 (route capture in vLLM + replay in TorchTitan), and
KL(μ_old ‖ π_old) with and without R3 for bf16 and FP8-emulated rollouts.

Two measurements of the overhead:
- isolated: one process, one fixed batch of the recipe's size, each R3 piece timed against its
  plain counterpart, alternating, 10 repeats (little noise);
- whole runs: 30-step runs with replay off and r3, each in its own process (noisier: different
  sampled trajectories; the run-to-run spread of two identical "off" runs is printed).

    .venv/bin/python tests/bench/replay_overhead.py demo [--steps 30]

Each configuration runs in its own process (two vLLM engines in one process distort timings), on
a copy of the workspace (its runs/ stays untouched); off and r3 alternate twice. It prints figures
and asserts nothing. Target from the issue: overhead ≤ 5% of step time.
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

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def run(ws_src: Path, steps: int, sets: list[str]) -> list[dict]:
    from minirl.config import recipes
    from minirl.run import lifecycle
    from minirl.setup.workspace import Workspace

    tmp = Path(tempfile.mkdtemp(prefix="minirl-bench-"))
    shutil.copytree(ws_src, tmp / "ws", ignore=shutil.ignore_patterns("runs", "evals"))
    ws = Workspace.open(tmp / "ws")
    rec = recipes.load(ws.recipe_path, [f"train.steps={steps}", "checkpoint.every=100000", "eval.max_problems=16",
                                       "rollout.parity_every=0", *sets])
    summary = lifecycle.run(ws, rec)
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    shutil.rmtree(tmp, ignore_errors=True)
    return rows


def phase_means(rows: list[dict], skip: int = 3) -> dict[str, float]:
    """Mean seconds per step of each phase, from the cumulative timing/* metrics, after warm-up."""
    a, b = rows[skip - 1], rows[-1]
    n = b["step"] - a["step"]
    return {k.removeprefix("timing/").removesuffix("_s"): (b[k] - a[k]) / n
            for k in b if k.startswith("timing/") and k != "timing/elapsed_s"}


def in_subprocess(ws: Path, steps: int, sets: list[str]) -> list[dict]:
    out = subprocess.run([sys.executable, __file__, str(ws), "--steps", str(steps), "--one", json.dumps(sets)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def isolated(ws_src: Path, repeats: int = 10) -> None:
    """Time capture (generate with vs without) and replay (π_old and update with vs without)."""
    import time

    from minirl.config import recipes
    from minirl.data.prompts import PromptSampler
    from minirl.rollout.vllm import VLLMEngine
    from minirl.setup.run_inputs import prepare_run
    from minirl.setup.workspace import Workspace
    from minirl.train.batch import build_batch
    from minirl.train.objective import loss_for
    from minirl.train.replay import rollout_routes
    from minirl.train.trainer import Trainer

    ws = Workspace.open(ws_src)
    rec = recipes.load(ws.recipe_path, ["train.replay=r3", "rollout.parity_every=0"])
    inputs = prepare_run(ws, rec, resume=None)
    B, G = rec.train.prompts_per_step, rec.train.group_size
    tr = Trainer.from_recipe(rec, inputs.shape, device="cpu")
    tr.load_hf(inputs.model_dir)
    eng = VLLMEngine.from_config(inputs.model_dir, rec.rollout, seed=rec.train.seed, capture_routes=True,
                                 max_model_len=rec.data.max_prompt_tokens + rec.rollout.max_tokens + 1)
    prompts = [p.prompt_ids for p in PromptSampler(inputs.train, seed=0).next_batch(B)]
    pad, shape = inputs.tokenizer.pad_token_id, inputs.shape
    t = {k: [] for k in ("gen", "gen_r3", "old", "old_r3", "upd", "upd_r3", "routes")}

    def timed(key, fn):
        t0 = time.perf_counter()
        out = fn()
        t[key].append(time.perf_counter() - t0)
        return out

    gen = lambda: eng.generate(prompts, n=G, temperature=1.0, max_tokens=rec.rollout.max_tokens, seed=5)  # noqa: E731
    for _ in range(repeats + 1):
        eng.capture_routes = False
        timed("gen", gen)
        eng.capture_routes = True
        groups = timed("gen_r3", gen)
        comps = [c for g in groups for c in g]
        batch = build_batch([p for p in prompts for _ in range(G)], [c.token_ids for c in comps],
                            [c.logprobs for c in comps], [0.1] * len(comps), pad_id=pad)
        routes = timed("routes", lambda: rollout_routes(comps, batch, tr.replay.num_layers, shape.top_k,
                                                        shape.num_experts))
        old, _, _ = timed("old", lambda: tr.logprobs(batch))
        timed("old_r3", lambda: tr.logprobs(batch, routes=routes))
        batch = batch.with_old_logp(old)
        fn = loss_for(rec.loss)
        timed("upd", lambda: tr.forward_backward(batch, fn))
        tr.optim.zero_grad()
        timed("upd_r3", lambda: tr.forward_backward(batch, fn, routes=routes))
        tr.optim.zero_grad()
    med = {k: statistics.median(v[1:]) for k, v in t.items()}  # first repeat is warm-up
    plain = med["gen"] + med["old"] + med["upd"]
    extra = (med["gen_r3"] - med["gen"]) + med["routes"] + (med["old_r3"] - med["old"]) + (med["upd_r3"] - med["upd"])
    print(f"isolated, batch {B}×{G}, median of {repeats}:")
    print(f"  generate      {med['gen']:.4f} s   with capture {med['gen_r3']:.4f} s")
    print(f"  build routes  {med['routes']:.4f} s")
    print(f"  π_old         {med['old']:.4f} s   with replay  {med['old_r3']:.4f} s")
    print(f"  update        {med['upd']:.4f} s   with replay  {med['upd_r3']:.4f} s")
    print(f"  R3 overhead: {extra:.4f} s = {100 * extra / plain:+.1f}% of rollout + π_old + update "
          f"({plain:.4f} s; a whole step also syncs and grades, so the share of a step is smaller)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration, print its rows
    ap.add_argument("--isolated", action="store_true", help="only the isolated measurement")
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run(args.workspace, args.steps, json.loads(args.one))))
        return
    if args.isolated:
        isolated(args.workspace)
        return
    print(subprocess.run([sys.executable, __file__, str(args.workspace), "--isolated"], capture_output=True,
                         text=True, check=True).stdout.strip())

    configs = {"off": ["train.replay=off"], "r3": ["train.replay=r3", "train.replay_diagnostics=false"]}
    times: dict[str, list[dict[str, float]]] = {"off": [], "r3": []}
    for _ in range(2):
        for name, sets in configs.items():
            times[name].append(phase_means(in_subprocess(args.workspace, args.steps, sets)))
    mean = {name: {k: statistics.mean(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}
    step = {name: sum(m.values()) for name, m in mean.items()}
    print(f"{args.steps} steps per run, 2 runs per configuration, first 3 steps of each excluded as warm-up")
    print(f"{'phase':<10} {'off s/step':>11} {'r3 s/step':>11}")
    for k in mean["off"]:
        print(f"{k:<10} {mean['off'][k]:>11.4f} {mean['r3'][k]:>11.4f}")
    print(f"{'step':<10} {step['off']:>11.4f} {step['r3']:>11.4f}")
    print(f"run-to-run spread of the off step time: {abs(sum(times['off'][0].values()) - sum(times['off'][1].values())):.4f} s")
    print(f"R3 overhead (capture + replay): {100 * (step['r3'] - step['off']) / step['off']:+.1f}% of step time")

    for label, sets in (("bf16", []), ("fp8", ["rollout.precision=fp8"])):
        rows = in_subprocess(args.workspace, args.steps, ["train.replay=r3", *sets])
        kl_r3 = statistics.mean(r["train/kl_mu_pi_old"] for r in rows)
        kl_off = statistics.mean(r["train/kl_mu_pi_old_noreplay"] for r in rows)
        agree = statistics.mean(r["replay/route_agreement"] for r in rows)
        print(f"{label} rollouts: KL(μ_old‖π_old) mean over {len(rows)} steps: no replay {kl_off:.2e}, "
              f"R3 {kl_r3:.2e}; rollout/trainer route agreement without replay {agree:.4f}")


if __name__ == "__main__":
    main()
