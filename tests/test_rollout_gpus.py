"""Rollout GPUs apart from the trainer's (`parallel.rollout_gpus`, rollout/remote.py) on this CPU,
where a "GPU" of the [parallel] section is a process: each node's first training rank starts its
engine processes, which take every sync by broadcast over a gloo group of their own (NCCL between
GPUs), and gives each of the node's ranks its share of the answers. Real vLLM engine, real
TorchTitan trainer, tiny model, on one node and on two (two torchrun agents)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "train.prompts_per_step=8", "--set", "train.group_size=4", "--set", "eval.k=1",
         "--set", "rollout.parity_every=1", "--set", "train.lr=3e-3", "--set", "train.warmup_steps=0"]
TIMING = ("timing/", "gpu/")  # wall-clock figures differ from run to run; everything else is the run's


def _workspace(tmp_path: Path, tiny_dir: Path) -> Path:
    from tests.conftest import data_workspace, last_digit_rewards

    ws = data_workspace(tmp_path / "ws", train=200, heldout=8)
    shutil.copytree(tiny_dir, ws / "model/coldstart")
    last_digit_rewards(ws)  # rewards that vary, so every step moves the weights
    return ws


def _rows(ws: Path) -> list[dict]:
    run = sorted((ws / "runs").iterdir())[-1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in rows]


@pytest.mark.slow
def test_an_engine_on_a_rollout_gpu_samples_as_the_engine_process_beside_the_trainer(tiny_dir, tmp_path):
    """One trainer process, k = 1, R3: with `--rollout-gpus 1` the engine's process takes each sync
    by broadcast (one flat fp32 buffer it binds once) instead of a shared-memory snapshot; same
    weights, same seeds, same engine: every row is the same, number for number (rewards, log-prob
    parity after every sync, routes through the IS weights, staleness). The prompts are multi-turn
    episodes of an environment of the test's (#84), run by the engine's process in both."""
    ws = _workspace(tmp_path, tiny_dir)
    base = [sys.executable, "-m", "cli.main", "run", str(ws), "--steps", "4", "--replay", "r3",
            "--set", "rollout.max_staleness=1", *SMALL, "--set", "env.name=tests.test_episodes:Counter",
            "--set", "env.tool_format=tiny", "--set", "env.max_turns=2", "--set", "env.max_reply_tokens=8"]
    rows = []
    for extra in ([], ["--rollout-gpus", "1"]):
        r = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rows.append(_rows(ws))
    assert [m["step"] for m in rows[1]] == [1, 2, 3, 4]
    assert rows[1] == rows[0]
    assert [m["rollout/batches_ahead"] for m in rows[0]] == [1, 1, 1, 0]  # none sampled past the last step (#75)
    assert sum(m["episode/env_tokens"] for m in rows[1]) > 0 and max(m["episode/turns"] for m in rows[1]) > 1
    recorded = (sorted((ws / "runs").iterdir())[-1] / "recipe.toml").read_text()
    assert "rollout_gpus = 1" in recorded and "gpus_per_node = 2" in recorded  # the job's node: 1 training rank + 1


@pytest.mark.slow
def test_two_training_ranks_and_an_engine_on_a_rollout_gpu_keep_the_bound_and_every_sync(tiny_dir, tmp_path):
    """torchrun: two gloo training ranks (FSDP2 shards) and, from rank 0, one engine process at
    k = 2: every sync walks the trainer's buckets on both ranks (the shards gathered) and rank 0
    broadcasts them bucket by bucket; each rank is sent its half of every batch. Rank 0 is
    SIGKILLed as step 4 begins and the job resumed (a new engine, a new group): rows once each;
    no token more than 2 updates behind; after every sync the engine
    scores a fixed batch as the trainer does (the parity check: 0.01–0.03 here; 0.3–1.2 measured with
    the engine's loading of the broadcast switched off)."""
    ws = _workspace(tmp_path, tiny_dir)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "cli.main",
           "run", str(ws), "--steps", "5", "--rollout-gpus", "1", "--set", "rollout.max_staleness=2",
           "--set", "checkpoint.every=2", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**env, "MINIRL_INJECT_KILL": "0@4"})
    assert r.returncode != 0 and len(_rows(ws)) == 3, r.stderr[-3000:]  # rank 0, the engine's parent, killed at step 4
    r = subprocess.run([*run, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(ws)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5]
    for m in rows:
        hist = m["rollout/staleness_tokens"]
        assert len(hist) == 3 and sum(hist) == round(m["rollout/resp_len"] * 8 * 4)
        assert m["rollout/staleness_max"] <= 2
        assert m["sync/parity_abs_dlogp"] < 0.05, m["sync/parity_abs_dlogp"]
    assert max(m["rollout/staleness_max"] for m in rows) == 2  # it did sample ahead
    recorded = (sorted((ws / "runs").iterdir())[-1] / "recipe.toml").read_text()
    assert "gpus_per_node = 3" in recorded


def test_two_engines_split_a_call_join_its_answer_in_order_and_take_a_sync_bucket_by_bucket(tiny_dir, engine):
    """Two engine processes behind one `RemoteEngines` (a world of one rank): a call's prompts are
    split over them in order (by demand: a busy engine gets fewer; a rollback cancels), each samples its part with its own stream of call seeds, and the
    answer is the parts joined: the tokens the engine in this process samples for each part with
    that stream. A sync sent bucket by bucket (three buckets of whole layers here) reaches both, and
    they then score as the engine here given the same weights, exactly."""
    from minirl.config.recipe import RolloutConfig
    from minirl.launch import World
    from minirl.models.shapes import TINY
    from minirl.rollout import sync as weight_sync
    from minirl.rollout.remote import RemoteEngines
    from minirl.train.trainer import Trainer

    prompts = [[4, 5, 6, 13, 7, 8, 9, 16], [5, 5, 5, 13, 3, 3, 3, 16], [9, 9, 9, 13, 9, 9, 9, 16]]
    sample = dict(n=2, temperature=1.0, max_tokens=6, seed=11)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    remote = RemoteEngines(tiny_dir, RolloutConfig(precision="bf16"), world=World(), engines=2,
                           seed=0, max_model_len=32)
    try:
        tokens = lambda groups: [[list(c.token_ids) for c in g] for g in groups]
        got = tokens(remote.generate(prompts, **sample))
        want = []
        for stream, part in ((0, prompts[:1]), (1, prompts[1:])):
            engine.stream = stream
            want += tokens(engine.generate(part, **sample))
        engine.stream = 0
        assert got == want

        # by demand: engine 1 stops after 2 forward steps of its part of a call (a test's pause: an
        # engine slowed by long responses) while engine 0 answers its own; the next call's prompts
        # go to the engine with fewer sequences outstanding: 4 of 6 to engine 0
        busy = remote._engines[1]
        busy.call("hold_after", 2)
        first = remote.submit("generate", prompts * 2, **sample)
        (e0, h0), _ = first[1]
        e0.result(h0)
        second = remote.submit("generate", prompts * 2, **sample)
        assert [(e is busy, len(e.result(h))) for e, h in second[1]] == [(False, 4), (True, 2)]
        assert [len(g) for g in remote.result(first)] == [2] * 6
        # a rollback drops a call that is under way on an engine, and the engines go on
        busy.call("hold_after", 1)  # its part waits, queued or held after one step, for the cancel
        assert remote.cancel([remote.submit("generate", prompts * 2, **sample)]) == 1
        busy.call("hold_after", None)  # a part cancelled while queued leaves the pause set
        assert len(remote.generate(prompts, **sample)) == 3

        tr = Trainer(TINY, lr=0.0)
        tr.load_hf(tiny_dir)
        with torch.no_grad():
            for p in tr.model.parameters():
                p.mul_(1.5)
        buckets = list(weight_sync._engine_buckets(tr, remote, bucket_bytes=TINY.dim * TINY.dim * 2 * 40))
        assert len(buckets) >= 3
        remote.send_weights(1, buckets=iter(buckets))
        weight_sync.sync(tr, engine, bucket_bytes=2**30)
        resp = [c for g in got for c in g]
        pairs = [p for p in prompts for _ in range(2)], resp
        scoring = remote.submit("score", *pairs)
        assert len(scoring[1]) == 2  # both engines score their part
        torch.testing.assert_close(torch.tensor(sum(remote.result(scoring), [])),
                                   torch.tensor(sum(engine.score(*pairs), [])), rtol=0, atol=0)
    finally:
        remote.close()
        os.sched_setaffinity(0, affinity)  # rank 0 kept half its cores for itself
        torch.set_num_threads(threads)
        tr = Trainer(TINY, lr=0.0)
        tr.load_hf(tiny_dir)
        weight_sync.sync(tr, engine, bucket_bytes=2**30)  # the session's engine as it was


@pytest.mark.slow
def test_two_nodes_each_ask_their_own_rollout_gpu(tiny_dir, tmp_path):
    """`torchrun --nnodes 2` as two agents of one training rank each on this machine (c10d
    rendezvous), `--rollout-gpus 1`: each node's rank starts its own engine, asks it for its node's
    half of every batch and broadcasts every sync to it within the node. k = 1, 4 steps: rows once
    each, the bound, and after every sync the parity check (each node's half of the fixed pairs
    scored by its node's engine, averaged over both) as small as on one node: an engine that missed
    a sync would not be."""
    from tests.conftest import free_port

    ws = _workspace(tmp_path, tiny_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "rollout-gpus", "-m", "cli.main", "run",
           str(ws), "--steps", "4", "--rollout-gpus", "1", "--set", "rollout.max_staleness=1", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    out = "\n".join(p.communicate(timeout=900)[0] for p in procs)
    assert [p.returncode for p in procs] == [0, 0], out[-4000:]
    rows = _rows(ws)
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    for m in rows:
        assert m["rollout/staleness_max"] <= 1 and sum(m["rollout/staleness_tokens"]) == round(m["rollout/resp_len"] * 32)
        assert m["sync/parity_abs_dlogp"] < 0.05, m["sync/parity_abs_dlogp"]
