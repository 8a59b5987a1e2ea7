"""#98: the record of every trained token and its checker (minirl/run/token_record.py, `minirl check`).
Real runs' records checked: tests/test_e2e.py (k = 0), tests/test_async.py (k = 2 in flight, R3, a kill and
a resume), tests/test_episodes.py (the tools task's episodes)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minirl.rollout.engine import Completion
from minirl.run import token_record as tr
from minirl.train.batch import batch_of

ROOT = Path(__file__).resolve().parents[1]
LN = math.log


def records(step: int = 5, k: int = 2) -> list[dict]:
    """Two samples of one step as the recorder writes them: a plain one sampled a step behind, and an
    episode whose environment put tokens 2 and 3 (masked out), cut by top-k 3 where sampled."""
    comps = [Completion((7, 8, 9), (LN(0.5), LN(0.25), LN(0.9)), "stop", versions=(3, 4, 4)),
             Completion((5, 6, 1, 2, 3), (LN(0.5), LN(0.5), 0.0, 0.0, LN(0.7)), "stop", versions=(4, 4, 4, 4, 4),
                        mask=(1, 1, 0, 0, 1), kept=(3, 3, 0, 0, 3))]
    b = batch_of([[1, 2], [3]], comps, [1.0, -1.0], pad_id=0, trained=step - 1,
                 masks=[None, comps[1].mask])
    old = b.rollout_logp_BT + 1e-4 * b.mask_BT  # π_old a hair from μ: a precision's gap
    return tr.sample_lines(step, b.with_old_logp(old), comps, k=k, update="step")


def test_a_recorded_step_holds_what_the_trainer_took_beside_what_the_engine_returned():
    a, b = records()
    assert (a["sampled"], a["trained"], a["loss"], a["env"]) == ([7, 8, 9], [7, 8, 9], [1, 1, 1], None)
    assert a["logmu"] == pytest.approx([LN(0.5), LN(0.25), LN(0.9)]) and a["version"] == [3, 4, 4]
    assert a["logpi_old"] == pytest.approx([LN(0.5) + 1e-4, LN(0.25) + 1e-4, LN(0.9) + 1e-4], abs=1e-6)
    assert (b["trained"], b["env"], b["loss"]) == ([5, 6, 1, 2, 3], [1, 1, 0, 0, 1], [1, 1, 0, 0, 1])
    assert b["kept"] == [3, 3, 0, 0, 3] and a["kept"] == [0, 0, 0]
    assert (a["trained_version"], a["k"], a["routed"]) == (4, 2, None)
    json.dumps([a, b])
    found = tr.check([a, b], bound=1e-6, k3=True)
    assert all(not c.failures for c in found.values()) and found["routes"].looked == 0
    assert found["ids"].looked == 2 and found["mismatch"].looked == 1


def planted(kind: str) -> list[dict]:
    recs = copy.deepcopy(records())
    x = recs[1]
    if kind == "ids":
        x["trained"][4] = 9  # the trainer took another token than the engine sampled
    elif kind == "env":
        x["loss"][2] = 1  # an environment's token trained as the model's
    elif kind == "versions":
        recs[0]["version"][0] = 1  # 3 updates behind at k = 2
    elif kind == "finite":
        x["logmu"][4] = float("nan")
    elif kind == "mismatch":  # π_old over the whole vocabulary under a cut: the kept mass as a factor
        for y in recs:
            y["logpi_old"] = [v + LN(0.8) for v in y["logpi_old"]]
    elif kind == "routes":
        x["routed"] = [4, 6]
    return recs


@pytest.mark.parametrize("kind", list(tr.CHECKS))
def test_a_planted_fault_of_each_kind_fails_its_check_alone_naming_step_and_sample(kind):
    found = tr.check(planted(kind), bound=1e-6, k3=True)
    failing = {name for name, c in found.items() if c.failures}
    assert failing == {kind}
    step, sample, _ = found[kind].failures[0]
    assert step == 5 and sample == (None if kind == "mismatch" else 0 if kind == "versions" else 1)


def test_the_median_of_the_steps_decides_the_mismatch_not_one_steps_tail():
    """A route flip's step (a few tokens far off) among quiet steps passes; every step off fails."""
    quiet = [records(step=s) for s in range(1, 6)]
    loud = copy.deepcopy(quiet[2])
    loud[0]["logpi_old"][1] += 3.0
    steps = [x for r in quiet[:2] + [loud] + quiet[3:] for x in r]
    assert not tr.check(steps, bound=1e-3, k3=True)["mismatch"].failures
    off = [{**x, "logpi_old": [v + LN(0.8) for v in x["logpi_old"]]} for r in quiet for x in r]
    assert tr.check(off, bound=1e-3, k3=True)["mismatch"].failures


def minirl(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "250"})


def test_minirl_check_says_what_holds_and_names_what_does_not(tmp_path):
    ws = tmp_path / "ws"
    run = ws / "runs" / "20261205-000000"
    run.mkdir(parents=True)
    (ws / "minirl.toml").write_text("")
    (run / "recipe.toml").write_text('[rollout]\nprecision = "fp32"\n[guard]\nmax_kl = 0.05\n')
    r = minirl("check", str(ws))
    assert r.returncode == 2 and "no token record in" in r.stderr and "metrics.record_tokens" in r.stderr
    (run / tr.FILE).write_text("".join(json.dumps(x) + "\n" for x in records()))
    r = minirl("check", str(ws))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 samples of 1 steps" in r.stdout and "no: " not in r.stdout and "the guard's max_kl 0.05 (k1)" in r.stdout
    (ws / "doctor").mkdir()
    (ws / "doctor" / "doctor-20261205-000000.json").write_text(json.dumps({"figures": {"kl/fp32": {"mean": 1e-12}}}))
    (run / tr.FILE).write_text("".join(json.dumps(x) + "\n" for x in planted("env") + planted("mismatch")[:1])
                               + '{"step": 6, "sam')  # and a line a kill tore: no record
    r = minirl("check", str(ws))
    assert r.returncode == 1
    assert "step 5 sample 1: token 2: env 0, loss 1" in r.stdout and "median KL" in r.stdout
    assert "10 × the doctor's KL at fp32" in r.stdout


def test_a_resume_drops_the_record_past_its_checkpoint(tmp_path):
    p = tmp_path / tr.FILE
    p.write_text("".join(json.dumps(x) + "\n" for s in (1, 2, 3) for x in records(step=s)) + '{"step": 4')
    tr.truncate(p, 2)
    assert [x["step"] for x in tr.lines(p)] == [1, 1, 2, 2]
    assert tr.due(3, 3, 0) and not tr.due(4, 3, 0) and tr.due(10, 3, 5) and not tr.due(11, 3, 5)
    assert not tr.due(1, 0, 0)
