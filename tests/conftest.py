"""Shared fixtures: a tiny Qwen3-MoE built by the project itself (no hub), and one vLLM engine.

The engine is session-scoped: starting vLLM costs ~5–15 s on 2 cores, and tests that change its
weights restore them (or build their own) so order never matters.
"""

from __future__ import annotations

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

from minirl.collector import collect_less_often  # noqa: E402

collect_less_often()  # the workers import torch and vLLM too, and build engines in-process

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def pytest_configure(config):
    """pytest-xdist first hands each worker a consecutive quarter of its share, which would give one
    worker every slow test (sorted first, below); one test at a time, each worker takes the next."""
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the slow end-to-end tests go first, so the longest start early and the
    short ones fill in around them; in one process the order stays the files' own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


def free_port() -> int:
    """A free port for a rendezvous of several torchrun agents on this machine, which must agree on
    it before any binds it (one agent, `--standalone`, needs none): another process could take it
    in between, a window of milliseconds."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))
