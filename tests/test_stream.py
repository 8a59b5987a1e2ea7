"""#66: an engine that keeps stepping across calls (rollout/stream.py, `rollout.inflight_updates`):
a second call's requests join the first's in flight, and every completion is whole and exact."""

from __future__ import annotations

import numpy as np
import torch

from minirl.models.shapes import TINY
from minirl.train.batch import build_batch
from minirl.train.trainer import Trainer

PROMPTS = [[4, 5, 6, 13, 7, 8, 9, 16], [5, 5, 5, 13, 4, 4, 4, 16], [12, 11, 10, 13, 3, 3, 3, 16]]


def test_calls_join_the_requests_in_flight_and_come_back_whole_with_preemptions_drawn_again(tiny_dir):
    """Call 1 is stepped twice, then call 2 joins it: some forward step runs requests of both.
    A KV cache of 16 blocks of 32 tokens for 96 requests of 26–28-token prompts: the scheduler
    preempts some, and with R3 each preempted sample is asked again until one keeps its routes.
    Each call comes back [prompts][n], every completion with one log μ per token equal to the
    engine's own score of it (fp32; no weights changed) and routes for every fed position equal
    to the fp32 trainer's own routing."""
    from minirl.models.sizing import cpu_kv_cache_bytes
    from minirl.rollout import vllm_internals
    from minirl.rollout.stream import Stream
    from minirl.rollout.vllm import VLLMEngine
    from minirl.train.replay import rollout_routes, route_agreement

    engine = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=64, max_num_seqs=96, kv_block=32,
                        kv_cache_gib=4 * cpu_kv_cache_bytes(TINY, 1, 64, 4) / 2**30, capture_routes=True)
    scheduler = engine._llm.llm_engine.engine_core.engine_core.scheduler
    schedule, together = scheduler.schedule, []

    def watching(*a, **k):  # which calls' requests each forward step runs
        out = schedule(*a, **k)
        together.append({vllm_internals.split_request_id(r)[0].split(".")[0] for r in out.num_scheduled_tokens})
        return out

    scheduler.schedule = watching
    asked = {1: [(PROMPTS[i % 3] * 4)[: 26 + i % 3] for i in range(12)], 2: [(PROMPTS[i % 3] * 4)[1: 27 + i % 3]
                                                                           for i in range(12)]}
    stream = Stream(engine, max_redraws=8)
    stream.add(1, asked[1], n=4, temperature=1.0, max_tokens=12, seed=3)
    got = {}
    for _ in range(2):
        got.update(stream.step())
    assert not got and stream.busy
    stream.add(2, asked[2], n=4, temperature=1.0, max_tokens=12)
    while stream.busy:
        got.update(stream.step())
    del scheduler.schedule
    assert {"1", "2"} in together  # a forward step ran requests of both calls
    assert sum(c.regenerated for tag in got for g in got[tag] for c in g) >= 1

    tr = Trainer(TINY, lr=0.0)
    tr.load_hf(tiny_dir)
    for tag, prompts in asked.items():
        groups = got[tag]
        assert [len(g) for g in groups] == [4] * len(prompts)
        comps = [c for g in groups for c in g]
        flat = [p for p in prompts for _ in range(4)]
        assert all(c.routes.shape[0] == len(p) + len(c.token_ids) - 1 for p, c in zip(flat, comps))
        scores = engine.score(flat, [list(c.token_ids) for c in comps])
        np.testing.assert_allclose(np.concatenate([c.logprobs for c in comps]), np.concatenate(scores), rtol=0,
                                   atol=1e-4)
        batch = build_batch(flat, [c.token_ids for c in comps], [c.logprobs for c in comps], None, pad_id=0)
        fed = torch.zeros_like(batch.mask_BT)
        for i, c in enumerate(comps):
            fed[i, : c.routes.shape[0]] = 1.0
        _, _, own = tr.logprobs(batch, record_routes=True)
        routes = rollout_routes(comps, batch, TINY.n_layers, TINY.top_k, TINY.num_experts)
        assert route_agreement(routes, own, fed).tolist() == [1.0] * TINY.n_layers


def test_each_tokens_version_follows_the_syncs_between_forward_steps_on_either_log_prob_path(tiny_dir):
    """Versions 1 and 2 set between forward steps (a sync's stamp; the weights are left as they
    are), with a second call joining after the first: each token carries the version of the step
    that sampled it. Two ways to know it, run on the same seeds: the CPU engine's log-prob capture
    (stamped inside the sampler) and the CUDA path (vLLM's own log-probs, versions from what each
    request had sampled when the version changed): the same tokens, the same versions, log μ
    within 1e-4."""
    from minirl.rollout.stream import Stream
    from minirl.rollout.vllm import VLLMEngine

    engine = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=64, kv_cache_gib=0.25)

    def run():
        engine.set_version(0)
        stream, got = Stream(engine, max_redraws=8), {}
        stream.add(1, PROMPTS, n=4, temperature=1.0, max_tokens=12, seed=5)
        for version in (1, 2):
            for _ in range(3):
                got.update(stream.step())
            engine.set_version(version)
            if version == 1:
                stream.add(2, PROMPTS[:2], n=2, temperature=1.0, max_tokens=12)
        while stream.busy:
            got.update(stream.step())
        return [c for tag in (1, 2) for g in got[tag] for c in g]

    captured = run()
    engine.capture_logprobs = False  # as on CUDA
    try:
        derived = run()
    finally:
        engine.capture_logprobs = True
    assert [c.token_ids for c in derived] == [c.token_ids for c in captured]
    assert [c.versions for c in derived] == [c.versions for c in captured]
    np.testing.assert_allclose(np.concatenate([c.logprobs for c in derived]),
                               np.concatenate([c.logprobs for c in captured]), rtol=0, atol=1e-4)
    first = [c.versions for c in captured[:12]]
    assert any(v[:3] == (0, 0, 0) and v[3:6] == (1, 1, 1) and 2 in v for v in first)  # one response, three versions
    assert all(set(v) <= {1, 2} and v[0] == 1 for v in (c.versions for c in captured[12:]) if v)  # asked at version 1
