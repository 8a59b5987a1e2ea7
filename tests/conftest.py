"""Shared fixtures: a tiny Qwen3-MoE built by the project itself (no hub), and one vLLM engine.

The engine is session-scoped: starting vLLM costs ~5–15 s on 2 cores, and tests that change its
weights restore them (or build their own) so order never matters.
"""

from __future__ import annotations

import contextlib
import os

# Every core for one process; pytest-xdist's workers (which inherit the controller's environment)
# share them instead, unless OMP_NUM_THREADS came from the caller
if "OMP_NUM_THREADS" not in os.environ or os.environ.get("MINIRL_TEST_THREADS") == os.environ["OMP_NUM_THREADS"]:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = os.environ["MINIRL_TEST_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one vLLM cache for the whole suite, as before workspaces had their own (rollout/cache.py): a cold one
# costs each fresh workspace's engine a subprocess that inspects the model class; the test of the
# workspace's own cache runs without it
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.expanduser("~/.cache/vllm"))

from pathlib import Path  # noqa: E402

import gc  # noqa: E402

from minirl.proc.collector import STARTING  # noqa: E402

# the workers import torch and vLLM too, and build engines in-process: the start's thresholds for
# the whole session (set here, not by collect_less_often, so no engine built by a test restores them)
gc.set_threshold(*STARTING)

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def pytest_configure(config):
    """pytest-xdist first hands each worker a consecutive quarter of its share, which would give one
    worker every slow test (sorted first, below); one test at a time, each worker takes the next."""
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1


# The suite's longest tests, longest first (`pytest -n 2 --durations=60` on this 2-core machine,
# 2026-12-06, setup and call together); a test not named here counts as shorter than these, a slow-marked
# one longer than the rest. Only the order is used: a name that goes stale costs balance, never a test.
LONGEST = (
    "tests/test_episodes.py::test_the_tools_task_in_qwen3s_chat_format_trains_end_to_end_and_its_tool_call_rate_rises",
    "tests/test_gpu_kit.py::test_the_sequence_runs_in_dry_mode",
    "tests/test_async.py::test_at_k2_healthy_steps_are_never_rolled_back_and_a_mismatch_still_is",
    "tests/test_export.py::test_the_cards_snippets_run_and_push_to_a_stand_in_hub",
    "tests/test_parallel.py::test_a_killed_rank_restarts_across_nodes_and_resumes_from_the_newest_checkpoint",
    "tests/test_parallel.py::test_minirl_run_on_two_ranks_then_resumes_in_one_process",
    "tests/test_rollout_gpus.py::test_two_training_ranks_and_an_engine_on_a_rollout_gpu_keep_the_bound_and_every_sync",
    "tests/test_engine_fault.py::test_a_dead_engine_is_named_in_one_line_and_ctrl_c_is_quiet_in_every_process",
    "tests/test_faults.py::test_sigkill_at_random_moments_then_resume",
    "tests/test_episodes.py::test_the_embedded_tool_task_learns_to_call_its_calculator",
    "tests/test_studies.py::test_a_micro_study_runs_paired_seeds_resumes_and_reports",
    "tests/test_e2e.py::test_init_run_kill_resume",
    "tests/test_async.py::test_k2_runs_ahead_within_the_bound_and_a_rollback_discards_what_is_ahead",
    "tests/test_rollout_gpus.py::test_two_nodes_each_ask_their_own_rollout_gpu",
    "tests/test_async.py::test_k2_with_inflight_updates_through_the_cli_keeps_the_bound_token_by_token",
    "tests/test_rollout_gpus.py::test_an_engine_on_a_rollout_gpu_samples_as_the_engine_process_beside_the_trainer",
    "tests/test_export.py::test_export_loads_in_transformers_and_vllm_with_the_trainers_logprobs",
    "tests/test_gym.py::test_a_reasoning_gym_task_trains_twenty_steps",
    "tests/test_engine_fault.py::test_nonfinite_engine_logprobs_stop_the_run_before_any_update_and_resume_continues",
    "tests/test_lora.py::test_a_lora_run_with_r3_killed_and_resumed_repeats_itself_and_exports",
    "tests/test_faults.py::test_a_preemption_mid_collapse_rolls_back_to_the_newest_good_and_an_end_cut_short_ends",
    "tests/test_temperature.py::test_the_rows_are_the_sampling_temperatures_policy",
    "tests/test_code_grader.py::test_rl_on_code_and_eval_humaneval_run_end_to_end_on_the_tiny_model",
    "tests/test_parallel.py::test_two_ranks_update_like_one_process[ep2+r3]",
    "tests/test_faults.py::test_a_disk_that_fills_up_mid_run",
    "tests/test_memory_model.py::test_the_plans_activations_per_token_are_what_the_forward_saves[moe-one process-none]",
    "tests/test_rollout_gpus.py::"
    "test_two_engines_split_a_call_join_its_answer_in_order_and_take_a_sync_bucket_by_bucket",
    "tests/test_doctor.py::test_doctor_measures_each_source",
    "tests/test_gpu_kit.py::test_the_device_command_runs_end_to_end_in_dry_mode",
    "tests/test_async.py::test_a_huge_k_neither_hangs_nor_samples_batches_the_run_will_not_train",
    "tests/test_episodes.py::test_an_openenv_shaped_environment_trains_three_steps_through_the_cli[2]",
    "tests/test_memory_model.py::test_the_plans_activations_per_token_are_what_the_forward_saves[moe-fsdp2-none]",
    "tests/test_runlock.py::test_a_resume_during_a_live_run_is_refused_while_readers_work",
    "tests/test_other_models.py::test_run_trains_a_checkpoint_of_another_shape[dense]",
    "tests/test_engine_fault.py::test_a_sync_that_leaves_a_weight_out_stops_the_first_sync_in_one_line_naming_it",
    "tests/test_team.py::test_a_run_beside_a_busy_process_runs_on_the_cores_left",
    "tests/test_gpu_kit.py::test_vllms_pieces_travel_and_the_rollout_half_runs_in_dry_mode",
    "tests/test_doctor.py::test_the_doctor_samples_with_the_recipes_cut_and_measures_what_renormalizing_removes",
    "tests/test_async.py::test_engine_process_samples_as_the_engine_in_this_process",
    "tests/test_observability.py::test_tensorboard_wandb_status_and_plot_of_a_run_with_rollbacks",
    "tests/test_async.py::test_two_processes_move_the_weights_by_broadcast",
    "tests/test_env_adapters.py::"
    "test_a_client_trains_three_steps_through_the_cli_on_fewer_sessions_than_episodes[tools]",
    "tests/test_export.py::test_best_never_picks_what_a_rollback_undid",
    "tests/test_env_adapters.py::"
    "test_a_client_trains_three_steps_through_the_cli_on_fewer_sessions_than_episodes[game]",
)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, longest first on every worker: the work-stealing scheduler hands each of
    the k workers a consecutive k-th of the list and later moves tests from the end of the longest
    queue, so the list is dealt like cards (every k-th test to one worker's slice) after sorting by
    expected length. Each worker then starts on its share of the longest tests and ends on short
    ones, and no hour-long tail is left to one worker while the other idles. In one process the
    order stays the files' own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 1:
        return
    rank = {name: i for i, name in enumerate(LONGEST)}

    def expected(item) -> tuple[int, int]:
        if item.nodeid in rank:
            return 0, rank[item.nodeid]
        return (1 if item.get_closest_marker("slow") else 2), 0

    ordered = sorted(items, key=expected)  # stable: the files' order among equals
    # tests marked together("NAME") share one costly fixture (test_parallel's launch): dealt as one
    # card, at the place of the first of them, so one worker builds it and no other waits for it
    cards: dict[str, list] = {}
    for it in ordered:
        mark = it.get_closest_marker("together")
        cards.setdefault(mark.args[0] if mark else it.nodeid, []).append(it)
    hands: list[list] = [[] for _ in range(workers)]
    for i, card in enumerate(cards.values()):
        hands[i % workers].extend(card)
    items[:] = [it for hand in hands for it in hand]


def data_workspace(root: Path, *, train: int = 400, heldout: int = 16) -> Path:
    """A workspace folder with the tiny recipe and the embedded task's splits, no model of its own
    (tests pass --model, or copy one in)."""
    from minirl.data.task import make_splits, write_jsonl

    root.mkdir(parents=True)
    (root / "minirl.toml").write_text((ROOT / "recipes" / "tiny.toml").read_text())
    train_rows, heldout_rows = make_splits(train, heldout, seed=0)
    write_jsonl(root / "data/train.jsonl", train_rows)
    write_jsonl(root / "data/heldout.jsonl", heldout_rows)
    return root


def cli_telling_imports() -> list[str]:
    """The argv of a `minirl` process that says, as its last line on stderr, `imported: <torch> <vllm>`
    (True or False): whether that process itself, not a child of it, imported torch and vLLM."""
    import sys

    code = ("import sys, atexit\n"
            "atexit.register(lambda: print('imported:', 'torch' in sys.modules, 'vllm' in sys.modules, "
            "file=sys.__stderr__))\n"
            "sys.argv = ['minirl', *sys.argv[1:]]\n"
            "from cli.main import entry\n"
            "entry()\n")
    return [sys.executable, "-c", code]


def free_port() -> int:
    """A free port for a rendezvous of several torchrun agents on this machine, which must agree on
    it before any binds it (one agent, `--standalone`, needs none): another process could take it
    in between, a window of milliseconds."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(argv: list[str], port: int, log: Path, env: dict | None = None):
    """A server process (`argv`, listening on 127.0.0.1:`port`, its stderr in `log`) started: its URL once its
    /health answers; killed at the end."""
    import subprocess
    import time
    import urllib.request

    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        for _ in range(300):  # its /health answers once uvicorn listens
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def last_digit_rewards(ws: Path) -> None:
    """Make a workspace's task one a random model earns now and then (the answer's last digit is the
    response's last digit), so that advantages, and with them the updates, are not all zero."""
    import json

    for split in ("train", "heldout"):
        f = ws / "data" / f"{split}.jsonl"
        f.write_text("".join(json.dumps({**row, "answer": row["answer"][-1]}) + "\n"
                             for row in map(json.loads, f.read_text().splitlines())))
    recipe_file = ws / "minirl.toml"
    recipe_file.write_text(recipe_file.read_text().replace('grader = "arith"',
                                                           'grader = "regex"\nparams = { pattern = "([0-9])" }'))


def random_hf_folder(root: Path, shape, *, std: float, dtype=None) -> Path:
    """root/hf: an HF folder of `shape` with random weights (matrices ~N(0, std)) and minirl's
    character tokenizer; `dtype` as saved (default fp32)."""
    import torch

    from minirl.setup.tokenizer import build_tokenizer
    from minirl.train.hf_io import save_hf_folder
    from minirl.train.trainer import Trainer

    tok = build_tokenizer(root / "tok", shape.vocab_size, shape.max_seq_len)
    tr = Trainer(shape, lr=1e-3, seed=0)
    with torch.no_grad():
        for _, p in tr.model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    return save_hf_folder(root / "hf", shape, tr.model.state_dict(), tokenizer_dir=tok, dtype=dtype or torch.float32)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """HF folder of a randomly initialised tiny model (weights ~N(0, 0.1) so outputs are non-trivial)."""
    from minirl.models.shapes import TINY

    return random_hf_folder(tmp_path_factory.mktemp("tiny"), TINY, std=0.1)


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from minirl.rollout.vllm import VLLMEngine

    return VLLMEngine(tiny_dir, dtype="bfloat16", seed=0, max_model_len=32)  # its KV cache sized for the job


# Engines live for the session: each costs seconds to build (an engine dropped mid-session leaves the
# others working: rollout/lifetime.py).
@pytest.fixture(scope="session")
def engine32(tiny_dir):
    from minirl.rollout.vllm import VLLMEngine

    return VLLMEngine(tiny_dir, dtype="float32", seed=0, max_model_len=32, kv_cache_gib=0.25)


@pytest.fixture(scope="session")
def engine_r3(tiny_dir):
    from minirl.rollout.vllm import VLLMEngine

    return VLLMEngine(tiny_dir, dtype="bfloat16", seed=0, max_model_len=32, kv_cache_gib=0.25, capture_routes=True)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(folder)` run once for all xdist workers of this session (a file lock in the session's
    shared folder, a marker once whole); the folder it built."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's folder, above every worker's own
    root = shared / name
    with FileLock(str(root) + ".lock"):
        if not (root / "built").exists():
            build(root)
            (root / "built").touch()
    return root


@pytest.fixture(scope="session")
def _embedded_default_built(tmp_path_factory) -> Path:
    def init(root: Path) -> None:
        import subprocess
        import sys

        r = subprocess.run([sys.executable, "-m", "cli.main", "init", str(root / "ws")], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]

    return built_once(tmp_path_factory, "embedded-default", init) / "ws"


@pytest.fixture
def embedded_default(_embedded_default_built, tmp_path) -> Path:
    """`minirl init` of the embedded default (its own cold start, ~1 min), built once for the
    session's workers; each test gets a copy of its own, so the runs in it are the test's."""
    import shutil

    return shutil.copytree(_embedded_default_built, tmp_path / "embedded-ws", symlinks=True)


@pytest.fixture
def short_tmpdir():
    """A temporary folder of the test's own for a child's TMPDIR, short (under the system's, not pytest's
    deep tmp_path): Python's sockets go there and a socket's path must fit in 107 bytes."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="mt"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))
