"""The GPU check's one command (tests/gpu/run-on-device.sh) run end to end in its dry mode: the
same steps (tests/gpu, the bench, the report) on this CPU with the tiny model, so the script and
the kit cannot rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_command_runs_end_to_end_in_dry_mode(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--dry"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHON": sys.executable, "MINIRL_GPU_OUT": str(out)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    outcomes = {o["test"].split("::", 1)[1]: o["outcome"] for o in report["tests"]}
    assert "failed" not in report["counts"] and report["counts"]["passed"] >= 6, report["counts"]
    for name in ("test_bf16_trainer_matches_the_fp32_cpu_trainer[tiny-fsdp2]",
                 "test_replay_is_exact_and_takes_routes_in_vllms_layout[tiny]",
                 "test_fp8_sync_weights_stay_on_the_device_with_the_cpu_bits[tiny]",
                 "test_a_cuda_checkpoint_round_trips_and_exports_for_transformers[fsdp2]"):
        assert outcomes[name] == "passed", outcomes
    skipped = [o for o in report["tests"] if o["outcome"] == "skipped"]
    assert skipped and all(o["reason"] for o in skipped)  # each skip says why
    rows = report["bench"]["results"]
    assert {(b["path"], b["mode"]) for b in rows} == {(p, m) for p in ("one-gpu", "fsdp2")
                                                      for m in ("on-policy", "pi_old+upd", "r2")}
    assert all(b["tokens_per_s"] > 0 for b in rows) and report["bench"]["top_kernels"]["r2"]
    md = (out / "report.md").read_text()
    assert "| `test_bf16_trainer_matches_the_fp32_cpu_trainer[tiny-one-gpu]` | passed |" in md and "## Bench" in md


def test_without_its_wheels_the_device_command_says_what_to_run(tmp_path):
    """Outside dry mode without the wheels (prepare.sh not run): one line naming it, exit 2."""
    (tmp_path / "kit").mkdir()
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": sys.executable, "MINIRL_GPU_OUT": str(tmp_path / "o"),
                            "MINIRL_GPU_KIT": str(tmp_path / "kit")})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "tests/gpu/prepare.sh" in r.stderr
