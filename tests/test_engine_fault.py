"""A broken rollout engine stops the run in one line (#72): the FP8 engine on the H200 returned
non-finite log μ for every decoded token after its first sleep, and the run trained on one token a
response without a word. Here the engine's output is broken the same way at the narrowest seam
(faults.py: log μ NaN after each response's first token), and a parity check comes back NaN."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["--set", "train.prompts_per_step=8", "--set", "train.group_size=4", "--set", "eval.k=1",
         "--set", "rollout.max_tokens=4", "--set", "eval.max_problems=8"]


def minirl(*args, **env):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", **env})


def said(r) -> list[str]:
    """minirl's own lines on stderr (libraries may warn there too): one, and no traceback."""
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("minirl:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=1e-3)
    tr.load(ckpt, with_optim=False)
    return {k: v.clone() for k, v in tr.model.state_dict().items()}


@pytest.fixture()
def ws(tiny_dir, tmp_path) -> Path:
    from tests.conftest import data_workspace, last_digit_rewards

    ws = data_workspace(tmp_path / "ws")
    last_digit_rewards(ws)  # rewards the random model earns: every step's update moves the weights
    return ws


@pytest.mark.slow
def test_nonfinite_engine_logprobs_stop_the_run_before_any_update_and_resume_continues(ws, tiny_dir):
    # the same seeded run for one step: the weights a run holds after step 1
    r = minirl("run", str(ws), "--model", str(tiny_dir), "--steps", "1", *STEPS)
    assert r.returncode == 0, r.stderr[-3000:]
    [one] = sorted((ws / "runs").iterdir())
    after_step_1 = weights(one / "checkpoints" / "step_000001")

    r = minirl("run", str(ws), "--model", str(tiny_dir), "--steps", "3", *STEPS, MINIRL_INJECT_NAN="logp@2")
    assert r.returncode == 5, r.stderr[-3000:]
    err = said(r)
    # log μ NaN after each response's first token: every token but one a response
    assert re.fullmatch(r"minirl: error: step 2: the rollout engine returned non-finite log-probs for 7\d\.\d% of the "
                        r"step's 1\d\d response tokens \(guard.max_nonfinite_logp = 0.001\); nothing was trained on "
                        r"them: .*--resume.*", err[0]), err[0]
    run_dir = sorted((ws / "runs").iterdir())[-1]
    got = rows(run_dir)
    assert [m["step"] for m in got] == [1]
    assert got[0]["rollout/logp_nonfinite_frac"] == 0 and got[0]["loss/tokens"] == got[0]["rollout/resp_tokens"] > 100
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "engine_fault" and summary["steps"] == 1 and summary["error"] in err[0]
    assert summary["heldout"]["end"] is None and summary["hf_folder"] is None  # a broken engine evaluates nothing
    # nothing of the damaged batch reached the weights: the run ends on step 1's, bit for bit
    final = Path(summary["checkpoint"])
    assert final.name == "step_000001" and not (run_dir / "checkpoints" / "step_000002").exists()
    assert all(torch.equal(v, after_step_1[k]) for k, v in weights(final).items())

    st = minirl("status", str(ws))
    assert st.returncode == 0 and "engine_fault" in st.stdout and "stopped: step 2: the rollout engine" in st.stdout

    # the engine mended (no fault this time), --resume trains on from step 1: one row a step
    r = minirl("run", str(ws), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in rows(run_dir)] == [1, 2, 3]


@pytest.mark.slow
def test_a_parity_check_that_is_not_finite_stops_the_run_with_its_step_kept(ws, tiny_dir):
    r = minirl("run", str(ws), "--model", str(tiny_dir), "--steps", "4", *STEPS, "--set", "rollout.parity_every=1",
               MINIRL_INJECT_NAN="parity@2")
    assert r.returncode == 5, r.stderr[-3000:]
    err = said(r)
    assert err[0].startswith("minirl: error: step 2: the parity check after the sync is nan"), err
    run_dir = sorted((ws / "runs").iterdir())[-1]
    got = rows(run_dir)
    # step 2 trained (its parity comes after its sync): its row and checkpoint stay, without a NaN
    assert [m["step"] for m in got] == [1, 2] and "sync/parity_abs_dlogp" not in got[1]
    assert 0 < got[0]["sync/parity_abs_dlogp"] < 5e-2
    assert all(m["rollout/logp_nonfinite_frac"] == 0 for m in got)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "engine_fault" and Path(summary["checkpoint"]).name == "step_000002"


def test_a_sync_that_leaves_a_weight_out_stops_the_first_sync_in_one_line_naming_it(ws, tiny_dir):
    """#79: a sync that does not write every weight the engine holds (faults.py drops one from what
    is sent, as a trainer whose names the engine does not map would) stops at the run's first sync,
    as the engine starts, before anything is sampled: one line naming it, exit 5, and no run folder
    left (nothing started). Both sync paths of the engine beside the trainer: the streamed one
    (FP8 emulated, as a CUDA engine takes it) and the views it binds (bf16)."""
    for precision in ("fp8", "bf16"):
        r = minirl("run", str(ws), "--model", str(tiny_dir), "--steps", "2", *STEPS, "--set",
                   f"rollout.precision={precision}", MINIRL_INJECT_DROP_WEIGHT="model.layers.1.mlp.gate.weight")
        assert r.returncode == 5, r.stderr[-3000:]
        err = said(r)
        assert "model.layers.1.mlp.gate.weight" in err[0] and ("stale" in err[0] or "unwritten" in err[0]), err
        assert not (ws / "runs").exists() or not list((ws / "runs").iterdir())


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
            for c in (t / "children").read_text().split()]


def _engine_child(run_pid: int, proc) -> int:
    """The engine's process of a run at k ≥ 1 (a spawned child running multiprocessing's spawn main)."""
    from tests.test_faults import wait_until

    found = []

    def spawned() -> bool:
        for c in _children(run_pid):
            try:
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():  # not the resource tracker
                    found.append(c)
                    return True
            except OSError:
                pass
        return False

    wait_until(spawned, proc)
    return found[0]


@pytest.mark.slow
def test_a_dead_engine_is_named_in_one_line_and_ctrl_c_is_quiet_in_every_process(ws, tiny_dir):
    """#75: at k = 1 a SIGKILL of the engine's child ended the run with exit 1 and only library
    warnings; Ctrl-C to the process group printed the engine's KeyboardInterrupt traceback."""
    import signal

    from tests.test_faults import wait_for_rows

    args = [sys.executable, "-m", "cli.main", "run", str(ws), "--model", str(tiny_dir), "--steps", "200", *STEPS,
            "--set", "rollout.max_staleness=1", "--set", "checkpoint.every=1"]
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_dir = lambda: next((ws / "runs").iterdir(), None) if (ws / "runs").exists() else None  # noqa: E731
    wait_for_rows(run_dir, 2, proc)
    os.kill(_engine_child(proc.pid, proc), signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 5, err[-3000:]
    [line] = [ln for ln in err.splitlines() if ln.startswith("minirl:")]
    assert "Traceback" not in err
    assert line.startswith("minirl: error: the rollout engine's process died (killed by SIGKILL") and \
        f"`minirl run {ws} --resume`" in line, line
    steps = [m["step"] for m in rows(run_dir())]
    assert steps == list(range(1, len(steps) + 1))

    # Ctrl-C to the whole process group (as a terminal sends it): a quiet stop, in every process
    proc = subprocess.Popen([*args, "--resume"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_rows(run_dir, len(steps) + 2, proc)
    _engine_child(proc.pid, proc)  # it is up
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    steps = [m["step"] for m in rows(run_dir())]
    assert steps == list(range(1, len(steps) + 1))

    # #82: a closed terminal (SIGHUP to the group) stops as SIGTERM does: the step finished, a
    # checkpoint, the summary, exit 129; the engine's child ignores it and is stopped by the trainer
    proc = subprocess.Popen([*args, "--resume"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_rows(run_dir, len(steps) + 2, proc)
    child = _engine_child(proc.pid, proc)
    os.killpg(proc.pid, signal.SIGHUP)
    proc.communicate(timeout=600)
    assert proc.returncode == 129
    summary = json.loads((run_dir() / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGHUP", summary
    assert Path(summary["checkpoint"]).name == f"step_{summary['steps']:06d}"
    steps = [m["step"] for m in rows(run_dir())]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == summary["steps"]
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # stopped with the run, not left behind
