"""A run folder damaged by hand or by a torn write (#75): readers say which file is damaged and go on
without it; a resume keeps the good rows alone; an export leaves nothing half-written."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minirl.disk import store

ROOT = Path(__file__).resolve().parents[1]


def minirl(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "250", "HF_HUB_OFFLINE": "1"})


def _run(tiny_dir, tmp_path, *, summary: dict, steps=(1, 2, 3)) -> Path:
    """A workspace with one run: a checkpoint at step 3, its rows, and `summary`."""
    import shutil

    from minirl.config import recipes
    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    shutil.copytree(tiny_dir, ws / "model/coldstart")
    rec = recipes.load(ws / "minirl.toml", ["train.steps=3"])
    run = ws / "runs" / "20261128-010203"
    tr = Trainer(TINY, lr=1e-3)
    tr.load_hf(ws / "model/coldstart")
    tr.save(run / "checkpoints" / "step_000003", {"step": 3, "sampler": {"epoch": 0, "pos": 96}, "recipe": rec.to_dict(),
                                                  "heldout_start": {"avg@4": 0.1}})
    (run / "recipe.toml").write_text(rec.to_toml())
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward_mean": 0.1 * s}) + "\n"
                                               for s in steps))
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_a_summary_with_wrong_types_is_named_and_read_without(tiny_dir, tmp_path):
    run = _run(tiny_dir, tmp_path, summary={"status": "finished", "written_at": "yesterday", "steps": 3,
                                            "checkpoint": "x", "heldout": {"metric": "avg@4", "start": "?"}})
    ws = run.parent.parent
    r = minirl("status", str(ws))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"damaged, read without it: {run / 'summary.json'}: written_at is 'yesterday', not a int or float" in r.stdout
    out = tmp_path / "export"
    r = minirl("export", str(ws), str(out))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (out / "config.json").exists() and not list(tmp_path.glob("*.tmp"))
    from minirl.disk import store

    assert store.read_summary(run) == {}
    (run / "summary.json").write_text(json.dumps({"status": "finished", "heldout": {"start": "?"}}))
    assert store.summary_problem(run).endswith("heldout.start is '?', not a dict")


def test_a_row_out_of_order_is_left_out_by_status_and_by_a_resume(tiny_dir, tmp_path):
    from minirl.disk import store

    run = _run(tiny_dir, tmp_path, summary={"status": "finished", "written_at": time.time(), "steps": 3},
               steps=(1, 2, 3, 1))
    r = minirl("status", str(run.parent.parent))
    assert r.returncode == 0 and "finished  step 3/3" in r.stdout, r.stdout
    assert [m["step"] for m in store.metric_rows(run / "metrics.jsonl")] == [1, 2, 3]
    store.truncate_metrics(run / "metrics.jsonl", 3)  # what a resume from step 3 does first
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 2, 3)))
    store.truncate_metrics(run / "metrics.jsonl", 3)  # a step twice: the second goes, one row a step stays
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_an_eval_of_a_live_runs_checkpoint_pins_what_it_reads_and_writes_nothing_there(tiny_dir, tmp_path):
    """#82: `eval --checkpoint latest` during a run wrote `hf/` into the run's newest checkpoint while
    the run pruned old ones (a traceback in 2 of 4 tries). A run without a summary may be live: its
    checkpoint is hard-linked aside before it is read (the run may delete it meanwhile), the HF copy
    goes to the workspace's cache, and the run's folder is left as it was; an ended run's checkpoint
    keeps its HF copy beside it, as before."""
    from minirl.config import recipes
    from minirl.eval.checkpoints import resolve_checkpoint
    from minirl.setup.workspace import Workspace
    from minirl.train.hf_io import load_hf_weights

    run = _run(tiny_dir, tmp_path, summary={})
    (run / "summary.json").unlink()  # running, or killed: no summary yet
    ws = Workspace.open(run.parent.parent)
    rec = recipes.load(ws.root / "minirl.toml")
    ckpt = run / "checkpoints" / "step_000003"
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    folder = resolve_checkpoint(ws, rec, "latest")
    assert folder == ws.root / ".cache" / "eval-hf" / "20261128-010203-step_000003"
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written into the run
    assert not (ws.root / ".cache" / "pins").exists() or not any((ws.root / ".cache" / "pins").iterdir())
    assert load_hf_weights(folder).keys() and resolve_checkpoint(ws, rec, str(ckpt)) == folder  # made once
    (run / "summary.json").write_text(json.dumps({"status": "finished"}))
    assert resolve_checkpoint(ws, rec, str(ckpt)) == ckpt / "hf"  # an ended run: beside it, as before


def test_a_summary_with_a_non_finite_figure_is_strict_json_and_reads_back_as_it_was(tmp_path):
    """#82: Python's json wrote a poisoned figure as a bare NaN, which no other JSON reader takes. The
    summary is strict JSON (null, and `nonfinite` says where and what); minirl reads it back as it was."""
    summary = {"status": "stopped", "steps": 3, "wall_s": float("inf"),
               "heldout": {"metric": "avg@4", "start": {"avg@4": 0.5}, "end": {"avg@4": float("nan")},
                           "gain_points": float("nan")},
               "last_metrics": {"train/loss": float("-inf"), "h": [1.0, float("nan")]}}
    path = store.write_summary(tmp_path, summary)
    strict = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"a bare {c} in summary.json"))
    assert strict["heldout"]["end"]["avg@4"] is None and strict["wall_s"] is None
    assert strict["nonfinite"] == {"wall_s": "inf", "heldout.end.avg@4": "nan", "heldout.gain_points": "nan",
                                   "last_metrics.train/loss": "-inf", "last_metrics.h[1]": "nan"}
    assert store.summary_problem(tmp_path) is None
    got = store.read_summary(tmp_path)
    assert got["wall_s"] == float("inf") and math.isnan(got["heldout"]["end"]["avg@4"])
    assert got["last_metrics"]["train/loss"] == float("-inf") and math.isnan(got["last_metrics"]["h"][1])
    assert "nonfinite" not in got and got["steps"] == 3
