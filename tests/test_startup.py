"""The engine's start (#73): on a GPU built with the plan's KV cache (so vLLM skips the profiling
pass that captures every CUDA graph once before the real capture), graphs captured only up to the
engine's sequences, and vLLM's cache kept in the workspace, reused by the next run and said so
(a run's first start fills it and a resume reuses it: tests/test_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _engine_settings(monkeypatch, rec, **kw) -> dict:
    """What `Rollouts.from_recipe` asks the engine factory for (the factory is the seam: no GPU here)."""
    import minirl.rollout as rollout_pkg
    from minirl.launch import World

    asked = {}

    class Stub:
        startup = {"compile_s": 1.5, "graphs_s": 2.25, "engine_s": 9.0}

    monkeypatch.setattr(rollout_pkg, "make_engine", lambda model_dir, rollout, **k: asked.update(k) or Stub())
    monkeypatch.setattr(rollout_pkg.Rollouts, "sync", lambda self, trainer: None)
    made = rollout_pkg.Rollouts.from_recipe(rec, Path("/m"), trainer=None, sampler=None, world=World(), clock=None, **kw)
    assert made.startup == {"compile": 1.5, "graphs": 2.25}  # the start's parts, for the summary
    return asked


def test_a_gpu_run_builds_its_engine_with_the_plans_kv_cache_and_bounded_graphs(monkeypatch):
    from minirl.config import recipes
    from minirl.models.shapes import KNOWN_SHAPES
    from minirl.rollout.vllm_args import EngineSettings, engine_args
    from minirl.setup.limits import Platform
    from minirl.setup.preflight import check_gpu_plan, engine_kv_gib

    shape = KNOWN_SHAPES["Qwen3-30B-A3B"]
    rec = recipes.load(recipes.shipped("qwen3-30b-a3b-lora"), [])
    plan = check_gpu_plan(rec, shape, Platform("cuda", 1, 16, 139.8))
    kv = engine_kv_gib(plan)  # what preflight hands the run (RunInputs.kv_cache_gib)
    assert kv == pytest.approx(plan.memory_gib["vLLM KV cache"], abs=1e-3) and kv > 1
    asked = _engine_settings(monkeypatch, rec, memory_fraction=plan.engine_fraction, kv_cache_gib=kv,
                             sleep_level=plan.sleep_level)
    assert asked["kv_cache_gib"] == kv and asked["memory_fraction"] == plan.engine_fraction
    assert asked["sleep_level"] == plan.sleep_level == 2  # the 30B LoRA on one H200: awake it would not fit
    args = engine_args(EngineSettings("/m", kv_cache_gib=kv, max_num_seqs=asked["max_num_seqs"], sleep_level=2),
                       cuda=True, spmd=False)
    assert args["kv_cache_memory_bytes"] == int(kv * 2**30)  # given, vLLM sizes nothing and profiles nothing
    assert args["compilation_config"] == {"max_cudagraph_capture_size": asked["max_num_seqs"]}
    assert engine_kv_gib(None) is None  # a CPU run: its engine sizes its KV cache for the job itself
    assert "kv_cache_gib" not in _engine_settings(monkeypatch, rec)


def _python(code: str, *args: str) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-c", code, *args], cwd=root, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["run", "{ws}", "--set", "train.bogus=1"], ["status", "{ws}"],
                                  ["guard", "--help"], ["eval", "aime99", "-w", "{ws}"]])
def test_a_command_that_runs_no_engine_starts_without_torch(argv, tmp_path):
    """Help, a bad input's line and the status of a workspace are answered before torch is
    imported (1.3 s of the 1.5 s such a command took): what imports torch is deferred to the
    commands that train, sample or plan."""
    import subprocess

    from tests.conftest import ROOT, cli_telling_imports, data_workspace

    ws = data_workspace(tmp_path / "ws")
    r = subprocess.run([*cli_telling_imports(), *[a.format(ws=ws) for a in argv]], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.stderr.strip().splitlines()[-1] == "imported: False False", r.stderr[-2000:]


def test_quick_exit_waits_for_threads_runs_the_exit_handlers_and_flushes(tmp_path):
    """What a command leaves at its exit still happens without the interpreter's teardown: a thread
    that is no daemon ends its work, the exit handlers run (a temporary folder is removed), the
    streams' buffered text arrives, and the exit code is the command's."""
    code = ("import sys, tempfile, threading, pathlib, time\n"
            "from minirl.proc.quick_exit import quick_exit\n"
            "d = tempfile.TemporaryDirectory(dir=sys.argv[1])\n"
            "def late():\n"
            "    time.sleep(0.5); pathlib.Path(sys.argv[1], 'late').write_text('written')\n"
            "threading.Thread(target=late).start()  # still asleep when the exit begins\n"
            "sys.stdout.write('buffered, no newline')\n"
            "quick_exit(7)\n")
    r = _python(code, str(tmp_path))
    assert r.returncode == 7, r.stderr
    assert r.stdout == "buffered, no newline"
    assert (tmp_path / "late").read_text() == "written"
    assert [p.name for p in tmp_path.iterdir()] == ["late"]  # the temporary folder went with the exit handlers
    r = _python("from minirl.proc.quick_exit import quick_exit; quick_exit('a message')")
    assert r.returncode == 1 and r.stderr.strip() == "a message"  # as sys.exit('a message')


def test_the_collector_runs_less_often_only_until_the_engine_is_built(monkeypatch):
    """minirl/proc/collector.py: a process starts with the raised thresholds (the CLI's entry, the
    engine process) and has its usual ones back once the factory has built its engine (the build
    itself is vLLM's, not the point: stood in)."""
    import gc

    import minirl.rollout as rollout_pkg
    from minirl.proc.collector import STARTING, collect_less_often
    from minirl.config import recipes

    monkeypatch.setattr(rollout_pkg, "build", lambda *a, **k: "engine")
    session = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        collect_less_often()
        assert gc.get_threshold() == STARTING
        assert rollout_pkg.make_engine(Path("/m"), recipes.load(None, []).rollout, seed=0, max_model_len=32) == "engine"
        assert gc.get_threshold() == (700, 10, 10)
        rollout_pkg.make_engine(Path("/m"), recipes.load(None, []).rollout, seed=0, max_model_len=32)
        assert gc.get_threshold() == (700, 10, 10)  # a second engine changes nothing
    finally:
        gc.set_threshold(*session)


@pytest.mark.parametrize("cache", ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"])
def test_the_cli_bounds_the_matmul_caches_unless_the_user_set_them(monkeypatch, cache):
    """#100: oneDNN's cache of compiled primitives held ~100 MB of the default run's peak at its 1,024, and
    torch's bf16 matmuls' own cache (ideep's, `LRU_CACHE_CAPACITY`) grew by ~150 MiB over a long run with
    evaluations; the CLI sets 64 for each before torch loads (docs/results/memory.md), a user's own value
    standing."""
    import os

    from cli.main import _prepare_env

    for given, got in ((None, "64"), ("1024", "1024")):
        env = {k: v for k, v in os.environ.items() if k != cache}
        if given is not None:
            env[cache] = given
        monkeypatch.setattr(os, "environ", env)  # what the CLI sets stays in this copy
        _prepare_env(verbose=True)
        assert env[cache] == got
