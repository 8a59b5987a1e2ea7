"""`rollout.max_staleness` = k ≥ 1: the engine in a process of its own (rollout/process.py) that
samples ahead of the trainer, syncs queued behind what it samples, and runs at k = 2 (the bound,
checkpoints, a SIGKILL and a rollback).

The engine's process runs the real vLLM engine on the tiny model; the trainer's weights reach it
through shared memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minirl.errors import UsageError
from minirl.rollout.process import EngineProcess, split_cores

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[4, 5, 6, 13, 7, 8, 9, 16], [5, 5, 5, 13, 3, 3, 3, 16], [9, 9, 9, 13, 9, 9, 9, 16]]
SAMPLE = dict(n=4, temperature=1.0, max_tokens=6, seed=11)
# the tests of each engine process below run one after another on one worker (conftest.py): a
# module's fixture is torn down whenever a worker's next test is another module's, and each costs
# an interpreter that imports torch and vLLM
PROC = pytest.mark.together("async-proc")
INFLIGHT = pytest.mark.together("async-inflight")


def tokens(groups) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in g] for g in groups]


@pytest.fixture(scope="module")
def proc(tiny_dir):
    from minirl.config.recipe import RolloutConfig

    cores = sorted(os.sched_getaffinity(0))[-1:]  # the engine's process on one core, as overlapped on 2 cores
    p = EngineProcess(tiny_dir, RolloutConfig(precision="bf16", kv_cache_gib=0.25), cores=cores, seed=0,
                      max_model_len=32)
    yield p
    p.close()
    assert not p._proc.is_alive()


def test_split_cores_needs_two():
    with pytest.raises(UsageError, match="rollout.max_staleness ≥ 1 needs at least 2 cores"):
        split_cores({3})


@PROC
def test_engine_process_samples_as_the_engine_in_this_process(proc, engine):
    """Same weights, seed and settings: the same tokens and log-probs (seeded sampling does not
    depend on which process samples)."""
    theirs = proc.generate(PROMPTS, **SAMPLE)
    ours = engine.generate(PROMPTS, **SAMPLE)
    assert tokens(theirs) == tokens(ours)
    a = torch.tensor([x for g in theirs for c in g for x in c.logprobs])
    b = torch.tensor([x for g in ours for c in g for x in c.logprobs])
    torch.testing.assert_close(a, b)


@PROC
def test_a_queued_sync_leaves_the_rollouts_sent_before_it_and_the_trainer_free(proc, engine, tiny_dir):
    """A sync queued behind a rollout returns at once; the rollout samples by the weights before
    it, the next one by the weights after, and the trainer's parameters may change at once (the
    engine loads a snapshot). After it the engine's process scores exactly as an engine in this
    process given the same weights, by either path: the snapshot slots of an engine that writes its
    own tensors, and the copies any other engine is sent."""
    from minirl.models.shapes import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    weight_sync.queue(tr, proc, bucket_bytes=2**30, slots=2, version=0)
    before = tokens(proc.generate(PROMPTS, **SAMPLE))
    try:
        with torch.no_grad():
            for p in tr.model.parameters():
                p.mul_(1.5)
        handle = proc.submit("generate", PROMPTS, **SAMPLE)
        weight_sync.queue(tr, proc, bucket_bytes=2**30, slots=2, version=0)  # sent while the rollout runs; returns at once
        assert len(proc._pending) == 3  # the rollout, the second slot's binding and the sync: all under way
        with torch.no_grad():
            for p in tr.model.parameters():  # the trainer moves on: the engine holds a snapshot
                p.mul_(0.0)
        assert tokens(proc.result(handle)) == before  # sampled before the new weights were loaded
        after = proc.generate(PROMPTS, **SAMPLE)
        assert tokens(after) != before
        resp = [list(c.token_ids) for g in after for c in g]
        prompts = [p for p, g in zip(PROMPTS, after) for _ in g]
        tr.load_hf(tiny_dir)  # the weights the engine's process holds, for the engine here
        with torch.no_grad():
            for p in tr.model.parameters():
                p.mul_(1.5)
        weight_sync.sync(tr, engine, bucket_bytes=2**30)
        ours = torch.tensor(sum(engine.score(prompts, resp), []))
        torch.testing.assert_close(torch.tensor(sum(proc.score(prompts, resp), [])), ours, rtol=0, atol=0)
        assert proc.direct_sync and len(proc._slots) == 2  # both slots, each bound once in the engine's process
        proc.direct_sync = False  # an engine that does not write its own tensors: sent copies
        try:
            weight_sync.queue(tr, proc, bucket_bytes=2**30, slots=2, version=0)
        finally:
            proc.direct_sync = True
        torch.testing.assert_close(torch.tensor(sum(proc.score(prompts, resp), [])), ours, rtol=0, atol=0)
    finally:  # leave both engines as the module found them
        tr.load_hf(tiny_dir)
        weight_sync.sync(tr, engine, bucket_bytes=2**30)
        weight_sync.queue(tr, proc, bucket_bytes=2**30, slots=2, version=0)
    assert tokens(proc.generate(PROMPTS, **SAMPLE)) == before


@PROC
def test_a_rollback_cancels_the_batches_the_engine_has_not_answered(proc):
    """#74: at k = 4 a rollback's restored weights waited behind up to 4 discarded batches (trainer
    idle 80–89% for 5 steps). The engine's process drops the calls it is told to, queued or under
    way, and goes on to what was sent after; what it answered is counted at the seam."""
    big = dict(SAMPLE, max_tokens=24, n=8)
    under_way = proc.submit("generate", PROMPTS * 8, **big)
    queued = [proc.submit("generate", PROMPTS * 8, **big) for _ in range(3)]
    after = proc.submit("generate", PROMPTS[1:], **SAMPLE)  # the restored weights' batch
    assert proc.cancel([under_way, *queued]) == 4
    alone = tokens(proc.generate(PROMPTS[1:], **SAMPLE))
    assert tokens(proc.result(after)) == alone  # answered, and first after the cancel
    assert [h[0][0] for h in (under_way, *queued)] == ["cancelled"] * 4  # none finished


@PROC
def test_every_wait_on_the_engine_is_booked_as_the_trainers(proc, tiny_dir):
    """#74: the trainer's idle share missed waits booked as sync: a snapshot slot still being read, a
    parity check's settle (13.7 s of one k = 4 step read as 0.0001). Every wait goes through the
    engine process's answers now: of the time a caller is blocked, measured around the call here,
    `waited_s` books the waits, never more than that time and most of it (the rest is the trainer's
    own copy into the slot: 5.5% of it under a full suite's load, 2026-12-02, so no tighter bound:
    the bug booked 0.001% of it)."""
    import time as clock

    from minirl.models.shapes import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    big = dict(SAMPLE, max_tokens=24, n=8)
    blocked, booked = 0.0, proc.waited_s
    for version in (1, 2):
        proc.submit("generate", PROMPTS * 8, **big)  # the engine busy with a batch ...
        t0 = clock.perf_counter()
        weight_sync.queue(tr, proc, bucket_bytes=2**30, slots=1, version=version)  # ... the slot read? waited for
        proc.settle()  # as the parity check does before scoring
        blocked += clock.perf_counter() - t0
    booked = proc.waited_s - booked
    assert blocked > 0.05 and 0.5 * blocked <= booked <= blocked, (booked, blocked)


@PROC
def test_answers_keep_their_callers_and_errors_come_back_named(proc):
    first = proc.submit("generate", PROMPTS[:1], **SAMPLE)
    second = proc.submit("generate", PROMPTS[1:], **SAMPLE)
    alone = tokens(proc.generate(PROMPTS[1:], **SAMPLE))  # answered after both submitted ones
    assert tokens(proc.result(second)) == alone
    assert len(proc.result(first)) == 1
    with pytest.raises(RuntimeError, match="in the rollout engine's process: AttributeError"):
        proc.call("no_such_method")
    assert tokens(proc.generate(PROMPTS[1:], **SAMPLE)) == alone  # still serving


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_k2_runs_ahead_within_the_bound_and_a_rollback_discards_what_is_ahead(tiny_dir, tmp_path, short_tmpdir):
    """k = 2 through the CLI. Each batch is sampled by the weights of the syncs sent before it
    (a version known when it is admitted): staleness 0, 1, then 2 for every step. A checkpoint
    records the prompts of the steps trained (those of the batches ahead are drawn again by a
    resume: a SIGKILL and its resume at k = 2, the test below). A rollback discards what was
    ahead: the step after it trains a batch sampled by the restored weights."""
    from tests.conftest import cli_telling_imports, data_workspace

    ws = data_workspace(tmp_path / "ws")
    shutil.copytree(tiny_dir, ws / "model/coldstart")
    args = ["--set", "rollout.max_staleness=2", "--set", "train.prompts_per_step=8", "--set", "train.group_size=4",
            "--set", "checkpoint.every=2", "--set", "eval.k=1"]
    run = [sys.executable, "-m", "cli.main", "run", str(ws)]
    r = subprocess.run([*cli_telling_imports(), "run", str(ws), "--steps", "6", *args, "--set", "checkpoint.keep=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(short_tmpdir)})  # its and its engine's
    left = list(short_tmpdir.glob("vllm_dist_*"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not left, left  # the file the engine process's groups met through, deleted as it ends
    # the trainer's process never imports vLLM, its syncs and its final HF folder included: vLLM's
    # import patches torch's compiler and sets the process's environment
    assert r.stderr.strip().splitlines()[-1] == "imported: True False", r.stderr[-2000:]
    run_dir = next((ws / "runs").iterdir())
    rows = _rows(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    assert [m["rollout/staleness_max"] for m in rows] == [0, 1, 2, 2, 2, 2]
    assert [m["rollout/batches_ahead"] for m in rows] == [2, 2, 2, 2, 1, 0]  # none past the run's last step
    extra = json.loads((run_dir / "checkpoints/step_000002/minirl.json").read_text())
    assert extra["sampler"] == {"epoch": 0, "pos": 16}  # batches 3 and 4 were drawn too; a resume draws them again
    assert all(0 <= m["timing/engine_idle_frac"] <= 1 and 0 <= m["timing/trainer_idle_frac"] <= 1 for m in rows)
    # on the RL clock: the engine's start and the held-out evaluations are not the trainer's waits (#74)
    assert all(m["timing/trainer_wait_s"] <= m["timing/loop_s"] for m in rows), \
        [(m["timing/trainer_wait_s"], m["timing/loop_s"]) for m in rows]
    extra = json.loads((run_dir / "checkpoints/step_000006/minirl.json").read_text())
    assert extra["sampler"] == {"epoch": 0, "pos": 48}

    # every step is a bad one (KL above −1): the guard rolls back after 2, once, then stops
    r = subprocess.run([*run, "--steps", "6", *args, "--set", "guard.max_kl=-1", "--set", "guard.patience=2",
                        "--set", "guard.max_rollbacks=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    run_dir = max((ws / "runs").iterdir())
    rows = _rows(run_dir)
    back = [m["step"] for m in rows if m.get("guard/action") == "rollback"]
    assert back, r.stderr[-3000:]
    after = [m for m in rows if m["step"] == back[0] + 1]
    assert not after or after[0]["rollout/staleness_max"] == 0  # sampled by the restored weights
    assert all(m["rollout/staleness_max"] <= 2 for m in rows) and len({m["step"] for m in rows}) == len(rows)


@pytest.mark.slow
def test_a_huge_k_neither_hangs_nor_samples_batches_the_run_will_not_train(tiny_dir, tmp_path):
    """#75: rollout.max_staleness = 1000 queued up to 1,000 batches at once after step 1, and the
    trainer and the engine's process each blocked sending to the other. Answers are now read as they
    come (EngineProcess's reader thread) and no batch is admitted past the run's last step: every
    async run also ended having sampled k batches it never trained (`batches_ahead` 1 at k = 1; k = 1's
    rows: tests/test_rollout_gpus.py)."""
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), "--model", str(tiny_dir), "--steps", "4",
                        "--set", "rollout.max_staleness=1000", "--set", "train.prompts_per_step=8",
                        "--set", "train.group_size=4", "--set", "eval.k=1", "--set", "eval.max_problems=8"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)  # a hang guard
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(max((ws / "runs").iterdir()))
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert [m["rollout/batches_ahead"] for m in rows] == [3, 2, 1, 0]


@pytest.mark.slow
def test_at_k2_healthy_steps_are_never_rolled_back_and_a_mismatch_still_is(embedded_default):
    """#74: the embedded default at k = 2 (its own cold start, seeded): the lag's KL (0.11–0.24 in its
    first steps) rolled it back at step 4 with max_kl = 0.05 and halved the learning rate. With the
    guard's lag allowance no step of a healthy run is even bad; an engine whose log μ drifts from the
    trainer's (+0.5 from step 6 on: MINIRL_INJECT_SKEW) is still rolled back, the line saying it is a
    mismatch the lag does not explain. Tokens sampled behind are clipped against their sampler's
    weights (objective.sampler_logp): the clip acts on the stale steps, never on a fresh one, and
    the rows say why (#79): every clipped token is a stale one, clipped by its anchor's gap alone
    (N = 1: nothing moved since π_old)."""
    ws = embedded_default
    args = [sys.executable, "-m", "cli.main", "run", str(ws), "--steps", "30", "--set", "rollout.max_staleness=2",
            "--set", "eval.max_problems=16", "--set", "eval.k=1"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    healthy = max((ws / "runs").iterdir())
    rows = _rows(healthy)
    assert len(rows) == 30 and not [m for m in rows if "guard/action" in m or "guard/reason" in m], \
        [(m["step"], m.get("guard/reason")) for m in rows if "guard/reason" in m]
    assert max(m["train/kl_mu_pi_old"] for m in rows) > 0.05  # what the old threshold rolled back
    # N = 1: r = π_θ/π_old ≡ 1, so only a token sampled behind, anchored at its sampler, is ever clipped
    assert all(m["loss/clip_frac"] == 0 for m in rows if m["rollout/staleness_max"] == 0)
    assert sum(m["loss/clip_frac"] > 0 for m in rows if m["rollout/staleness_mean"] > 0) > 15
    for m in rows:  # k = 2: every row has the clip split by cause, and they add up
        assert m["loss/clip_frac_stale"] + m["loss/clip_frac_fresh"] == pytest.approx(m["loss/clip_frac"], abs=1e-6)
        assert m["loss/clip_frac_mismatch"] == pytest.approx(m["loss/clip_frac"], abs=1e-6)  # N = 1
        assert m["loss/clip_frac_fresh"] == 0 and m["loss/clip_frac_movement"] == pytest.approx(0, abs=1e-6)
    r = subprocess.run([*args[:6], "9", *args[7:]], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "MINIRL_INJECT_SKEW": "6"})
    rows = _rows(max((ws / "runs").iterdir()))
    back = [m for m in rows if m.get("guard/action") == "rollback"]
    assert back and back[0]["step"] == 8, [(m["step"], m.get("guard/action")) for m in rows]  # patience 3
    assert "a mismatch beyond what sampling" in back[0]["guard/reason"]
    # #80: `minirl guard` on both runs' rows decides what the runs did
    for run, want in ((healthy, []), (max((ws / "runs").iterdir()), [8])):
        r = subprocess.run([sys.executable, "-m", "cli.main", "guard", str(run), "--json"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got = [json.loads(x) for x in r.stdout.splitlines()]
        assert [d["step"] for d in got if d["decision"] == "rollback"][:1] == want, got


@pytest.fixture(scope="module")
def inflight(tiny_dir):
    """An fp32 engine in its own process that loads a sync between two forward steps of a batch."""
    from minirl.config.recipe import RolloutConfig

    cores = sorted(os.sched_getaffinity(0))[-1:]
    rollout = RolloutConfig(precision="fp32", kv_cache_gib=0.25, max_staleness=1, inflight_updates=True)
    p = EngineProcess(tiny_dir, rollout, cores=cores, seed=0, max_model_len=32, capture_routes=True)
    yield p
    p.close()


@INFLIGHT
def test_a_sync_mid_batch_is_loaded_between_two_forward_steps_and_every_token_says_by_which(inflight, tiny_dir):
    """#66: the engine holds the batch after 4 forward steps (a test's pause), the sync comes in, and
    the requests go on. Each completion's first 4 tokens carry version 0 and the rest version 1;
    those first tokens, their log μ (θ_0's own score of them) and the routes of every position
    computed before the update are exactly what the same seeded call gives without an update; the
    first token after it, where the same token was drawn, has another log μ: the new weights
    sampled it. (Not any single-version forward's: its prefix's KV was computed by θ_0; which is
    why μ is recorded as sampled, never re-scored.)"""
    from minirl.models.shapes import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=0)
    ask = dict(n=2, temperature=1.0, max_tokens=14, seed=5)
    ref = inflight.generate(PROMPTS, **ask)
    assert all(c.versions == (0,) * len(c.token_ids) for g in ref for c in g)
    theta0 = inflight.score(*_pairs(ref))

    inflight.call("hold_after", 4)
    handle = inflight.submit("generate", PROMPTS, **ask)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.mul_(1.5)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=1)  # its slot was read: sent at once
    got = inflight.result(handle)
    tr.load_hf(tiny_dir)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=2)  # as the module found it

    prompt_len, moved = len(PROMPTS[0]), 0
    for g_ref, g, scores in zip(ref, got, [theta0[i:i + 2] for i in range(0, len(theta0), 2)]):
        for c_ref, c, score in zip(g_ref, g, scores):
            before = min(4, len(c.token_ids))
            assert c.versions == (0,) * before + (1,) * (len(c.token_ids) - before)
            assert c.token_ids[:before] == c_ref.token_ids[:before] and c.logprobs[:before] == c_ref.logprobs[:before]
            np.testing.assert_allclose(c.logprobs[:before], score[:before], rtol=0, atol=1e-5)
            np.testing.assert_array_equal(c.routes[:prompt_len + before - 1], c_ref.routes[:prompt_len + before - 1])
            assert c.routes.shape[0] == prompt_len + len(c.token_ids) - 1
            if len(c.token_ids) > 4 and len(c_ref.token_ids) > 4 and c.token_ids[4] == c_ref.token_ids[4]:
                assert abs(c.logprobs[4] - c_ref.logprobs[4]) > 1e-3
                moved += 1
    assert moved > 0


@INFLIGHT
def test_a_streamed_sync_is_one_call_loaded_whole_between_two_forward_steps(inflight, tiny_dir, monkeypatch):
    """#79: an engine that does not write its own tensors (CUDA; FP8 emulated on a CPU) took a sync
    as two messages, the weights and then their version, with the engine free to step between them
    (new-weight tokens stamped old), and as one list of every bucket (a copy of the whole model).
    Now it is one call, `load_stream(version)`, whose buckets follow it one at a time, each made
    only once the engine took the one before: the trainer never holds an earlier bucket when it
    makes the next, and the engine loads them all and the version before its next forward step, so
    the tokens after the sync carry the new version and those before the old, exactly."""
    import weakref

    from minirl.models.shapes import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=0)
    ask = dict(n=2, temperature=1.0, max_tokens=14, seed=5)
    ref = inflight.generate(PROMPTS, **ask)
    calls, made, alive_at, taken_at = [], [], [], []
    submit, stream = inflight.submit, inflight.stream_weights

    def recording(method, *args, **kwargs):
        calls.append((method, args))
        return submit(method, *args, **kwargs)

    def watched(buckets, *, version):
        def each():
            for b in buckets:
                alive_at.append(sum(any(r() is not None for r in refs) for refs in made))
                taken_at.append(inflight._taken.get(inflight._sent, 0))
                made.append([weakref.ref(t) for _, t in b])
                yield b
        return stream(each(), version=version)

    inflight.call("hold_after", 4)
    handle = inflight.submit("generate", PROMPTS, **ask)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.mul_(1.5)
    monkeypatch.setattr(inflight, "direct_sync", False)  # the copy path: a CUDA engine's
    monkeypatch.setattr(inflight, "submit", recording)
    monkeypatch.setattr(inflight, "stream_weights", watched)
    weight_sync.queue(tr, inflight, bucket_bytes=1, slots=1, version=1)  # a decoder layer a bucket
    monkeypatch.undo()
    got = inflight.result(handle)
    tr.load_hf(tiny_dir)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=2)  # as the module found it

    assert calls == [("load_stream", (1,))]  # weights and version: one call, nothing else sent
    assert len(made) == 6 and alive_at == [0] * 6  # embeddings, 4 layers, the head: one at a time
    assert taken_at == [1, 2, 3, 4, 5, 6]  # each made once the engine had asked for it
    for g_ref, g in zip(ref, got):
        for c_ref, c in zip(g_ref, g):
            before = min(4, len(c.token_ids))
            assert c.versions == (0,) * before + (1,) * (len(c.token_ids) - before)
            assert c.token_ids[:before] == c_ref.token_ids[:before] and c.logprobs[:before] == c_ref.logprobs[:before]


@PROC
def test_a_sync_that_skips_a_weight_stops_naming_it_on_each_path_of_an_engine_process(proc, tiny_dir, monkeypatch):
    """#79: the snapshot slot of an engine that writes its own tensors is checked here, before it is
    queued; the streamed buckets of any other engine by the engine as they come, its refusal raised
    by the sync itself. Both in one line (errors.EngineFault), and the engine goes on as it was."""
    from minirl.errors import EngineFault
    from minirl.models.shapes import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    slots = len(proc._slots)
    monkeypatch.setenv("MINIRL_INJECT_DROP_WEIGHT", "model.layers.2.self_attn.q_norm.weight")
    pending = dict(proc._pending)
    with pytest.raises(EngineFault, match="left model.layers.2.self_attn.q_norm.weight unwritten"):
        weight_sync.queue(tr, proc, bucket_bytes=2**30, slots=max(slots, 1), version=0)
    assert proc._pending == pending and len(proc._slots) == slots  # nothing was sent
    monkeypatch.setattr(proc, "direct_sync", False)  # the engine's process refuses what it is streamed
    with pytest.raises(EngineFault, match=r"left .*model.layers.2.self_attn.q_norm.weight"):
        weight_sync.queue(tr, proc, bucket_bytes=2**30, slots=1, version=0)
    monkeypatch.undo()
    assert tokens(proc.generate(PROMPTS, **SAMPLE))  # the fault was raised to the sync's caller, once


def _pairs(groups):
    return ([p for p, g in zip(PROMPTS, groups) for _ in g], [list(c.token_ids) for g in groups for c in g])


@pytest.mark.slow
def test_k2_with_inflight_updates_through_the_cli_keeps_the_bound_token_by_token(tiny_dir, tmp_path):
    """k = 2 with the engine stepping across calls and syncs loaded mid-batch: each row's histogram
    of token staleness adds up to the batch's tokens, and no token is more than 2 updates behind;
    a SIGKILL as step 4 begins (the engine's process with calls in flight ends with it) and a
    resume: every step trained once, one row each, the bound held after the restart."""
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    shutil.copytree(tiny_dir, ws / "model/coldstart")
    args = ["--set", "rollout.max_staleness=2", "--set", "rollout.inflight_updates=true", "--set",
            "train.prompts_per_step=8", "--set", "train.group_size=4", "--set", "eval.k=1",
            "--set", "checkpoint.every=2", "--replay", "r3", "--set", "metrics.record_tokens=6"]
    run = [sys.executable, "-m", "cli.main", "run", str(ws), "--steps", "6", *args]
    r = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MINIRL_INJECT_KILL": "0@4"})
    assert r.returncode == -9, r.stderr[-3000:]
    r = subprocess.run([*run, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(next((ws / "runs").iterdir()))
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    for m in rows:
        hist = m["rollout/staleness_tokens"]
        assert len(hist) == 3 and sum(hist) == round(m["rollout/resp_len"] * 8 * 4)
        assert m["rollout/staleness_max"] <= 2 and hist[m["rollout/staleness_max"]] > 0
    assert rows[2]["rollout/staleness_max"] == 0  # resumed after step 2: nothing ahead, the restored weights
    # the record of every trained token (#98), across the kill: each step's samples once, and every check holds
    # (ids, versions at most 2 behind, R3 routes for every position, the mismatch of the fresh tokens)
    tokens = [json.loads(x) for x in (next((ws / "runs").iterdir()) / "tokens.jsonl").read_text().splitlines()]
    assert [(x["step"], x["sample"]) for x in tokens] == [(s, i) for s in range(1, 7) for i in range(32)]
    assert any(x["trained_version"] - min(x["version"]) == 2 for x in tokens) and all(x["routed"] for x in tokens)
    checked = subprocess.run([sys.executable, "-m", "cli.main", "check", str(ws)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "COLUMNS": "250"})
    assert checked.returncode == 0 and "no: " not in checked.stdout, checked.stdout + checked.stderr
    extra = json.loads((next((ws / "runs").iterdir()) / "checkpoints/step_000006/minirl.json").read_text())
    assert extra["sampler"] == {"epoch": 0, "pos": 48}  # the batches ahead at the kill were drawn again, none skipped


def test_two_processes_move_the_weights_by_broadcast(tiny_dir, tmp_path):
    """#66: a trainer's process and an engine's process, each with its own torch.distributed world
    (vLLM sets one up inside the engine's), joined by a gloo group of their own: the trainer moves
    its weights and broadcasts them; the engine binds the received buffer and then scores fixed
    pairs as the trainer does (fp32), where before it scored them as the old weights did."""
    import time

    port = tmp_path / "port"

    def start(rank):
        return subprocess.Popen([sys.executable, str(ROOT / "tests" / "broadcast_worker.py"), "--rank", str(rank),
                                 "--port", str(port), "--model", str(tiny_dir), "--out", str(tmp_path / f"{rank}.json")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs, deadline = [start(0)], time.monotonic() + 300
    while not port.exists():  # the trainer's store is bound (its port published by a rename)
        assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate(timeout=5)[1][-3000:]
        time.sleep(0.1)
    procs.append(start(1))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    trainer = json.loads((tmp_path / "0.json").read_text())["trainer"]
    engine = json.loads((tmp_path / "1.json").read_text())
    flat = lambda rows: [x for r in rows for x in r]
    np.testing.assert_allclose(flat(engine["after"]), flat(trainer), rtol=0, atol=1e-4)
    assert max(abs(a - b) for a, b in zip(flat(engine["before"]), flat(trainer))) > 0.05


def _clean_forwards(prompt_len: int, c) -> list[int]:
    """For each position an episode fed through the engine, the version of the weights that fed it
    where that forward and every earlier one of its request ran on those weights alone, else -1.

    The forward that fed position p sampled the first sampled token after p (a turn's prefill feeds
    the previous turn's last token and the reply, and samples the turn's first token); a request's
    forwards are clean up to the first sync within it, and each turn is a request of its own (no
    prefix cache on a CPU engine: its prefill recomputes the episode under the weights of its time)."""
    first = None  # the version of the current turn's first token
    clean = []  # per sampled position of the ids: its version if clean, else -1
    for k, (m, v) in enumerate(zip(c.mask, c.versions)):
        if m and (k == 0 or not c.mask[k - 1]):
            first = v
        clean.append((v if v == first else -1) if m else None)
    out = []
    for p in range(prompt_len + len(c.token_ids) - 1):
        q = next(k for k in range(max(0, p + 1 - prompt_len), len(c.mask)) if c.mask[k])
        out.append(clean[q])
    return out


@INFLIGHT
@pytest.mark.parametrize("cuts", [{}, {"top_p": 0.95}], ids=["uncut", "top-p 0.95"])
def test_episodes_at_k2_with_a_sync_between_and_within_turns_stay_exact(inflight, tiny_dir, cuts):
    """#84 at k ≥ 1 with in-flight updates: the engine's process runs the turn loop in its stream, each
    episode's next turn asked as its last one ends, and a sync lands after 4 forward steps, within some
    episodes' turns and between others'. Every token says which weights sampled it; wherever a
    token's forward and those before it in its turn ran on one version v, its log μ is the fp32
    trainer's log π_v within 1e-4 and the route fed there is the trainer's own routing under θ_v in
    every layer, the last sampled token of each turn (fed by the next turn's prefill: θ_1's where the
    sync came between) and the environment's tokens included; the environment's tokens are masked.
    #97: the same at top-p 0.95, the trainer's π_v renormalized over what the engine's cut kept."""
    from transformers import AutoTokenizer

    from minirl.config.recipe import EnvConfig
    from minirl.data.prompts import Problem
    from minirl.models.shapes import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.rollout.engine import Truncation
    from minirl.rollout.environments import Environments
    from minirl.train.batch import build_batch
    from minirl.train.replay import rollout_routes, route_agreement
    from minirl.train.trainer import Trainer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    envs = Environments(EnvConfig(name="tests.test_episodes:Counter", tool_format="tiny", max_turns=4,
                                  max_reply_tokens=8), tokenizer=tok, max_model_len=32)
    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=0)
    n, problems = 8, [Problem(tuple(p), {"row": i}) for i, p in enumerate(PROMPTS)]
    inflight.call("hold_after", 4)
    handle = inflight.submit("generate", PROMPTS, n=n, temperature=1.3, max_tokens=14, seed=3,
                             episodes=envs.request(problems, seed=3),
                             **({"truncation": Truncation(**cuts)} if cuts else {}))
    with torch.no_grad():
        for p in tr.model.parameters():
            p.mul_(1.5)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=1)
    got = inflight.result(handle)
    comps = [c for g in got for c in g]
    prompts = [p for p in PROMPTS for _ in range(n)]
    batch = build_batch(prompts, [c.token_ids for c in comps], [c.logprobs for c in comps], None, pad_id=0,
                        masks=[c.mask for c in comps], temperature=1.3, kept=[c.kept for c in comps])
    assert (batch.kept_BT is not None) == bool(cuts)
    if cuts:  # the cut did cut: fewer than the vocabulary kept at most sampled tokens
        kept = [k for c in comps for k, m in zip(c.kept, c.mask) if m]
        assert sum(0 < k < TINY.vocab_size for k in kept) > len(kept) // 2
    pi1, _, own1 = tr.logprobs(batch, record_routes=True)
    tr.load_hf(tiny_dir)
    pi0, _, own0 = tr.logprobs(batch, record_routes=True)
    weight_sync.queue(tr, inflight, bucket_bytes=2**30, slots=1, version=2)  # as the module found it

    at = torch.full_like(batch.mask_BT, -2.0)
    # the Counter's replies, or the format's to a call it cannot read
    reply_ids = {tuple(tok.encode(t, add_special_tokens=False)) for t in ["=?;", *(f"=={k};;" for k in range(1, 5))]}
    for i, (p, c) in enumerate(zip(prompts, comps)):
        assert c.episode is not None and len(c.versions) == len(c.token_ids) == len(c.mask)
        sampled = [v for v, m in zip(c.versions, c.mask) if m]
        assert sampled == sorted(sampled) and set(sampled) <= {0, 1}  # within k = 2 of the trained weights
        k = 0  # every stretch of environment tokens is a reply, verbatim
        while k < len(c.mask):
            if c.mask[k]:
                k += 1
                continue
            end = next((e for e in range(k, len(c.mask)) if c.mask[e]), len(c.mask))
            assert tuple(c.token_ids[k:end]) in reply_ids and set(c.logprobs[k:end]) == {0.0}
            k = end
        assert c.routes.shape[0] == len(p) + len(c.token_ids) - 1
        at[i, : c.routes.shape[0]] = torch.tensor(_clean_forwards(len(p), c), dtype=at.dtype)
    routes = rollout_routes(comps, batch, TINY.n_layers, TINY.top_k, TINY.num_experts)
    sampled = batch.mask_BT > 0
    later = torch.zeros_like(sampled)  # tokens of a turn after the first, and the positions that fed them
    for i, (p, c) in enumerate(zip(prompts, comps)):
        first_end = next((k for k in range(len(c.mask)) if not c.mask[k]), len(c.mask))
        later[i, len(p) + first_end - 1: len(p) + len(c.token_ids) - 1] = True
    for v, pi, own in ((0, pi0, own0), (1, pi1, own1)):
        here = at == v
        assert float((batch.rollout_logp_BT - pi)[here & sampled].abs().max()) < 1e-4
        assert route_agreement(routes, own, here.float()).tolist() == [1.0] * TINY.n_layers
        # (a cut samples the closing token less often, and the in-flight timing decides where the sync lands)
        least = 1 if cuts else 3
        assert int((here & later & sampled).sum()) >= least, v  # later turns sampled cleanly by θ_v
        assert int((here & later & ~sampled).sum()) >= least, v  # ... and the replies' positions fed by θ_v
    assert int((at == -1).sum()) > 0  # the sync landed within a turn too: those forwards are mixed
    assert sum(c.episode.turns >= 2 for c in comps) >= 2 * least
    assert sum(c.episode.tool_calls for c in comps) >= 2 * least
    # a later turn's prefill under θ_1 recomputed positions first fed under θ_0: some routed otherwise
    # (the rows kept, θ_0's, are those the tokens were sampled under; the row says how many moved)
    from minirl.rollout.environments import rows

    moved = rows(comps)["replay/prefix_rerouted_frac"]
    print(f"prefix positions a later turn's prefill rerouted after the sync: {moved:.3f}")
    assert 0 < moved < 1
