"""One writer per run (runlock.py): a second writer is refused in one line while the first lives;
a dead writer's lock never blocks; readers work during a live run. Every wait is for a state the
other process announces (a line it prints, a metrics row it wrote), never for time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minirl.errors import UsageError
from minirl.run.runlock import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

HOLD = """
import os, sys, time
from pathlib import Path
from minirl.run.runlock import RunLock
if sys.argv[2] == "lab":
    from minirl.lab.runner import Lab
    lab = Lab(Path(sys.argv[1]).parent, Path(sys.argv[1]))
    lab.hold()
else:
    lock = RunLock(sys.argv[1])
if sys.argv[2] == "fork":  # a forked child that outlives its parent (a grading worker, say)
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
print("locked", flush=True)
time.sleep(120)
"""


def _holder(folder: Path, mode: str = "plain") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), mode], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "locked"  # it holds the lock from here on
    return p


@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_a_second_writer_is_refused_until_the_first_dies(tmp_path, mode):
    run = tmp_path / "run"
    p = _holder(run, mode)
    try:
        with pytest.raises(UsageError) as e:
            RunLock(run)
        msg = str(e.value)
        assert f"pid {p.pid} on " in msg and "since " in msg and "minirl status" in msg and "\n" not in msg
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (run / LOCK_FILE).exists()  # left behind by the killed writer...
    RunLock(run).release()  # ...and no obstacle: the kernel dropped its lock (also with a forked child alive)


def test_a_second_lab_on_the_same_lab_folder_is_refused(tmp_path):
    from minirl.lab.runner import Lab

    out = tmp_path / "lab" / "quick"
    p = _holder(out, "lab")
    try:
        with pytest.raises(UsageError, match=f"lab study {out} is being written by pid {p.pid} on "):
            Lab(tmp_path, out).hold()
    finally:
        p.kill()
        p.wait()


def minirl(*args, **env_extra):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", **env_extra})


@pytest.mark.slow
def test_a_resume_during_a_live_run_is_refused_while_readers_work(tiny_dir, tmp_path):
    """`minirl run` writes; `run --resume` meanwhile exits 2 in one line and changes nothing, while
    `status` and `export` work; the first run then finishes with one row per step. (A SIGKILLed
    writer's lock is no obstacle: the test above, and every resume of test_faults' SIGKILLs.)"""
    from test_faults import wait_until

    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    sets = ["--model", str(tiny_dir), "--set", "train.prompts_per_step=8", "--set", "eval.k=1",
            "--set", "rollout.max_tokens=4", "--set", "checkpoint.every=1"]
    cmd = [sys.executable, "-m", "cli.main", "run", str(ws), *sets]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    first = subprocess.Popen([*cmd, "--steps", "4"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=env)
    runs = ws / "runs"
    # a trained checkpoint to export ("latest" is never the step-0 cold start): step 1's, complete
    wait_until(lambda: any(runs.glob("*/checkpoints/step_000001/minirl.json")) if runs.exists() else False, first)
    first.send_signal(signal.SIGSTOP)  # alive and mid-run for as long as the checks below take
    try:
        run_dir = next(runs.iterdir())
        before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        r = minirl("run", str(ws), *sets, "--steps", "6", "--resume")
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.strip().splitlines() == [
            f"minirl: error: run {run_dir} is being written by pid {first.pid} on {os.uname().nodename} "
            f"(since {r.stderr.split('(since ')[1].split(')')[0]}); see `minirl status`, or wait for it to end"]
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing changed
        r = minirl("status", str(ws))
        assert r.returncode == 0 and f"{run_dir.name}  running" in r.stdout, r.stdout + r.stderr
        r = minirl("export", "-w", str(ws), str(tmp_path / "out"))
        assert r.returncode == 0, r.stderr[-2000:]
        assert (tmp_path / "out" / "config.json").exists()
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]

