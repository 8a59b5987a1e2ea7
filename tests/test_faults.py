"""Real faults against real runs (slow, marked): SIGTERM, NaN updates, SIGKILL at random moments
(including mid-checkpoint), a disk that fills up mid-run. Each asserts what must hold afterwards:
exit codes, that every checkpoint on disk loads, that metrics stay one row per step, and that no
bad update reaches the weights. Figures go to stdout (pytest -s shows them)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL_INIT = [
    "--set", "cold_start.max_steps=30", "--set", "cold_start.train_size=2000",
    "--set", "cold_start.heldout_size=32", "--set", "cold_start.dev_size=32",
    "--set", "train.prompts_per_step=8", "--set", "train.group_size=4", "--set", "eval.k=1",
    # a barely trained policy earns no exact sums; a number within 300 of the sum gives a signal to learn from
    "--set", "reward.grader=numeric", "--set", 'reward.params={"tol": 300}',
]
EVERY_STEP = ["--set", "checkpoint.every=1"]


def env(**extra) -> dict:
    return {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT), **extra}


def start(ws: Path, *args, out=subprocess.DEVNULL, **env_extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli.main", "run", str(ws), *args], cwd=ROOT, env=env(**env_extra),
                            stdout=out, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="session")
def small_ws(tmp_path_factory) -> Path:
    """A small scratchpad workspace, `minirl init` once for the session's workers; tests copy it."""
    from tests.conftest import built_once

    def init(root: Path) -> None:
        r = subprocess.run([sys.executable, "-m", "cli.main", "init", str(root / "ws"), *SMALL_INIT], cwd=ROOT,
                           env=env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]

    return built_once(tmp_path_factory, "faults-small", init) / "ws"


def fresh_copy(small_ws: Path, tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(small_ws, ws)
    return ws


def only_run(ws: Path) -> Path:
    runs = sorted(p for p in (ws / "runs").iterdir() if p.is_dir())
    assert len(runs) == 1, runs
    return runs[0]


def metric_rows(run_dir: Path, *, allow_torn_last: bool = False) -> list[dict]:
    from minirl.disk.store import parse_metric_line

    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(parse_metric_line(line))  # the product's reader: a null it wrote for a NaN is a NaN again
        except json.JSONDecodeError:
            assert allow_torn_last and i == len(lines) - 1, f"torn line {i + 1} of {len(lines)}"
    return rows


def wait_for_rows(run_dir_of, n: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until the run has logged n rows (a hang guard, not a speed assertion)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        run_dir = run_dir_of()
        if run_dir is not None and len(metric_rows(run_dir, allow_torn_last=True)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {n} rows in {timeout_s} s")


def wait_until(condition, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """A hang guard, not a speed assertion."""
    deadline = time.time() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"run exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError(f"condition not met in {timeout_s} s")
        time.sleep(0.05)


def latest_run(ws: Path):
    runs = sorted(p for p in (ws / "runs").iterdir() if p.is_dir()) if (ws / "runs").exists() else []
    return runs[-1] if runs else None


def checkpoint_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=1e-3)
    tr.load(ckpt)  # model and optimizer: the whole checkpoint must load
    return {k: v.clone() for k, v in tr.model.state_dict().items()}


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_and_nan_updates_never_reach_the_weights(small_ws, tmp_path):
    ws = fresh_copy(small_ws, tmp_path)
    # the guard only observing (as in every lab cell): non-finite updates are skipped all the same
    proc = start(ws, "--steps", "500", *EVERY_STEP, "--set", "checkpoint.keep=0", "--set", "guard.enabled=false",
                 MINIRL_INJECT_NAN="loss@2,grad@4")
    wait_for_rows(lambda: latest_run(ws), 6, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]

    run_dir = only_run(ws)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    n = summary["steps"]
    assert n >= 6 and Path(summary["checkpoint"]).name == f"step_{n:06d}"
    # a prompt exit: the checkpoint is what --resume needs; the end's eval and HF folder wait
    assert summary["heldout"]["end"] is None and summary["heldout"]["gain_points"] is None
    assert summary["hf_folder"] is None and not (Path(summary["checkpoint"]) / "hf").exists()
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, n + 1))
    actions = {r["step"]: r.get("guard/action") for r in rows}
    assert actions[2] == "skip" and actions[4] == "skip"
    assert [s for s, a in actions.items() if a] == [2, 4]  # nothing else tripped
    assert rows[1]["train/loss"] != rows[1]["train/loss"]  # the NaN loss is recorded as it was (read back)...
    raw = (run_dir / "metrics.jsonl").read_text().splitlines()  # ... in strict JSON (#82): null, and named
    strict = [json.loads(x, parse_constant=lambda c: pytest.fail(f"a bare {c} in metrics.jsonl")) for x in raw]
    assert strict[1]["train/loss"] is None and strict[1]["nonfinite"]["train/loss"] == "nan"
    assert rows[-1]["guard/skipped_updates"] == 2

    w = {s: checkpoint_weights(run_dir / "checkpoints" / f"step_{s:06d}") for s in range(1, 6)}
    same = lambda a, b: all(torch.equal(w[a][k], w[b][k]) for k in w[a])  # noqa: E731
    assert same(1, 2) and same(3, 4)  # the poisoned steps changed nothing
    assert not same(2, 3) and not same(4, 5)  # the steps around them did train
    assert all(torch.isfinite(v).all() for v in w[5].values())


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(small_ws, tmp_path):
    """3 kills: 2 at a random moment of the steps, 1 while a checkpoint is being written. After
    each, every complete checkpoint loads, and the resumed run continues from the newest one.
    (torchrun restarts after a SIGKILL: tests/test_parallel.py.)"""
    ws = fresh_copy(small_ws, tmp_path)
    rng = random.Random(0)
    args = ["--steps", "100000", *EVERY_STEP, "--set", "checkpoint.keep=2"]
    figures = []
    proc = start(ws, *args)
    for kill in range(3):
        run_dir = latest_run(ws)
        before = len(metric_rows(run_dir, allow_torn_last=True)) if run_dir else 0
        wait_for_rows(lambda: latest_run(ws), before + 1, proc)  # stepping (again)
        run_dir = only_run(ws)
        if kill % 2 == 1:  # while a checkpoint is being written
            ckpts = run_dir / "checkpoints"
            while not any(p.name.endswith(".tmp") for p in ckpts.iterdir()):
                time.sleep(0.002)
        else:
            time.sleep(rng.uniform(0.0, 2.0))
        proc.kill()
        proc.wait(timeout=60)

        in_write = any(p.name.endswith(".tmp") for p in (run_dir / "checkpoints").iterdir())
        rows = metric_rows(run_dir, allow_torn_last=True)
        steps = [r["step"] for r in rows]
        assert steps == list(range(1, len(steps) + 1))  # one row per step, in order
        from minirl.disk.store import complete_checkpoints
        from minirl.models.shapes import TINY
        from minirl.setup.preflight import check_checkpoint

        complete = complete_checkpoints(run_dir)
        for c in complete:
            check_checkpoint(c, TINY, "tiny-qwen3-moe")
            checkpoint_weights(c)
        newest = max(json.loads((c / "minirl.json").read_text())["step"] for c in complete)
        lost = steps[-1] - newest if steps else 0
        assert 0 <= lost <= 1  # checkpoint.every = 1: at most the step in flight is redone
        figures.append({"kill": kill + 1, "logged": steps[-1], "newest_checkpoint": newest, "lost_steps": lost,
                        "in_checkpoint_write": in_write, "checkpoints_on_disk": len(complete)})
        inode = (run_dir / "metrics.jsonl").stat().st_ino
        proc = start(ws, "--resume", *args)
        # the resumed run rewrites metrics.jsonl (atomically: a new inode) before its first step;
        # only then do its rows say anything (and its signal handlers are in place)
        wait_until(lambda: (run_dir / "metrics.jsonl").stat().st_ino != inode, proc)
        wait_for_rows(lambda: run_dir, newest + 1, proc)
        resumed = [r["step"] for r in metric_rows(run_dir, allow_torn_last=True)]
        assert resumed[: newest + 1] == list(range(1, newest + 2))  # rows past the checkpoint were dropped, then redone

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]  # Ctrl-C: the step in flight ends, then a checkpoint
    rows = metric_rows(run_dir)  # no torn line left
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT" and summary["steps"] == len(rows)
    assert Path(summary["checkpoint"]).name == f"step_{len(rows):06d}"
    # what the model wrote (#98): whole lines only, each step's groups once, the same steps as the rows
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(x["step"], x["group"]) for x in samples] == [(s, g) for s in range(1, len(rows) + 1) for g in range(2)]
    print("\nSIGKILL figures:", json.dumps(figures, indent=1))
    assert sum(f["in_checkpoint_write"] for f in figures) >= 1


@pytest.mark.slow
def test_a_disk_that_fills_up_mid_run(small_ws, tmp_path):
    """The run folder on a small tmpfs (a mount namespace of its own); a filler takes the free
    space after step 3. The run ends with one line and exit 4, every complete checkpoint loads,
    and once there is room again `--resume` carries on."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private tmpfs mount")
    ws = fresh_copy(small_ws, tmp_path)
    (ws / "runs").mkdir()
    report = tmp_path / "report.json"
    py = sys.executable
    script = f"""
set -u
mount -t tmpfs -o size=64m tmpfs {ws}/runs || exit 90
{py} -m cli.main run {ws} --steps 10000 {' '.join(EVERY_STEP)} > {tmp_path}/out.txt 2> {tmp_path}/err.txt &
pid=$!
while ! grep -qs '"step": 3,' {ws}/runs/*/metrics.jsonl; do kill -0 $pid || break; sleep 0.05; done
dd if=/dev/zero of={ws}/runs/filler bs=1M status=none 2>/dev/null
wait $pid; echo $? > {tmp_path}/rc.txt
{py} - <<'EOF'
import json, pathlib, sys
sys.path.insert(0, "{ROOT}")
from minirl.disk.store import complete_checkpoints
from minirl.models.shapes import TINY
from minirl.setup.preflight import check_checkpoint
from minirl.train.trainer import Trainer
run = sorted(p for p in pathlib.Path("{ws}/runs").iterdir() if p.is_dir())[-1]
loaded = []
for c in complete_checkpoints(run):
    check_checkpoint(c, TINY, "tiny-qwen3-moe"); Trainer(TINY, lr=1e-3).load(c); loaded.append(c.name)
leftovers = [p.name for p in (run / "checkpoints").iterdir() if "." in p.name]
json.dump({{"loaded": loaded, "leftovers": leftovers}}, open("{report}", "w"))
EOF
rm {ws}/runs/filler
{py} -m cli.main run {ws} --resume --steps 8 {' '.join(EVERY_STEP)} > {tmp_path}/out2.txt 2> {tmp_path}/err2.txt
echo $? > {tmp_path}/rc2.txt
{py} -c "import json,pathlib; r=sorted(p for p in pathlib.Path('{ws}/runs').iterdir() if p.is_dir())[-1]; print(json.dumps([json.loads(x)['step'] for x in (r/'metrics.jsonl').read_text().splitlines()]))" > {tmp_path}/steps.txt
"""
    cmd = ["unshare", "-m", "bash", "-c", script] if os.geteuid() == 0 else ["unshare", "-rm", "bash", "-c", script]
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)
    if r.returncode == 90:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    err = (tmp_path / "err.txt").read_text()
    assert (tmp_path / "rc.txt").read_text().strip() == "4", err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("minirl: error: cannot write") and "No space left on device" in last, last
    assert f"free space, then `minirl run {ws} --resume`" in last, last  # it had checkpoints: the advice resumes
    assert "Traceback" not in err
    rep = json.loads(report.read_text())
    assert rep["loaded"] and rep["leftovers"] == []  # complete checkpoints load; no half-written one remains
    assert (tmp_path / "rc2.txt").read_text().strip() == "0", (tmp_path / "err2.txt").read_text()[-3000:]
    assert json.loads((tmp_path / "steps.txt").read_text()) == list(range(1, 9))


@pytest.mark.slow
def test_a_preemption_mid_collapse_rolls_back_to_the_newest_good_and_an_end_cut_short_ends(small_ws, tmp_path):
    """#80. The engine drifts from the trainer from step 3 (MINIRL_INJECT_SKEW: KL(μ‖π_old) 0.5),
    so steps 3 and 4 are bad, their checkpoints no rollback target; SIGKILLed as step 5 begins (a
    preemption), `--resume auto` takes the streak on from the checkpoint: step 5 is the third bad
    step and rolls back to step 2, the newest good checkpoint (before #80: to step 4, the one it
    resumed from, at step 7). Then the run is SIGKILLed as its final HF folder begins (an OOM kill
    at the end of a 30B run), and `--resume auto` writes the summary, saying what is missing, in one
    line with exit code 4, and never tries the same end again."""
    ws = fresh_copy(small_ws, tmp_path)
    args = ["--steps", "6", *EVERY_STEP, "--set", "checkpoint.keep=0", "--set", "guard.patience=3",
            "--set", "guard.max_rollbacks=3", "--resume", "auto"]
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env(MINIRL_INJECT_SKEW="3", MINIRL_INJECT_KILL="0@5"))
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    run_dir = only_run(ws)
    from minirl.disk.store import complete_checkpoints, read_record

    good = {read_record(c)["step"]: read_record(c)["good"] for c in complete_checkpoints(run_dir)}
    assert good == {0: True, 1: True, 2: True, 3: False, 4: False}, good
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env(MINIRL_INJECT_SKEW="3", MINIRL_INJECT_END="kill"))
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    rows = metric_rows(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    acted = [(m["step"], m.get("guard/action"), m.get("guard/rollback_to_step")) for m in rows if "guard/action" in m]
    assert acted[:3] == [(3, "step", None), (4, "step", None), (5, "rollback", 2)], acted
    assert not (run_dir / "summary.json").exists() and (run_dir / "end_started").read_text() == "6"
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env())
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("minirl:")]
    assert r.returncode == 4 and "the end of this run was cut short at step 6" in line, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["hf_folder"] is None and "cut short" in summary["error"]
    assert not (run_dir / "end_started").exists() and not (run_dir / "checkpoints" / "step_000006" / "hf").exists()


def test_an_interrupted_eval_says_what_it_kept_and_the_same_command_resumes_there(small_ws, tmp_path):
    """A Ctrl-C mid-evaluation (MINIRL_INJECT_EVAL_STOP: a SIGINT as soon as a problem is kept) ends in one
    line saying how many problems are kept, exit code 130 and no traceback; the same command resumes them
    and generates the rest."""
    ws = fresh_copy(small_ws, tmp_path)
    cmd = [sys.executable, "-m", "cli.main", "eval", "heldout", str(ws), "--checkpoint", "coldstart"]
    r = subprocess.run(cmd, cwd=ROOT, env=env(MINIRL_INJECT_EVAL_STOP="1"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 130, r.stderr[-3000:]
    [partial] = (ws / "evals").glob("*.partial.jsonl")
    kept = len(partial.read_text().splitlines())
    assert 0 < kept < 32 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"minirl: eval stopped: {kept} of 32 problems kept; the same command "
                                                 "resumes from there")
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed: {kept} problems were already done" in r.stdout
    assert not partial.exists()


def test_a_disk_full_before_the_first_checkpoint_advises_a_new_run(tiny_dir, tmp_path, monkeypatch):
    """#82: the exit-4 line said "free space, then `minirl run … --resume`" when the run had no
    checkpoint yet, and that resume answers "nothing to resume". The advice is what works."""
    import errno

    from minirl.config import recipes
    from minirl.errors import RunIOError
    from minirl.run import lifecycle
    from minirl.setup.workspace import Workspace
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    rec = recipes.load(ws / "minirl.toml", [f"model.path={tiny_dir}", "train.steps=1"])

    def fills_up(ws, rec, inputs, *a, **k):  # the run's folder made, then the disk full before any checkpoint
        (ws.runs / "20261202-000000").mkdir(parents=True)
        raise OSError(errno.ENOSPC, "No space left on device", str(ws.runs / "20261202-000000" / "checkpoints"))

    monkeypatch.setattr(lifecycle, "_start_and_train", fills_up)
    with pytest.raises(RunIOError) as e:
        lifecycle.run(Workspace.open(ws), rec)
    assert "the run had no checkpoint yet (free space, then `minirl run" in str(e.value) and "--resume" not in str(e.value)
