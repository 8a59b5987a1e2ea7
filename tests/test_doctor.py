"""`minirl doctor` on a workspace of the tiny model: every source of the training–inference gap
measured, ordered as precision predicts, written as JSON and PNG, with advice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def minirl(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_doctor_measures_each_source(tiny_dir, tmp_path):
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    r = minirl("doctor", "-w", str(ws), "--seeds", "2", "--checkpoint", str(tiny_dir),
               "--set", f"model.id={tiny_dir}", "--set", "model.path=", "--set", "rollout.max_staleness=2",
               "--set", "reward.grader=numeric", "--set", 'reward.params={"tol": 500}')
    assert r.returncode == 0, r.stderr[-3000:]
    reports = list((ws / "doctor").glob("doctor-*.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".png").is_file()
    rep = json.loads(reports[0].read_text())
    f = {k: v["mean"] for k, v in rep["figures"].items() if isinstance(v, dict)}
    # fp32 vLLM and the fp32 trainer agree to rounding; bf16 compute adds a gap, FP8 (W8A8) more,
    # and beyond the paper e5m2, then NVFP4, most
    assert f["kl/fp32"] < 1e-8 < f["kl/bf16"] < f["kl/fp8"] < f["kl/e5m2"] < f["kl/nvfp4"]
    # per response: the measured spread of log π(y)/μ(y), and its prediction from L and the KL
    for level in ("bf16", "fp8-weights", "fp8", "e5m2", "nvfp4"):
        assert f[f"length/{level}"] > 0 and f[f"response_sd/{level}"] > 0 and f[f"response_sd_predicted/{level}"] > 0
    assert f["response_sd/fp32"] < 1e-3 < f["response_sd/fp8"]
    assert all(rep["per_seed"][s]["kl/fp32"] < rep["per_seed"][s]["kl/bf16"] for s in range(2))
    assert len(rep["figures"]["routing/disagree_per_layer"]) == 4 and 0 <= f["routing/disagree"] < 0.5
    # a token whose routes differ anywhere: at least the per-layer rate, and none at fp32 precision
    assert f["routing/tokens_with_a_flip/fp32"] <= f["routing/tokens_with_a_flip/e5m2"]
    # (the run's own precision is one of the levels, on the same batch: any layer ≥ the layers' mean)
    assert max(f[f"routing/tokens_with_a_flip/{lvl}"] for lvl in ("bf16", "fp8", "e5m2")) >= f["routing/disagree"]
    assert "in any layer" in r.stdout
    for mode in ("off", "r2", "r3"):  # updates move the policy away from π_θold (a random policy's
        # first mini-batches may all have zero advantage, and no gradient)
        assert 0 <= f[f"staleness/{mode}/1"] <= f[f"staleness/{mode}/8"]
        assert f[f"staleness/{mode}/8"] > 0
    assert len(rep["advice"]) == 6 and all("e-" in line or "%" in line or "spreads by" in line for line in rep["advice"])
    assert "advice:" in r.stdout and "staleness" in r.stdout
    # sampling 2 ahead with no run of it yet: the controller's steady state, every token 2 steps behind,
    # so the KL after 2 × N = 2 updates of the recipe's replay (off)
    assert rep["staleness_mix"] == {"2": 1.0} and "steady state" in rep["staleness_source"]
    assert f["staleness/behind"] == pytest.approx(f["staleness/off/2"])
    assert "sampling ahead (rollout.max_staleness = 2): trained tokens 0% / 0% / 100% steps behind" in rep["advice"][-1]


def test_doctor_refuses_zero_seeds(tmp_path):
    r = minirl("doctor", "-w", str(tmp_path), "--seeds", "0")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["minirl: error: --seeds 0: at least 1"]


def test_the_staleness_mix_is_read_from_the_newest_run_that_sampled_ahead_at_k(tmp_path):
    """The doctor's staleness line weighs its KL by the run's own distribution of how far behind the
    trained tokens were: the token histograms of the newest run at this k, summed over its steps."""
    from minirl.lab.doctor import staleness_mix
    from minirl.setup.workspace import Workspace
    from tests.conftest import data_workspace

    ws = Workspace.open(data_workspace(tmp_path / "ws", train=8, heldout=2))
    assert staleness_mix(ws, 2)[0] == {2: 1.0}  # no run: the controller's steady state

    def run(name, rows):
        (ws.runs / name).mkdir(parents=True)
        (ws.runs / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run("20261128-010000", [{"step": 1, "rollout/staleness_tokens": [30, 0, 0]},
                            {"step": 2, "rollout/staleness_tokens": [0, 10, 0]},
                            {"step": 3, "rollout/staleness_tokens": [0, 0, 60]}])
    run("20261128-020000", [{"step": 1, "rollout/staleness_tokens": [5, 5]}])  # newer, but k = 1
    run("20261128-030000", [{"step": 1, "rollout/reward_mean": 0.5}])  # newest, synchronous
    mix, source = staleness_mix(ws, 2)
    assert mix == {0: 0.3, 1: 0.1, 2: 0.6} and "20261128-010000" in source and "3 steps, 100 tokens" in source
    assert staleness_mix(ws, 1)[0] == {0: 0.5, 1: 0.5}


@pytest.mark.slow
def test_the_doctor_samples_with_the_recipes_cut_and_measures_what_renormalizing_removes(tiny_dir, tmp_path):
    """#97: under a top-p cut every level samples as the run would and the trainer's π is renormalized
    over each kept set, so fp32 stays at rounding; π over the whole vocabulary is the truncation's share
    (the random tiny model spreads its mass: a 0.8 cut leaves a large one)."""
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    r = minirl("doctor", "-w", str(ws), "--seeds", "1", "--checkpoint", str(tiny_dir),
               "--set", f"model.id={tiny_dir}", "--set", "model.path=", "--set", "rollout.top_p=0.8",
               "--set", "reward.grader=numeric", "--set", 'reward.params={"tol": 500}')
    assert r.returncode == 0, r.stderr[-3000:]
    [report] = list((ws / "doctor").glob("doctor-*.json"))
    rep = json.loads(report.read_text())
    f = {k: v["mean"] for k, v in rep["figures"].items() if isinstance(v, dict)}
    assert rep["cuts"] == {"top_p": 0.8, "top_k": 0, "min_p": 0.0}
    print(f"\nKL(μ‖π) at top-p 0.8: fp32 {f['kl/fp32']:.2e}, bf16 {f['kl/bf16']:.2e}, "
          f"bf16 with π over the whole vocabulary {f['kl/uncut_pi']:.2e}")
    assert f["kl/fp32"] < 1e-6 and f["kl/uncut_pi"] > 5 * f["kl/bf16"]
    assert "top-p 0.8" in r.stdout and "π over the whole vocabulary" in r.stdout
    assert any(line.startswith("the sampler's cut (top-p 0.8, top-k 0, min-p 0)") and "renormalizes" in line
               for line in rep["advice"])
