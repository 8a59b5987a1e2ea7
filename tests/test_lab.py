"""`minirl lab`: the grid's recipes, the offline collapse rule, the findings rules, and one real
micro sweep (two cells of two steps) that resumes without redoing a finished cell."""

import json
from pathlib import Path

import pytest

from minirl import lab, recipe


def test_every_cell_of_both_grids_is_a_valid_recipe():
    for quick in (True, False):
        p = lab.plan(quick=quick)
        ids = [c.id for c in p.cells]
        assert len(set(ids)) == len(ids)
        for c in p.cells:
            rec = recipe.load(recipe.shipped("tiny-scratchpad"), [*lab.common_sets(p, 0), *c.sets])
            assert rec.rollout.precision == "fp8" and not rec.guard.enabled  # the stress test, collapses run on
            if c.regime.startswith("off-policy"):
                n = rec.train.minibatches
                assert n > 1 and rec.train.prompts_per_step == p.mb_prompts * n
    full = lab.plan(quick=False)
    assert full.offpolicy_n == (2, 4, 8) and len(full.cells) == 5 + 3 * 4 + 2


def rows(entropy, kl=1e-4, reward=0.5):
    return [{"step": i + 1, "train/entropy": e, "train/kl_mu_pi_old": kl, "rollout/reward_mean": r}
            for i, (e, r) in enumerate(zip(entropy, reward if isinstance(reward, list) else [reward] * len(entropy)))]


def test_collapse_is_the_guards_own_rule_applied_offline():
    g = {"max_kl": 0.05, "min_entropy_frac": 0.05, "reward_drop": 0.2, "patience": 3}
    assert lab.collapse(rows([0.3] * 10), g) is None
    # entropy below 5% of its start with reward 0.2 below its best, for 3 steps: acts on the 3rd
    ent = [0.3, 0.3, 0.01, 0.01, 0.01, 0.01]
    assert lab.collapse(rows(ent, reward=[0.6, 0.6, 0.3, 0.3, 0.3, 0.3]), g) == (
        5, "entropy 0.01 < 0.05 × 0.3 with reward 0.3 down from 0.6")
    assert lab.collapse(rows(ent, reward=[0.6] * 6), g) is None  # low entropy alone is sharpening
    assert lab.collapse(rows([0.3] * 6, kl=0.1), g)[0] == 3
    # entropy rising past 1.25 × its start (a key the recorded recipe predates: the default) with
    # the reward below half its best: the off-policy collapse of `minirl lab`
    ent = [0.12, 0.12, 0.14, 0.16, 0.17, 0.18]
    assert lab.collapse(rows(ent, reward=[0.23, 0.14, 0.02, 0.02, 0.02, 0.0]), g)[0] == 6


def test_a_run_whose_held_out_score_falls_apart_counts_as_collapsed(tmp_path):
    """Off-policy runs here fell to reward 0 with entropy rising, which the guard's criteria miss."""
    guard = {"max_kl": 0.05, "min_entropy_frac": 0.05, "reward_drop": 0.2, "patience": 3}
    runs = []
    for name, end in (("ok", 0.30), ("fell", 0.05)):
        run = tmp_path / name
        run.mkdir()
        ent = [0.1 + 0.01 * i for i in range(6)]  # rising: no guard trip
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({**r, "loss/clip_frac": 0.0, "loss/is_weight_max": 1.2, "heldout/avg@4": 0.2}) + "\n"
            for r in rows(ent)))
        (run / "summary.json").write_text(json.dumps({"recipe": {"guard": guard}, "heldout": {
            "metric": "avg@4", "start": {"avg@4": 0.25}, "end": {"avg@4": end}}}))
        runs.append(run)
    ok, fell = lab.cell_result(runs[:1]), lab.cell_result(runs[1:])
    assert (ok["collapsed"], ok["fell"]) == (0, 0) and (fell["collapsed"], fell["fell"]) == (1, 1)
    assert fell["first_collapse"] is None and fell["final"] == 0.05 and fell["peak"] == 0.25
    both = lab.cell_result(runs)
    assert both["collapsed"] == 1 and both["seeds"] == 2 and both["final"] == pytest.approx(0.175)


def result(final, collapsed=0, seeds=1, kl=1e-3, start=0.25):
    return {"seeds": seeds, "collapsed": collapsed, "fell": 0, "first_collapse": 7 if collapsed else None, "start": start,
            "peak": max(final, start), "final": final, "kl": kl, "clip": 0.0, "is_max": 1.5, "per_seed": []}


def test_findings_follow_from_the_numbers():
    p = lab.plan(quick=True)
    ids = {(c.regime, c.variant): c.id for c in p.cells}
    res = {
        ids["on-policy", "MiniRL"]: result(0.60),
        ids["on-policy", "MiniRL w/o IS"]: result(0.05, collapsed=1),
        ids["on-policy", "MiniRL + length norm"]: result(0.50),
        ids["on-policy", "MiniRL + R3"]: result(0.59, kl=5e-4),
        ids["on-policy", "MiniRL + R3 w/o IS"]: result(0.61),  # stable: F3's second half fails
        ids["off-policy N=4", "no clip, no replay"]: result(0.1, collapsed=1),
        ids["off-policy N=4", "clip"]: result(0.1, collapsed=1),
        ids["off-policy N=4", "clip + R2"]: result(0.40),
        ids["off-policy N=4", "clip + R3"]: result(0.55),
        ids["cold starts", "cold start @10%"]: result(0.58, start=0.1),
    }
    got = {fid: (verdict, numbers) for fid, _, verdict, numbers in lab.findings(res, p.cells, p.offpolicy_n)}
    assert got["F1"][0] == "reproduced" and "w/o IS: collapsed 1/1 (guard at step 7)" in got["F1"][1]
    assert got["F2"][0] == "reproduced"
    assert got["F3"][0] == "not reproduced"
    assert got["F4"][0] == "reproduced" and got["F5"][0] == "reproduced"  # N = 4: R3 0.55 > R2 0.40
    assert got["F6"][0] == "reproduced" and "spread 0.020" in got["F6"][1]
    res[ids["on-policy", "MiniRL w/o IS"]] = result(0.62)  # no collapse and no worse: F1 not reproduced
    assert dict((f, v) for f, _, v, _ in lab.findings(res, p.cells, p.offpolicy_n))["F1"] == "not reproduced"


def test_the_guard_check_reruns_the_cell_that_collapsed_most_reliably():
    p = lab.plan(quick=True)
    ids = {(c.regime, c.variant): c for c in p.cells}

    def res(*collapse_steps):
        return {"per_seed": [{"collapse": s} for s in collapse_steps]}

    none_, clip = ids["off-policy N=4", "no clip, no replay"], ids["off-policy N=4", "clip"]
    r = {c.id: res(None, None) for c in p.cells}
    assert lab.most_reliable_collapse(r, p.cells) is None
    r[clip.id] = res(9, None)
    r[none_.id] = res(12, 4)  # both seeds: more reliable than clip's one, though later on seed 0
    assert lab.most_reliable_collapse(r, p.cells) is none_
    r[none_.id] = res(None, 4)  # seed 0 did not collapse: the check reruns seed 0, so it cannot show it
    assert lab.most_reliable_collapse(r, p.cells) is clip


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
    (tmp_path / "minirl.toml").write_text(recipe.shipped("tiny-scratchpad-long").read_text())
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
    p = lab.Plan(steps=2, eval_every=1, seeds=1, offpolicy_n=(), cold_start_targets=(), cells=[cell])
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
    p = lab.Plan(steps=2, eval_every=1, seeds=1, offpolicy_n=(), cold_start_targets=(), cells=[cell])
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
    p = lab.Plan(steps=2, eval_every=1, seeds=1, offpolicy_n=(), cold_start_targets=(), cells=[cell])
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
    assert not lab._ended(run, guarded=False)
    (run / "summary.json").write_text(json.dumps({"status": "collapsed", "steps": 1}))
    assert lab._ended(run, guarded=True) and not lab._ended(run, guarded=False)


@pytest.mark.slow
def test_a_micro_sweep_runs_resumes_and_reports(tmp_path, monkeypatch):
    """Two real cells of two steps, one of which meets the guard's criteria by construction (KL
    above a max_kl of -1), so the guard check reruns it with the guard acting: it rolls back,
    then stops as collapsed (exit 3), and the report and figure say so."""
    from minirl.rollout.seeding import SAMPLING
    from minirl.workspace import init_workspace

    ws = tmp_path / "ws"
    init_workspace(ws, task="scratchpad", overrides=[
        "cold_start.max_steps=30", "cold_start.train_size=400", "cold_start.heldout_size=8", "cold_start.dev_size=4",
        "cold_start.check_every=30", "cold_start.batch_size=16", "train.group_size=4", "train.prompts_per_step=4",
        "eval.k=1", "rollout.max_tokens=40"])
    full = lab.plan(quick=True)
    trips = ("guard.max_kl=-1", "guard.patience=1", "guard.max_rollbacks=1")
    cells = [lab.Cell("on-policy", "MiniRL", trips), next(c for c in full.cells if c.variant == "MiniRL w/o IS")]
    p = lab.Plan(steps=2, eval_every=1, seeds=1, offpolicy_n=(), cold_start_targets=(), cells=cells)
    L = lab.Lab(ws, ws / "lab" / "micro")
    seen = []
    runs = L.sweep(p, on_cell=lambda what, i, n: seen.append((what, i, n)))
    assert [s[1:] for s in seen] == [(0, 2), (1, 2), (2, 2)] and len(runs) == 2
    state = json.loads((ws / "lab" / "micro" / "state.json").read_text())
    assert set(state["runs"]) == {f"{c.id}/s0" for c in cells}
    for run in state["runs"].values():
        rec = json.loads((tmp_path / run / "summary.json").read_text())["recipe"]
        assert rec["rollout"]["precision"] == "fp8" and rec["guard"]["enabled"] is False
    modes = [json.loads((tmp_path / state["runs"][f"{c.id}/s0"] / "summary.json").read_text())["recipe"]["loss"]["is_mode"]
             for c in cells]
    assert modes == ["truncate", "off"]  # each cell's own change on top
    n_runs = len(list((ws / "runs").iterdir()))
    L2 = lab.Lab(ws, ws / "lab" / "micro")  # a new sweep (an interrupted one resumed): finished cells are not redone
    L2.sweep(p)
    assert len(list((ws / "runs").iterdir())) == n_runs

    info = L2.guard_check(p)
    assert info["cell"] == cells[0].id and len(list((ws / "runs").iterdir())) == n_runs + 1
    guarded = json.loads((Path(info["guarded"]) / "summary.json").read_text())
    assert guarded["recipe"]["guard"]["enabled"] is True and guarded["recipe"]["checkpoint"]["every"] == 5
    assert guarded["status"] == "collapsed" and guarded["guard"]["rollbacks"] == 1  # exit 3 is its result
    check = lab.guard_check_result(L2.state["guard_check"])
    assert check["observed"]["collapse"][0] == 1 and check["observed"]["collapse"][1].startswith("KL(μ‖π_old)")
    assert [(r["step"], r["action"], r["to"]) for r in check["guarded"]["rollbacks"]] == [(1, "rollback", 0), (2, "stop", 0)]

    path, pngs, found = lab.report(L2, p)
    text = path.read_text()
    assert "| F1 |" in text and "| on-policy | MiniRL w/o IS |" in text
    assert "| status | finished after 2 steps | collapsed after 2 steps |" in text
    assert "step 1: rollback to step 0 (KL(μ‖π_old)" in text
    assert [f[0] for f in found] == ["F1"] and pngs[0].stat().st_size > 10_000
    assert pngs[-1].name == "lab-guard-check.png" and pngs[-1].stat().st_size > 10_000

    # a cell recorded under another sampling scheme (rollout.SAMPLING) runs again; the other is
    # reused. That new run is cut short (SIGKILLed as its step 2 begins: a session's end), and the
    # next sweep continues it from its step-1 checkpoint, in its own folder, its step-1 row kept
    key = f"{cells[1].id}/s0"
    L2.state["sets"][key] = [x for x in L2.state["sets"][key] if not x.startswith("#sampling=")] + ["#sampling=1"]
    before = len(list((ws / "runs").iterdir()))
    monkeypatch.setenv("MINIRL_INJECT_KILL", "0@2")
    with pytest.raises(RuntimeError, match="exit -9"):
        L2.sweep(p)
    monkeypatch.delenv("MINIRL_INJECT_KILL")
    killed = sorted((ws / "runs").iterdir())[-1]
    assert len(list((ws / "runs").iterdir())) == before + 1
    assert [r["step"] for r in lab.rows_of(killed)] == [1] and not (killed / "summary.json").exists()
    L3 = lab.Lab(ws, ws / "lab" / "micro")
    L3.sweep(p)
    assert Path(L3.state["runs"][key]) == killed and "in_flight" not in L3.state
    assert len(list((ws / "runs").iterdir())) == before + 1  # no other folder
    assert [r["step"] for r in lab.rows_of(killed)] == [1, 2]
    assert json.loads((killed / "process.json").read_text())["resumed_from"].endswith("step_000001")
    assert json.loads((killed / "summary.json").read_text())["status"] == "finished"
    assert L3.state["sets"][key][-1] == f"#sampling={SAMPLING}"
