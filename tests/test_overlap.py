"""`rollout.overlap`: the engine in a process of its own (rollout/process.py), and an overlapped run.

The engine's process runs the real vLLM engine on the tiny model; the trainer's weights reach it
through shared memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minirl.errors import UsageError
from minirl.rollout.process import EngineProcess, split_cores

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[4, 5, 6, 13, 7, 8, 9, 16], [5, 5, 5, 13, 3, 3, 3, 16], [9, 9, 9, 13, 9, 9, 9, 16]]
SAMPLE = dict(n=4, temperature=1.0, max_tokens=6, seed=11)


def tokens(groups) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in g] for g in groups]


@pytest.fixture(scope="module")
def proc(tiny_dir):
    from minirl.recipe import RolloutConfig

    cores = sorted(os.sched_getaffinity(0))[-1:]  # the engine's process on one core, as overlapped on 2 cores
    p = EngineProcess(tiny_dir, RolloutConfig(precision="bf16", kv_cache_gib=0.25), cores=cores, seed=0,
                      max_model_len=32)
    yield p
    p.close()
    assert not p._proc.is_alive()


def test_split_cores_needs_two():
    with pytest.raises(UsageError, match="rollout.overlap needs at least 2 cores"):
        split_cores({3})


def test_engine_process_samples_as_the_engine_in_this_process(proc, engine):
    """Same weights, seed and settings: the same tokens and log-probs (seeded sampling does not
    depend on which process samples)."""
    theirs = proc.generate(PROMPTS, **SAMPLE)
    ours = engine.generate(PROMPTS, **SAMPLE)
    assert tokens(theirs) == tokens(ours)
    a = torch.tensor([x for g in theirs for c in g for x in c.logprobs])
    b = torch.tensor([x for g in ours for c in g for x in c.logprobs])
    torch.testing.assert_close(a, b)


def test_a_sync_waits_for_the_rollout_sent_before_it(proc, engine, tiny_dir):
    """A rollout submitted before a sync samples from the weights before it. The sync writes the
    engine's weights, which live in shared memory, from both processes (no tensor sent), after
    which the engine's process scores exactly as an engine in this process given the same
    weights; so it does when its process copies everything from the trainer's shared
    parameters instead (the path for engines whose weights cannot be shared)."""
    from minirl.models import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    tr.share_memory()
    weight_sync.sync(tr, proc, bucket_bytes=2**30)
    before = tokens(proc.generate(PROMPTS, **SAMPLE))

    with torch.no_grad():
        for p in tr.model.parameters():  # in place: the views synced from follow
            p.mul_(1.5)
    handle = proc.submit("generate", PROMPTS, **SAMPLE)
    weight_sync.sync(tr, proc, bucket_bytes=2**30)  # sent while the rollout runs
    assert proc._views is tr.hf_views() and proc._shared is not None  # bound once, written from here
    assert len(proc._pending) == 1  # the engine's share of the sync: under way after the call returns
    proc.settle()
    assert not proc._pending
    assert tokens(proc.result(handle)) == before  # sampled before the new weights were written
    after = proc.generate(PROMPTS, **SAMPLE)
    assert tokens(after) != before

    weight_sync.sync(tr, engine, bucket_bytes=2**30)
    try:
        resp = [list(c.token_ids) for g in after for c in g]
        prompts = [p for p, g in zip(PROMPTS, after) for _ in g]
        ours = torch.tensor(sum(engine.score(prompts, resp), []))
        torch.testing.assert_close(torch.tensor(sum(proc.score(prompts, resp), [])), ours, rtol=0, atol=0)
        with torch.no_grad():
            for d in proc._shared.dests.values():  # its share of the engine's weights, wrong
                d.zero_()
        proc.call("bind_views", tr.hf_views())
        proc.call("sync_views")  # the engine's process copies from the trainer's shared parameters
        torch.testing.assert_close(torch.tensor(sum(proc.score(prompts, resp), [])), ours, rtol=0, atol=0)
    finally:  # leave both engines as the module found them
        tr.load_hf(tiny_dir)  # in place, into the shared storages
        weight_sync.sync(tr, engine, bucket_bytes=2**30)
        weight_sync.sync(tr, proc, bucket_bytes=2**30)
    assert tokens(proc.generate(PROMPTS, **SAMPLE)) == before


def test_answers_keep_their_callers_and_errors_come_back_named(proc):
    first = proc.submit("generate", PROMPTS[:1], **SAMPLE)
    second = proc.submit("generate", PROMPTS[1:], **SAMPLE)
    alone = tokens(proc.generate(PROMPTS[1:], **SAMPLE))  # answered after both submitted ones
    assert tokens(proc.result(second)) == alone
    assert len(proc.result(first)) == 1
    with pytest.raises(RuntimeError, match="in the rollout engine's process: AttributeError"):
        proc.call("no_such_method")
    assert tokens(proc.generate(PROMPTS[1:], **SAMPLE)) == alone  # still serving


@pytest.mark.slow
def test_overlapped_run_checkpoints_the_prompts_it_trained_on(tiny_dir, tmp_path):
    """A short overlapped run through the CLI. Its checkpoints record the data position of the
    steps trained (the next step's prompts are drawn already: a resumed run draws them again),
    and a resume continues from there."""
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    shutil.copytree(tiny_dir, ws / "model/coldstart")
    args = ["--set", "rollout.overlap=true", "--set", "train.prompts_per_step=8", "--set", "train.group_size=4",
            "--set", "checkpoint.every=2", "--set", "eval.k=1"]
    run = [sys.executable, "-m", "cli.main", "run", str(ws)]
    r = subprocess.run([*run, "--steps", "3", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = next((ws / "runs").iterdir())
    for step in (2, 3):
        extra = json.loads((run_dir / f"checkpoints/step_{step:06d}/minirl.json").read_text())
        assert extra["sampler"] == {"epoch": 0, "pos": 8 * step}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert all(m["timing/rollout_s"] > 0 and m["timing/update_s"] > 0 for m in rows)

    r = subprocess.run([*run, "--steps", "5", "--resume", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5]
    extra = json.loads((run_dir / "checkpoints/step_000005/minirl.json").read_text())
    assert extra["sampler"] == {"epoch": 0, "pos": 40}
