"""`minirl lab STUDY`: every study's arms are valid recipes paired by seed, verdicts follow the
rules of verdicts.py on synthetic arms (the placebo included), and a micro study runs for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minirl import lab, recipe, studies


def test_every_arm_is_a_valid_recipe_and_arms_pair_by_seed():
    for study in studies.STUDIES.values():
        p = studies.plan(study, seeds=3, quick=True)
        assert p.steps == study.quick_steps and len({c.id for c in p.cells}) == len(p.cells)
        names = {c.variant for c in p.cells}
        assert all({cmp.a, cmp.b} <= names for cmp in study.comparisons)
        for seed in range(3):
            recs = [recipe.load(recipe.shipped("tiny-scratchpad"), [*lab.common_sets(p, seed), *c.sets]) for c in p.cells]
            assert {r.train.seed for r in recs} == {seed}  # the same prompts and sampling seeds in every arm
            assert {r.train.prompts_per_step // r.train.minibatches for r in recs} == {16}  # equal mini-batches
    placebo = [c for c in studies.plan(studies.STUDIES["is"], seeds=1, quick=True).cells if "placebo" in c.variant]
    recs = [recipe.load(recipe.shipped("tiny-scratchpad"), [*lab.common_sets(studies.plan(studies.STUDIES["is"], seeds=1,
                                                                                           quick=True), 0), *c.sets])
            for c in placebo]
    assert [r.rollout.precision for r in recs] == ["fp32", "fp32"] and [r.loss.is_mode for r in recs] == ["truncate", "off"]


def _arm(finals, collapses=None):
    return [{"seed": i, "final": f, "start": 0.3, "collapse": (collapses or [None] * len(finals))[i], "steps": 30}
            for i, f in enumerate(finals)]


def test_verdicts_follow_the_rules_on_synthetic_arms():
    study = studies.STUDIES["is"]
    same = [0.40, 0.35, 0.44, 0.38, 0.41, 0.37]
    res = {"MiniRL": _arm([0.40, 0.36, 0.45, 0.39, 0.42, 0.38]),
           "w/o IS": _arm([0.05] * 6, collapses=[8, 9, 7, 12, 10, 9]),
           "R3": _arm(same), "R3 w/o IS": _arm(same),
           "placebo: MiniRL, fp32 rollouts": _arm(same), "placebo: w/o IS, fp32 rollouts": _arm(list(reversed(same)))}
    verdicts = {(c.finding, c.kind): text for c, text in studies.decide(study, res)}
    assert verdicts[("F1", "collapse")].startswith("reproduced (collapse rate difference +1.000")
    assert "log-rank" in verdicts[("F1", "collapse")]
    assert verdicts[("F1", "score")].startswith("reproduced (mean paired held-out difference")
    assert verdicts[("F3", "collapse")].startswith("not observed") and "power" in verdicts[("F3", "collapse")]
    assert verdicts[("placebo", "score")].startswith("no difference")
    res["placebo: w/o IS, fp32 rollouts"] = _arm([x + 0.2 for x in same])
    broken = dict((c.finding, t) for c, t in studies.decide(study, res))["placebo"]
    assert "the lab itself is broken" in broken
    assert studies.decide(studies.STUDIES["lengthnorm"], {})[0][1] == "not run yet"


@pytest.mark.slow
def test_a_micro_study_runs_paired_seeds_resumes_and_reports(tmp_path):
    from minirl.workspace import init_workspace

    ws = tmp_path / "ws"
    init_workspace(ws, task="scratchpad", overrides=[
        "cold_start.max_steps=30", "cold_start.train_size=400", "cold_start.heldout_size=8", "cold_start.dev_size=4",
        "cold_start.check_every=30", "train.prompts_per_step=4", "eval.k=1", "rollout.max_tokens=40"])
    study = studies.STUDIES["lengthnorm"]
    p = studies.plan(study, seeds=2, quick=True)
    p = lab.Plan(steps=2, eval_every=1, seeds=2, offpolicy_n=(), cold_start_targets=(), cells=p.cells)
    L = lab.Lab(ws, ws / "lab" / "study-lengthnorm" / "micro")
    seen = []
    studies.run(L, study, p, on_run=lambda what, i, n: seen.append(what))
    assert seen[:4] == ["lengthnorm: MiniRL (seed 0)", "lengthnorm: length norm (seed 0)",
                        "lengthnorm: MiniRL (seed 1)", "lengthnorm: length norm (seed 1)"]  # whole pairs first
    n_runs = len(list((ws / "runs").iterdir()))
    studies.run(lab.Lab(ws, L.out), study, p)  # resumed: nothing redone
    assert len(list((ws / "runs").iterdir())) == n_runs == 4
    seeds = {}
    for key, run in L.state["runs"].items():
        rec = json.loads((Path(run) / "summary.json").read_text())["recipe"]
        seeds.setdefault(key.rsplit("/s", 1)[1], set()).add(rec["train"]["seed"])
    assert seeds == {"0": {0}, "1": {1}}
    res = studies.arm_results(L, p)
    assert sorted(res) == ["MiniRL", "length norm"] and all(len(r) == 2 for r in res.values())
    text = studies.write_report(study, p, res, L.out).read_text()
    assert "| F2 | length normalisation ends lower | length norm − MiniRL |" in text and "inconclusive" not in text
    assert "![the study](study-lengthnorm.png)" in text and (L.out / "study-lengthnorm.png").stat().st_size > 10_000
