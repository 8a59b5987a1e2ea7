"""`--resume` continues a run under its own recipe: never the workspace's values; what flags
change is recorded; a finished run is not resumed unless asked for more steps. And "latest", for
the commands that read a checkpoint, is the newest run that trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minirl.config import recipes
from minirl.disk.store import latest_trained
from minirl.errors import UsageError
from minirl.setup.run_inputs import run_recipe
from minirl.setup.workspace import RECIPE_NAME, Workspace


def _run(ws: Path, name: str, steps: tuple[int, ...], recipe_text: str | None = None, summary: dict | None = None) -> Path:
    run = ws / "runs" / name
    for step in steps:
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / "minirl.json").write_text(json.dumps({"step": step}))
    if recipe_text is not None:
        (run / "recipe.toml").write_text(recipe_text)
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture
def ws(tmp_path) -> Workspace:
    (tmp_path / RECIPE_NAME).write_text("[train]\nsteps = 300\nlr = 3e-4\n")
    return Workspace(tmp_path)


def test_a_resumed_run_keeps_its_own_recipe_and_flags_on_top_of_it(ws):
    own = recipes.load(None, ["train.steps=5", "train.lr=1e-3"])
    _run(ws.root, "20261127-100000", (0, 2), own.to_toml())
    assert run_recipe(ws, None, []).train.steps == 300  # a new run: the workspace's
    for resume in ("latest", "auto", "20261127-100000"):
        rec = run_recipe(ws, resume, [])
        assert (rec.train.steps, rec.train.lr) == (5, 1e-3)  # not the workspace's 300 and 3e-4
    assert run_recipe(ws, "latest", ["train.steps=8"]).train.steps == 8  # asked for: applied, and recorded (below)


def test_what_a_resume_changes_is_recorded_before_the_recipe_is_rewritten(ws):
    from minirl.run.lifecycle import RECIPE_CHANGES, _record_changes

    run = _run(ws.root, "20261127-100000", (2,), recipes.load(None, ["train.steps=5"]).to_toml())
    ckpt = run / "checkpoints" / "step_000002"
    assert _record_changes(run, recipes.load(None, ["train.steps=5"]), ckpt) == {}
    assert not (run / RECIPE_CHANGES).exists()
    changed = _record_changes(run, recipes.load(None, ["train.steps=8", "guard.max_kl=0.1"]), ckpt)
    assert changed == {"train.steps": (5, 8), "guard.max_kl": (0.05, 0.1)}
    line = json.loads((run / RECIPE_CHANGES).read_text())
    assert line["from_step"] == 2 and line["changes"] == {"train.steps": [5, 8], "guard.max_kl": [0.05, 0.1]}
    assert _record_changes(run, recipes.load(None), None) == {}  # a new run: nothing to compare


def test_a_finished_run_is_resumed_only_for_more_steps(ws):
    _run(ws.root, "20261127-100000", (0, 5), recipes.load(None, ["train.steps=5"]).to_toml(),
         {"status": "finished", "steps": 5})
    with pytest.raises(UsageError, match=r"run 20261127-100000 has finished \(5 of 5 steps\): nothing to resume"):
        run_recipe(ws, "latest", [])
    assert run_recipe(ws, "latest", ["train.steps=9"]).train.steps == 9
    assert run_recipe(ws, "auto", []).train.steps == 300  # auto past an ended run: a new run


def test_latest_is_the_newest_run_that_trained(ws):
    assert latest_trained(ws) is None
    trained = _run(ws.root, "20261127-100000", (0, 4))
    _run(ws.root, "20261127-110000", (0,))  # newer, stopped at step 0: it holds the cold start
    assert latest_trained(ws) == trained / "checkpoints" / "step_000004"


def test_a_cards_evaluations_are_found_however_the_checkpoint_path_was_typed(tmp_path, monkeypatch):
    from minirl.disk.store import Checkpoint
    from minirl.publish.export import eval_results_for

    ckpt = _run(tmp_path, "20261127-100000", (4,)) / "checkpoints" / "step_000004"
    (tmp_path / "evals").mkdir()
    monkeypatch.chdir(tmp_path)
    typed = {"relative": "runs/20261127-100000/checkpoints/step_000004/hf", "absolute": str(ckpt / "hf"),
             "dotted": f"{tmp_path}/runs/../runs/20261127-100000/checkpoints/step_000004"}
    for i, (bench, path) in enumerate(typed.items()):
        (tmp_path / "evals" / f"{bench}.json").write_text(json.dumps({"benchmark": bench, "checkpoint": path}))
    found = eval_results_for(tmp_path, Checkpoint(ckpt, 4, True))
    assert sorted(r["benchmark"] for r in found) == ["absolute", "dotted", "relative"]
