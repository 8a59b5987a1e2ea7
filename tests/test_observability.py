"""Observability (slow, one real run): TensorBoard event files and an offline W&B run hold every
scalar of metrics.jsonl at its step, the guard's rollbacks show as events, in `minirl status` and
on the PNG, and `minirl status` tells a run in progress from a finished one. The run is made in
a network namespace of its own with only loopback up, so W&B offline cannot reach anything."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_faults import wait_for_rows  # noqa: E402


def minirl(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "200"})


def wandb_history(run_file: Path) -> dict[int, dict]:
    """History rows of an offline W&B run, read from its .wandb file: LevelDB's log format (32 KiB
    blocks of chunks with a 7-byte header) after W&B's 7-byte file header, each record a protobuf
    `wandb_internal.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf, out = run_file.read_bytes(), 7, 32768, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        buf, pos = buf + data[pos:pos + length], pos + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                out[int(row["_step"])] = row
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.slow
def test_tensorboard_wandb_status_and_plot_of_a_run_with_rollbacks(tiny_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from minirl.disk.store import parse_metric_line
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    r = minirl("status", str(ws))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"minirl: error: no runs in {ws}: start one with `minirl run {ws}`"]

    run = [sys.executable, "-m", "cli.main", "run", str(ws), "--model", str(tiny_dir), "--steps", "8",
           "--set", "train.prompts_per_step=8", "--set", "eval.k=1", "--set", "rollout.max_tokens=4",
           "--set", "metrics.tensorboard=true", "--set", "metrics.wandb=true", "--set", "metrics.wandb_tags=test,tiny",
           # a forced guard trip: every step's KL is "too high"; rollbacks at steps 2 and 4, and
           # at step 6, its rollbacks used up, the guard ends the run on the last good weights
           "--set", "guard.max_kl=-1", "--set", "guard.patience=2", "--set", "guard.max_rollbacks=2"]
    netns = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]  # exec: the run keeps this pid
    proc = subprocess.Popen(netns + run, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    runs = ws / "runs"
    wait_for_rows(lambda: next(runs.iterdir(), None) if runs.exists() else None, 1, proc)
    proc.send_signal(signal.SIGSTOP)  # holds the run mid-way, so "running" does not depend on timing
    try:
        run_dir = next(runs.iterdir())
        n = len((run_dir / "metrics.jsonl").read_text().splitlines())
        r = minirl("status", str(ws))
        assert r.returncode == 0, r.stderr
        assert f"{run_dir.name}  running  step {n}/8" in r.stdout, r.stdout
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, err[-3000:]  # collapsed
    rows = [parse_metric_line(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["guard/action"]) for m in rows] == [
        (1, "step"), (2, "rollback"), (3, "step"), (4, "rollback"), (5, "step"), (6, "stop")]
    assert [m["train/lr"] for m in rows] == pytest.approx([3e-4, 3e-4, 1.5e-4, 1.5e-4, 7.5e-5, 7.5e-5])  # halved
    # parity (every 10th sync by default) also checks the run's first sync and every rollback's
    assert ["sync/parity_abs_dlogp" in m for m in rows] == [True, True, False, True, False, True]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "collapsed" and summary["guard"]["rollbacks"] == 2
    assert [Path(p).name for p in summary["guard"]["rolled_back_to"]] == ["step_000000"] * 3
    # no update of the bad steps survived: the run ends on the weights it started from
    from minirl.models.shapes import TINY
    from minirl.train.hf_io import hf_to_titan, load_hf_weights
    from minirl.train.trainer import Trainer

    final = Trainer(TINY, lr=1e-3)
    final.load(Path(summary["checkpoint"]))
    start = hf_to_titan(TINY, load_hf_weights(tiny_dir))
    assert all(torch.equal(v, start[k]) for k, v in final.model.state_dict().items() if k in start)
    r = minirl("status", str(ws))
    assert r.returncode == 0, r.stderr
    assert f"{run_dir.name}  collapsed  step 6/8" in r.stdout
    assert "rollback at step 2: " in r.stdout and "rollback at step 4: " in r.stdout and "back to step 0" in r.stdout
    assert "2 rollbacks used, back to step 0" in r.stdout and "held-out avg@1: " in r.stdout

    # TensorBoard: every number of every row, at its step; the rollbacks as text events
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    expected = {k for m in rows for k, v in m.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert set(ea.Tags()["scalars"]) == expected
    for key in expected:
        got = {e.step: e.value for e in ea.Scalars(key)}
        want = {m["step"]: float(m[key]) for m in rows if key in m}
        assert got.keys() == want.keys(), key
        assert all(same(got[s], want[s]) for s in want), key  # float32 in the event file
    texts = [tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in ea.Tensors("guard/events/text_summary")]
    assert [t.split(" (")[0] for t in texts] == ["step 2: rollback", "step 4: rollback", "step 6: stop"]
    # what the model wrote (#98): each step's samples as text, every response of the step's groups in it
    from minirl.data.written import records
    from minirl.run.samples import flat

    recs = list(records(run_dir / "samples.jsonl"))
    assert sorted({x["step"] for x in recs}) == [1, 2, 3, 4, 5, 6]
    shown = {e.step: tensor_util.make_ndarray(e.tensor_proto).item().decode()
             for e in ea.Tensors("samples/text_summary")}
    assert sorted(shown) == [1, 2, 3, 4, 5, 6]
    for x in flat(recs):
        assert f"**group {x['group']}, response {x['response']}**" in shown[x["step"]] and x["text"] in shown[x["step"]]

    # W&B offline: the same numbers at the same steps, in the run folder, nothing sent anywhere
    [wandb_file] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    history = wandb_history(wandb_file)
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    for m in rows:
        for key in expected & m.keys():
            assert same(float(history[m["step"]][key]), float(m[key])), (m["step"], key)
    assert history[4]["guard/events/nrows"] == 2 and history[4]["guard/events/_type"] == "table-file"  # a row per event
    assert history[6]["guard/events/nrows"] == 3
    for step in range(1, 7):  # the samples as a table, a row a response
        assert history[step]["samples/_type"] == "table-file"
        assert history[step]["samples/nrows"] == len([x for x in flat(recs) if x["step"] == step]) > 0

    # the PNG marks the rollbacks (tab:red dashed lines on every panel); the curves are tab:blue
    import matplotlib.image as mpimg
    import numpy as np

    png = mpimg.imread(run_dir / "metrics.png")[..., :3]
    red = np.abs(png - np.array([214, 39, 40]) / 255).max(-1) < 0.08
    assert red.sum() > 200, red.sum()
