"""No network (an air-gapped cluster): whatever asks the Hub is refused at once in one line that
says what to pass instead, with no retry chatter from the Hub client; the offline variables are
honoured. The commands run in a network namespace of their own with no interface up (`unshare
-n`), as on a machine with no route out (the Hub's name does not even resolve there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ws(tiny_dir, tmp_path_factory) -> Path:
    from tests.conftest import data_workspace

    root = data_workspace(tmp_path_factory.mktemp("offline") / "ws")
    shutil.copytree(tiny_dir, root / "model/coldstart")
    return root


def offline(*args: str, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(["unshare", "-n", sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**env, "COLUMNS": "200", **env_extra})


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert "Retrying" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    return lines[0]


def test_a_hub_benchmark_without_network_is_one_line_saying_what_to_pass(ws):
    line = one_line(offline("eval", "aime25", "-w", str(ws), "--checkpoint", "coldstart"))
    assert line == ("minirl: error: dataset 'MathArena/aime_2025': the Hugging Face Hub (https://huggingface.co) "
                    "cannot be reached; pass a local copy with --data PATH (.jsonl with 'problem' and 'answer'), or "
                    "with a cache filled elsewhere set HF_HUB_OFFLINE=1")


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_with_an_offline_variable_nothing_is_probed_and_the_cache_answers(ws, tmp_path, var):
    line = one_line(offline("eval", "aime25", "-w", str(ws), "--checkpoint", "coldstart", **{var: "1",
                            "HF_HOME": str(tmp_path / "empty-cache")}))
    assert "is not in the local cache and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set; pass a local copy" in line
    # a local copy still works offline (the eval itself is tests/test_benchmarks.py's)
    from minirl.eval import benchmarks

    assert len(benchmarks.load_records(benchmarks.get("aime25"), data=ROOT.parent / "shared/data/benchmarks/aime25.jsonl")) == 30


def test_a_hub_model_without_network_is_one_line(tmp_path):
    line = one_line(offline("init", str(tmp_path / "ws"), "--model", "Qwen/Qwen3-4B-Instruct-2507"))  # its config
    assert "model 'Qwen/Qwen3-4B-Instruct-2507': the Hugging Face Hub (https://huggingface.co) cannot be reached; " \
           "pass a local HF model folder" in line
    assert not (tmp_path / "ws").exists()


def test_the_hub_is_probed_once_per_process(monkeypatch):
    """One HEAD request, then the answer is kept: a run that asks the Hub for three things waits
    for it once."""
    from minirl.models import hub

    calls = []

    class Session:
        def head(self, url, timeout):
            calls.append((url, timeout))
            raise OSError("unreachable")

    hub.reachable.cache_clear()
    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: Session())
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    try:
        for _ in range(3):
            with pytest.raises(hub.UsageError, match="cannot be reached"):
                hub.need_hub("x", instead="y")
        assert len(calls) == 1 and calls[0][1] <= 3.0
    finally:
        hub.reachable.cache_clear()


def test_an_upload_is_never_told_to_go_offline(monkeypatch):
    """A cache can answer a download, never a push: the push's line names no offline variable."""
    from minirl.errors import UsageError
    from minirl.models import hub

    monkeypatch.setattr(hub, "reachable", lambda: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(UsageError) as down:
        hub.need_hub("push to me/model", instead="push from a machine with network", cache_helps=False)
    assert str(down.value).endswith("cannot be reached; push from a machine with network")
    with pytest.raises(UsageError, match="set HF_HUB_OFFLINE=1$"):
        hub.need_hub("model 'a/b'", instead="pass a local HF model folder")
