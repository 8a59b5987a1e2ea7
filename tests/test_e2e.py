"""End to end through the real CLI: init -> run (vLLM rollouts, TorchTitan training) -> crash ->
resume, on a small workspace. Slow (~2 min on 2 cores): one test, marked. Elsewhere: Ctrl-C and
SIGTERM, test_faults.py; the guard's rollbacks and collapse, test_observability.py; `minirl eval`
of a run's checkpoint, the micro study's rescore (test_studies.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minirl.disk.store import metric_rows
from minirl.data.written import records

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--set", "cold_start.max_steps=30", "--set", "cold_start.train_size=2000", "--set", "cold_start.batch_size=16",
    "--set", "cold_start.heldout_size=64", "--set", "cold_start.dev_size=32",
    "--set", "train.prompts_per_step=8", "--set", "train.group_size=4",
    "--set", "eval.k=2", "--set", "checkpoint.every=2", "--set", "reward.grader=first_digit",
    "--set", "train.minibatches=2",
]


GRADER_PKG = {
    "minirl_testgrader/__init__.py": (
        "class FirstDigitGrader:\n"
        "    \"\"\"Partial credit a barely trained policy can earn: the first digit of the sum.\"\"\"\n"
        "    def __init__(self, answer_field='answer'):\n"
        "        self.answer_field = answer_field\n"
        "    def __call__(self, record, response):\n"
        "        from rewards import Score\n"
        "        return Score(float(response[:1] == str(record[self.answer_field])[:1]), {})\n"
    ),
    "minirl_testgrader-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: minirl-testgrader\nVersion: 0.1\n",
    "minirl_testgrader-0.1.dist-info/entry_points.txt": "[minirl.graders]\nfirst_digit = minirl_testgrader:FirstDigitGrader\n",
}
ENV: dict[str, str] = {}


def install_throwaway_grader(site: Path) -> None:
    """A third-party grader package, found only through its `minirl.graders` entry point."""
    for rel, text in GRADER_PKG.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    ENV.update({**os.environ, "COLUMNS": "200", "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    ENV.pop("VLLM_CACHE_ROOT", None)  # the workspace's own vLLM cache, as a user has it (#73)


def minirl(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**ENV, **(env or {})}, timeout=600, **kw)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_step(m: dict) -> tuple:
    """What a step sampled and learned: equal between two steps only if their samples and updates were."""
    return (m["step"], m["rollout/reward_mean"], m["rollout/resp_len"], m["train/loss"], m["train/grad_norm"])


def run_in_background(ws: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli.main", "run", str(ws), "--steps", "200"], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)


def wait_for_steps(ws: Path, *, run_number: int, steps: int, timeout_s: float = 300) -> None:
    """Until the run_number-th run of ws has logged `steps` steps."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        runs = sorted((ws / "runs").iterdir())
        # the run appends as this reads: a last line may be half written (a race, not an error)
        if (len(runs) == run_number and (runs[-1] / "metrics.jsonl").exists()
                and len(metric_rows(runs[-1] / "metrics.jsonl")) >= steps):
            return
        time.sleep(0.2)
    raise AssertionError(f"run {run_number} did not reach {steps} steps in {timeout_s} s")


def titan_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=0.0)
    tr.load(ckpt, with_optim=False)
    return {k: v.clone() for k, v in tr.model.state_dict().items()}


@pytest.mark.slow
def test_init_run_kill_resume(tmp_path, short_tmpdir):
    install_throwaway_grader(tmp_path / "site")
    ws = tmp_path / "ws"
    r = minirl("init", str(ws), *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    for rel in ("minirl.toml", "data/train.jsonl", "data/heldout.jsonl", "model/coldstart/config.json",
                "model/coldstart/model.safetensors", "model/coldstart/tokenizer.json", "model/coldstart-dcp/minirl.json"):
        assert (ws / rel).exists(), rel
    stamp = (ws / "model/coldstart/model.safetensors").stat().st_mtime_ns
    again = minirl("init", str(ws))
    assert again.returncode == 0 and "left as it is" in again.stdout
    assert (ws / "model/coldstart/model.safetensors").stat().st_mtime_ns == stamp

    # --- 3 real RL steps ------------------------------------------------------------------------
    r = minirl("run", str(ws), "--steps", "3", "--set", "rollout.parity_every=2", "--set", "eval.every=2",
               "--set", "metrics.record_tokens=3", env={"TMPDIR": str(short_tmpdir)})  # the run's own
    left = list(short_tmpdir.glob("vllm_dist_*"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not left, left  # the file the engine's process groups met through (vLLM's), deleted as the run ends
    run_dir = sorted((ws / "runs").iterdir())[-1]
    checked = minirl("check", str(ws))  # every trained token is what the engine sampled (#98)
    assert checked.returncode == 0 and "no: " not in checked.stdout, checked.stdout + checked.stderr
    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3]
    # parity after the run's first sync and every 2nd; held-out every 2nd step, off the RL clock
    assert ["sync/parity_abs_dlogp" in m for m in rows] == [True, True, False]  # not due: absent, never NaN
    assert ["heldout/avg@2" in m for m in rows] == [False, True, False] and 0 <= rows[1]["heldout/avg@2"] <= 1
    assert "held-out step 2: avg@2" in r.stdout
    loop = [m["timing/loop_s"] for m in rows]
    assert 0 < loop[0] < loop[1] < loop[2] and rows[2]["timing/heldout_s"] > 0
    assert any(m["rollout/reward_mean"] > 0 for m in rows)  # the plug-in grader, loaded by name, scored
    assert all(len(m["loss/clip_frac_per_mb"]) == 2 and m["loss/clip_frac_per_mb"][0] == 0.0 for m in rows)
    for m in rows:
        assert 0.0 <= m["rollout/acc"] <= 1.0 and m["train/entropy"] > 0
        assert m["loss/is_weight_max"] >= m["loss/is_weight_mean"] > 0
        assert 0 < m.get("sync/parity_abs_dlogp", 0.01) < 5e-2  # vLLM = trainer
        # every sampled token trained on: the loss's tokens are the step's response tokens (#72)
        assert m["rollout/logp_nonfinite_frac"] == 0 and m["loss/tokens"] == m["rollout/resp_tokens"] > 0
        assert all(m[f"timing/{k}_s"] > 0 for k in ("rollout", "old_logp", "update", "sync"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
    cache = ws / ".cache" / "vllm"  # #73: vLLM's cache in the workspace, filled by its first run, reused after
    assert f"vLLM compile cache: filled {cache} (the next run or eval of this model reuses it)" in r.stdout
    assert summary["engine_cache"]["reused"] is False
    assert set(summary["heldout"]) == {"metric", "start", "end", "gain_points"}
    assert summary["heldout"]["metric"] == "avg@2" and 0 <= summary["heldout"]["end"]["avg@2"] <= 1
    assert Path(summary["checkpoint"]).name == "step_000003" and (Path(summary["hf_folder"]) / "config.json").exists()
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    before = titan_weights(ws / "model/coldstart-dcp")
    after = titan_weights(Path(summary["checkpoint"]))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), set(before) - set(changed)  # every tensor moved, routers included

    # --- a hard crash (SIGKILL) loses at most the steps since the last checkpoint -------------------
    # (Ctrl-C and SIGTERM, which stop after the current step with a checkpoint: test_faults.py)
    proc = run_in_background(ws)
    wait_for_steps(ws, run_number=2, steps=5)
    proc.kill()
    proc.wait(timeout=60)
    run2 = sorted((ws / "runs").iterdir())[-1]
    logged = [m["step"] for m in metrics(run2)]
    ckpt_steps = sorted(int(c.name.split("_")[1]) for c in (run2 / "checkpoints").glob("step_*") if "." not in c.name)
    assert ckpt_steps and ckpt_steps[-1] <= logged[-1]
    before_kill = metrics(run2)
    samples_before = [x for x in records(run2 / "samples.jsonl") if x["step"] <= logged[-1]]
    r = minirl("run", str(ws), "--resume", "--steps", str(logged[-1] + 1))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed at step {ckpt_steps[-1]}" in r.stdout and f"vLLM compile cache: reused {cache}" in r.stdout
    resumed = json.loads((run2 / "summary.json").read_text())
    assert resumed["engine_cache"]["reused"] is True
    parts = resumed["startup_s"]  # the start-up split (#73)
    assert set(parts) == {"imports", "inputs", "trainer", "engine", "compile", "graphs"}
    assert parts["engine"] > 0 and parts["graphs"] == 0  # the CPU engine captures no graphs
    assert [m["step"] for m in metrics(run2)] == list(range(1, logged[-1] + 2))  # redone steps replace, not repeat
    ph = json.loads((run2 / "summary.json").read_text())["phases_s"]  # this leg's phases, not the run's totals
    assert ph["loop"] <= ph["rl"] + 0.5 and metrics(run2)[-1]["timing/loop_s"] > ph["loop"]
    # and the steps redone after the crash are the ones it lost, sample for sample and update for update
    assert [same_step(m) for m in metrics(run2)[:len(before_kill)]] == [same_step(m) for m in before_kill]
    # what the model wrote (#98): two groups a step, every line whole, no step twice, and the steps redone
    # wrote what they wrote before the kill
    lines = (run2 / "samples.jsonl").read_text().splitlines()
    after = [json.loads(x) for x in lines]
    assert [(x["step"], x["group"]) for x in after] == [(s, g) for s in range(1, logged[-1] + 2) for g in range(2)]
    assert after[:len(samples_before)] == samples_before
    shown = minirl("samples", str(ws))
    assert shown.returncode == 0 and f"step {logged[-1] + 1} · group 1" in shown.stdout and "advantage" in shown.stdout
    # a seeded run repeats exactly: its first steps are the first run's (whose held-out evals and
    # parity checks, off the training path, change nothing)
    assert [same_step(m) for m in metrics(run2)[:3]] == [same_step(m) for m in metrics(run_dir)]
