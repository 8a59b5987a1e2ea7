"""The lab's runner (minirl/lab/runner.py): which run is a cell's, when a finished one is reused,
extra cold starts, and a real run cut short and continued from its checkpoint. The studies on top:
test_studies.py."""

import json
from pathlib import Path

import pytest

from minirl.config import recipes
from minirl.lab import runner as lab


def test_a_cell_is_the_run_its_own_process_started_not_the_newest(tmp_path):
    # a quick grid's run started in the same workspace while a full-grid cell ran: the newest
    # folder then belongs to the other process (this mislabelled a full-grid cell once)
    def run(name, pid, started):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "process.json").write_text(json.dumps({"pid": pid, "started": started}))

    run("20261123-100000", 41, 50.0)   # an old run by a process that had the same pid
    run("20261123-130535", 41, 100.0)  # the cell's own run
    run("20261123-130733", 97, 101.0)  # another process's, newer
    (tmp_path / "runs" / "20261123-130800").mkdir()  # a run folder without process.json yet
    assert lab.run_of_process(tmp_path, 41, since=99.0) == tmp_path / "runs" / "20261123-130535"
    assert lab.run_of_process(tmp_path, 41, since=120.0) is None
    assert lab.run_of_process(tmp_path, 5, since=0.0) is None


def test_a_cold_start_for_f6_is_built_for_the_workspaces_own_task(tmp_path, monkeypatch):
    # the long miniature's F6 compares long cold starts; a short scratchpad one would compare another task
    (tmp_path / "minirl.toml").write_text(recipes.shipped("tiny-scratchpad-long").read_text())
    built = []
    monkeypatch.setattr(lab, "init_workspace", lambda root, **kw: built.append((root.name, kw["task"], kw["overrides"])))
    L = lab.Lab(tmp_path, tmp_path / "lab" / "study-coldstart" / "full")
    path = L.cold_start_model(0.1, progress=lambda what: None)
    assert built == [("acc10", "scratchpad-long", ["cold_start.target_acc=0.1"])]
    assert path == tmp_path / "lab" / "study-coldstart" / "coldstarts" / "acc10" / "model" / "coldstart"


def test_a_run_is_reused_only_while_the_workspace_recipe_reads_the_same(tmp_path):
    """A finished (cell, seed) is the cell's run while its sets, the sampling scheme and the
    workspace recipe it ran on are today's: a comment changes nothing, a learning rate does."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "minirl.toml").write_text("[train]\nlr = 3e-4\n")
    cell = lab.Cell("on-policy", "MiniRL", ("loss.is_mode=off",))
    p = lab.Plan(steps=2, eval_every=1, seeds=1, cells=[cell])
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    L = lab.Lab(ws, ws / "lab" / "x")
    L.state = {"runs": {f"{cell.id}/s0": str(run)},
               "sets": {f"{cell.id}/s0": L._recorded([*lab.common_sets(p, 0), *cell.sets])}}
    assert L.finished(cell, 0, p) == run
    # recorded before the lab checkpointed its runs to resume them (lab.resumable_sets): the same run
    legacy = [*lab.common_sets(p, 0), f"checkpoint.every={p.steps + 1}", "checkpoint.keep=1", *cell.sets]
    L.state["sets"][f"{cell.id}/s0"] = L._recorded(legacy)
    assert L.finished(cell, 0, p) == run
    (ws / "minirl.toml").write_text("# the lr study's choice, below\n[train]\nlr = 0.0003\n")
    assert L.finished(cell, 0, p) == run
    (ws / "minirl.toml").write_text("[train]\nlr = 1e-4\n")
    assert L.finished(cell, 0, p) is None


def test_a_cut_short_run_whose_checkpoint_is_refused_begins_again_next_time(tmp_path, tiny_dir):
    """The sweep that would continue a cut-short run and finds its checkpoint refused (damaged:
    `minirl run --resume RUN` exits 2) forgets it, so the sweep after begins that run again rather
    than failing on it for ever."""
    import shutil

    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    shutil.copytree(tiny_dir, ws / "model" / "coldstart")
    cell = lab.Cell("on-policy", "MiniRL", ())
    p = lab.Plan(steps=2, eval_every=1, seeds=1, cells=[cell])
    L = lab.Lab(ws, ws / "lab" / "x")
    run = ws / "runs" / "20261126-000000"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "minirl.json").write_text('{"step": 1}')  # no DCP files
    L.state["in_flight"] = {"key": f"{cell.id}/s0", "sets": L._recorded([*lab.common_sets(p, 0), *cell.sets]),
                            "pid": 1, "since": 0.0, "run": str(run)}
    with pytest.raises(RuntimeError, match="exit 2"):
        L.run_cell(cell, 0, p, progress=lambda s: None)
    assert "DCP metadata missing" in (ws / "lab" / "x" / "logs" / "on-policy-minirl-s0.log").read_text()
    assert "in_flight" not in lab.Lab(ws, ws / "lab" / "x").state


def test_a_run_that_ended_before_its_sweep_recorded_it_is_recorded_not_resumed(tmp_path):
    """A sweep cut short between its run's end (summary written) and its record: the next sweep
    records that run as it is; resuming it would start an engine only to evaluate again, and its
    summary would then time only that. An interrupted run's summary still resumes."""
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    cell = lab.Cell("on-policy", "MiniRL", ())
    p = lab.Plan(steps=2, eval_every=1, seeds=1, cells=[cell])
    (ws / "lab" / "x").mkdir(parents=True)  # a sweep holds its lock there (Lab.hold)
    L = lab.Lab(ws, ws / "lab" / "x")
    run = ws / "runs" / "20261126-000000"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "minirl.json").write_text('{"step": 2}')
    (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 2, "wall_s": 884.5}))
    sets = L._recorded([*lab.common_sets(p, 0), *cell.sets])
    L.state["in_flight"] = {"key": f"{cell.id}/s0", "sets": sets, "pid": 1, "since": 0.0, "run": str(run)}
    said = []
    assert L.run_cell(cell, 0, p, progress=said.append) == run
    assert said == [f"{cell.id}/s0: run {run.name} had ended; recorded"]
    again = lab.Lab(ws, ws / "lab" / "x")
    assert again.finished(cell, 0, p) == run and "in_flight" not in again.state
    assert not (ws / "lab" / "x" / "logs").exists()  # no `minirl run` started
    assert json.loads((run / "summary.json").read_text())["wall_s"] == 884.5
    (run / "summary.json").write_text(json.dumps({"status": "interrupted", "steps": 1}))
    assert not lab._ended(run)


def test_a_run_cut_short_continues_from_its_checkpoint_and_is_then_reused(tmp_path, monkeypatch):
    """A cell's run killed as its step 2 begins (a session's end): the next run_cell continues it
    with `minirl run --resume RUN` in its own folder, its step-1 row kept; once finished it is
    reused, unless recorded under another sampling scheme. `minirl` itself is played here by a
    stand-in that writes what a run writes (a real kill and `--resume`: test_faults, test_e2e)."""
    import subprocess

    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws", train=8, heldout=4)
    cell = lab.Cell("on-policy", "MiniRL w/o IS", lab.NO_IS)
    p = lab.Plan(steps=2, eval_every=1, seeds=1, cells=[cell])
    calls = []

    def fake_minirl(self, args, log, *, on_start=lambda pid: None, append=False):
        calls.append(args)
        child = subprocess.Popen(["true"])
        on_start(child.pid)
        child.wait()
        run = Path(args[args.index("--resume") + 1]) if "--resume" in args else ws / "runs" / f"run{len(calls)}"
        (run / "checkpoints" / "step_000001").mkdir(parents=True, exist_ok=True)
        (run / "checkpoints" / "step_000001" / "minirl.json").write_text('{"step": 1}')
        (run / "process.json").write_text(json.dumps({"pid": child.pid, "started": 1e12}))
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 2 if "--resume" in args else 1}) + "\n")
        if "--resume" in args:
            (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 2}))
        else:
            child.returncode = -9  # SIGKILLed as step 2 began
        return child

    monkeypatch.setattr(lab.Lab, "minirl", fake_minirl)
    (ws / "lab" / "micro").mkdir(parents=True)  # a study holds its lock there (Lab.hold)
    L = lab.Lab(ws, ws / "lab" / "micro")
    with pytest.raises(RuntimeError, match="exit -9"):
        L.run_cell(cell, 0, p, progress=lambda s: None)
    (killed,) = (ws / "runs").iterdir()
    said = []
    L2 = lab.Lab(ws, ws / "lab" / "micro")
    assert L2.run_cell(cell, 0, p, progress=said.append) == killed
    assert said == [f"{cell.id}/s0: continuing run {killed.name} from its newest checkpoint"]
    assert calls[1][-2:] == ["--resume", str(killed)] and calls[1][:-2] == calls[0]  # the same cell, continued
    assert "loss.is_mode=off" in calls[0] and "checkpoint.keep=1" in calls[0]
    assert len(list((ws / "runs").iterdir())) == 1 and "in_flight" not in L2.state
    assert [r["step"] for r in lab.rows_of(killed)] == [1, 2]
    assert lab.Lab(ws, ws / "lab" / "micro").finished(cell, 0, p) == killed  # reused, not run again
    key = f"{cell.id}/s0"
    L2.state["sets"][key] = [x for x in L2.state["sets"][key] if not x.startswith("#sampling=")] + ["#sampling=1"]
    assert L2.finished(cell, 0, p) is None  # recorded under another sampling scheme: runs again

def test_a_recipe_field_added_at_its_default_keeps_recorded_runs_their_cells(tmp_path):
    """[train.lora], train.warmup_steps, train.offload, rollout.cuda_graphs, the guard's slide rule
    and loss.clip_against came after runs were recorded: at their defaults a recorded run stays its
    cell's; any of them changed, the cell runs again."""
    import hashlib

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "minirl.toml").write_text("[train]\nlr = 3e-4\n")
    L = lab.Lab(ws, ws / "lab" / "x")
    before = recipes.load(ws / "minirl.toml").to_dict()
    for section, key in (("train", "lora"), ("train", "warmup_steps"), ("train", "offload"), ("rollout", "cuda_graphs"),
                         ("rollout", "inflight_updates"), ("parallel", "rollout_gpus"),
                         ("guard", "slide_window"), ("guard", "slide_z"), ("guard", "slide_drop_frac"),
                         ("loss", "clip_against")):  # the recipe as it read before the fields existed
        del before[section][key]
    before["rollout"]["overlap"] = before["rollout"].pop("max_staleness") == 1  # #66 renamed it
    digest = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert f"#recipe={digest}" in L._recorded([])
    (ws / "minirl.toml").write_text("[train]\nlr = 3e-4\n\n[rollout]\nmax_staleness = 1\n")
    overlapped = hashlib.sha256(json.dumps({**before, "rollout": {**before["rollout"], "overlap": True}},
                                           sort_keys=True).encode()).hexdigest()[:16]
    # k = 1 was what overlap = true recorded, but its stale tokens are clipped against their sampler
    # now (loss.clip_against, #74): the loss those runs computed changed, and they run again
    assert f"#recipe={overlapped}" not in L._recorded([])
    (ws / "minirl.toml").write_text('[train]\nlr = 3e-4\n\n[rollout]\nmax_staleness = 1\n\n[loss]\nclip_against = "proximal"\n')
    assert f"#recipe={overlapped}" in L._recorded([])  # the loss those runs computed
    (ws / "minirl.toml").write_text("[train]\nlr = 3e-4\n\n[rollout]\nmax_staleness = 2\n")
    assert not {f"#recipe={digest}", f"#recipe={overlapped}"} & set(L._recorded([]))
    (ws / "minirl.toml").write_text("[train]\nlr = 3e-4\n\n[train.lora]\nrank = 8\n")
    assert f"#recipe={digest}" not in L._recorded([])
    (ws / "minirl.toml").write_text("[train]\nlr = 3e-4\nwarmup_steps = 10\n")
    assert f"#recipe={digest}" not in L._recorded([])
    (ws / "minirl.toml").write_text('[train]\nlr = 3e-4\noffload = "optimizer"\n')
    assert f"#recipe={digest}" not in L._recorded([])
    (ws / "minirl.toml").write_text('[train]\nlr = 3e-4\n\n[guard]\nslide_z = 3.0\n')
    assert f"#recipe={digest}" not in L._recorded([])
