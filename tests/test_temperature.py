"""#79: the sampling temperature through the CLI, on the embedded default. The engine samples from
softmax(z / T) and every per-token quantity of the policy the loss and the guard read is taken at
the same T (tests/test_rollout.py holds log μ to the trainer's log-softmax of logits / T token by
token). Before, both sides read the T = 1 policy whatever T sampled: at T = 0.05 the rows showed
the T = 1 entropy, and a KL that looked perfect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_rows_are_the_sampling_temperatures_policy(embedded_default):
    ws = embedded_default
    got = {}
    for T in (0.05, 1.0):
        r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), "--steps", "2", "--set",
                            "rollout.precision=fp32", "--set", f"rollout.temperature={T}", "--set", "eval.max_problems=16",
                            "--set", "eval.k=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        run = max((ws / "runs").iterdir())
        got[T] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((run / "summary.json").read_text())["heldout"]["start"]["temperature"] == 1.0  # eval's own T
    assert all(m["train/entropy"] < 0.1 and abs(m["train/kl_mu_pi_old"]) < 1e-3 for m in got[0.05]), got[0.05]
    assert all(m["train/entropy"] > 0.2 for m in got[1.0]), got[1.0]
