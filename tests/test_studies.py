"""`minirl lab STUDY`: every study's arms are valid recipes paired by seed, verdicts follow the
rules of verdicts.py on synthetic arms (the placebo included), and a micro study runs for real."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from minirl.config import recipes
from minirl.lab import report as study_report
from minirl.lab import runner as lab, rescore, stages, studies, verdicts


def test_every_arm_is_a_valid_recipe_and_arms_pair_by_seed():
    base = recipes.load(recipes.shipped("tiny-scratchpad"))
    for study in studies.STUDIES.values():
        sp = studies.plan(study, seeds=3, quick=True, level="fp8")
        p = sp.plan
        assert p.steps == study.quick_steps and len({c.id for c in p.cells}) == len(p.cells)
        names = {c.variant for c in p.cells}
        assert all({cmp.a, cmp.b} <= names for cmp in study.comparisons)
        for seed in range(3):
            recs = [recipes.load(recipes.shipped("tiny-scratchpad"), [*lab.common_sets(p, seed), *c.sets]) for c in p.cells]
            assert {r.train.seed for r in recs} == {seed}  # the same prompts and sampling seeds in every arm
            assert {r.train.prompts_per_step // r.train.minibatches for r in recs} == {16}  # equal mini-batches
            if study.name == studies.LR_STUDY:  # the one study whose arms set it: the grid, all else equal
                assert sorted(r.train.lr for r in recs) == sorted(studies.LR_GRID)
                assert len({dataclasses.replace(r, train=dataclasses.replace(r.train, lr=1.0)).to_dict().__repr__()
                            for r in recs}) == 1
            else:
                assert {(r.train.lr, r.train.weight_decay) for r in recs} == {(base.train.lr, base.train.weight_decay)}
            assert {r.rollout.precision for r in recs} <= {"fp8", "fp32"}  # the study's level (the placebo: fp32)
    # on the long miniature (8 prompts a step) the off-policy arms' mini-batches shrink with it
    long = recipes.load(recipes.shipped("tiny-scratchpad-long"))
    sp = studies.plan(studies.STUDIES["offpolicy"], seeds=1, quick=True, level="fp8", prompts=long.train.prompts_per_step)
    recs = [recipes.load(recipes.shipped("tiny-scratchpad-long"), [*lab.common_sets(sp.plan, 0), *c.sets])
            for c in sp.plan.cells]
    assert {(r.train.prompts_per_step, r.train.minibatches) for r in recs} == {(4 * long.train.prompts_per_step, 4)}
    placebo = [a.cell for a in studies.plan(studies.STUDIES["is"], seeds=1, quick=True, level="fp8").arms
               if "placebo" in a.name]
    recs = [recipes.load(recipes.shipped("tiny-scratchpad"), [*lab.common_sets(studies.plan(
        studies.STUDIES["is"], seeds=1, quick=True, level="fp8").plan, 0), *c.sets]) for c in placebo]
    assert [r.rollout.precision for r in recs] == ["fp32", "fp32"] and [r.loss.is_mode for r in recs] == ["truncate", "off"]


def test_the_dial_level_is_chosen_by_the_mechanism_and_run_first():
    measured = {"fp32": {"sd": 0.0}, "bf16": {"sd": 0.15}, "fp8-weights": {"sd": 0.37}, "fp8": {"sd": 0.41},
                "e5m2": {"sd": 1.003}}
    assert studies.choose_level(measured)[0] == "e5m2"
    level, why = studies.choose_level({**measured, "e5m2": {"sd": 0.8}})
    assert level == "e5m2" and why.startswith("no level reaches 1")
    sp = studies.plan(studies.STUDIES["is"], seeds=5, quick=False, level="e5m2", dose_seeds=2)
    todo = sp.todo()
    primary = [(a.name, s) for a, s in todo if a.primary]
    assert todo[:len(primary)] == [(a, s) for a, s in todo if a.primary]  # the study's level first, whole
    assert primary[:6] == [(name, 0) for name, _, _ in studies.STUDIES["is"].arms]  # seed by seed
    assert len(primary) == 6 * 5
    dose = [(a.level, a.name, s) for a, s in todo if not a.primary]
    assert [lvl for lvl, _, _ in dose] == sorted((lvl for lvl, _, _ in dose), key=studies.DIAL.index)  # mildest first
    assert {lvl for lvl, _, _ in dose} == {"bf16", "fp8-weights", "fp8", "nvfp4"} and len(dose) == 4 * 4 * 2  # no placebo
    # a study whose doctor ran before a level existed (measured above: no nvfp4) keeps its own dial
    old = studies.plan(studies.STUDIES["is"], seeds=5, quick=False, level="e5m2", dose_seeds=2,
                       dial=studies.measured_dial(measured))
    assert {a.level for a in old.arms if not a.primary} == {"bf16", "fp8-weights", "fp8"}
    # a study without a dose–response, or --quick, runs its level only
    assert all(a.primary for a in studies.plan(studies.STUDIES["coldstart"], seeds=3, quick=False, level="fp8",
                                               dose_seeds=2).arms)
    assert all(a.primary for a in studies.plan(studies.STUDIES["is"], seeds=2, quick=True, level="fp8").arms)


def _arm(finals, collapses=None, slope=0.0):
    return [{"seed": i, "final": f, "start": 0.3, "collapse": (collapses or [None] * len(finals))[i], "steps": 30,
             "slope": slope} for i, f in enumerate(finals)]


def test_the_report_opens_with_the_dial_and_draws_the_dose_response(tmp_path):
    """Synthetic runs at three levels: the dial's table comes before any result, the verdicts are
    decided at the study's level, and the dose–response has a row per arm and a figure."""
    study = studies.STUDIES["is"]
    sp = studies.plan(study, seeds=2, quick=False, level="e5m2", dose_seeds=2)
    rows = [{"step": s, "rollout/reward_mean": 0.3, "train/entropy": 1.0, "train/kl_mu_pi_old": 1e-3,
             **({"heldout/avg@4": 0.4} if s % 5 == 0 else {})} for s in range(1, 11)]

    def arm(final):
        return [{**r, "rows": rows, "lr": 3e-4} for r in _arm([final, final + 0.01])]

    res = {"e5m2": {name: arm(0.4) for name, _, _ in study.arms},
           "bf16": {name: arm(0.45) for name, _, _ in study.arms if "placebo" not in name},
           "fp8": {name: arm(0.42) for name, _, _ in study.arms if "placebo" not in name}}
    level = {"kl": 1e-3, "kl_spread": 1e-4, "sd": 0.5, "sd_spread": 0.1, "predicted": 0.4, "length": 32.0,
             "route_flips": 0.05}
    mech = {"measured_at": "2026-11-25 04:05:50", "doctor": "/x/doctor-1.json", "seeds": 3, "level": "e5m2",
            "why": "the mildest level whose per-response spread reaches 1 (1.00)", "route_flips": 0.005,
            "levels": {lvl: {**level, "sd": sd} for lvl, sd in
                       (("fp32", 0.0), ("bf16", 0.15), ("fp8-weights", 0.37), ("fp8", 0.41), ("e5m2", 1.0))}}
    text = study_report.write_report(study, sp, res, mech, tmp_path).read_text()
    assert text.index("| e5m2 (the study's level) |") < text.index("## Verdicts at e5m2") < text.index("## Dose–response")
    assert "learning rate 0.0003 in every arm (the workspace recipe's" in text and "| fp8 | 1.00e-03 ± 1.0e-04 | 0.410 ± 0.10 | 0.40 | 32.0 | 5.0% |" in text
    dose = text.split("## Dose–response")[1]
    assert "| arm | bf16 (SD 0.15) | fp8 (SD 0.41) | e5m2 (SD 1.00) |" in dose
    assert "| MiniRL | 0.455 [0.450, 0.460], 0/2 collapsed |" in dose
    res["bf16"]["MiniRL"] = res["bf16"]["MiniRL"][:1]  # one seed: a value, no range
    dose = study_report.write_report(study, sp, res, mech, tmp_path).read_text().split("## Dose–response")[1]
    assert "| MiniRL | 0.450, 0/1 collapsed | 0.425 [0.420, 0.430], 0/2 collapsed |" in dose
    assert "placebo" not in dose.split("![")[0] and (tmp_path / "study-is-dose.png").stat().st_size > 10_000


def test_a_rescore_reports_each_arm_at_both_engines_and_pairs_the_comparisons(tmp_path):
    """Synthetic runs, rescored at fp32: per arm the own engine's last evaluation beside the fp32
    score, per score comparison the paired difference on each, the collapse comparisons left out;
    a run not rescored yet is left out of its arm, and a study with none says so."""
    study = studies.STUDIES["is"]
    sp = studies.plan(study, seeds=3, quick=False, level="nvfp4")
    own = {"MiniRL": [0.70, 0.75, 0.72], "w/o IS": [0.80, 0.84, 0.83]}
    fp32 = {"MiniRL": [0.88, 0.90, 0.86], "w/o IS": [0.87, 0.91, 0.86]}
    here = {name: [{"key": f"{name}/s{i}", "seed": i, "last": x, "final": x} for i, x in enumerate(own[name])]
            for name in own}
    scores = {f"{name}/s{i}": {"score": x} for name in fp32 for i, x in enumerate(fp32[name])}
    lines = rescore.report_lines(study.comparisons, "nvfp4", here, scores, "fp32")
    text = "\n".join(lines)
    assert lines[0] == "## Exploratory: the last checkpoints served at fp32" and "never a verdict" in text
    assert "| MiniRL | 3 | 0.723 (0.700, 0.750, 0.720) | 0.880 (0.880, 0.900, 0.860) | +0.157 |" in text
    f1 = next(x for x in lines if x.startswith("| F1 | MiniRL − w/o IS |"))
    own_cell, fp32_cell = f1.split(" | ")[2:4]
    assert own_cell.startswith("-0.100, 95% t-CI [") and "n = 3" in own_cell  # MiniRL below on its own engine
    assert fp32_cell.startswith("+0.000, 95% t-CI [")  # and level with it served exactly
    assert verdicts.paired_scores(own["w/o IS"], own["MiniRL"]).p < 0.05 < verdicts.paired_scores(
        fp32["w/o IS"], fp32["MiniRL"]).p
    assert not any(x.startswith("| F1 | w/o IS − MiniRL |") for x in lines)  # collapses are not scores
    del scores["MiniRL/s2"]
    assert "| MiniRL | 2 |" in "\n".join(rescore.report_lines(study.comparisons, "nvfp4", here, scores, "fp32"))
    del scores["MiniRL/s1"]  # one pair: no difference to test
    assert rescore.report_lines(study.comparisons, "nvfp4", here, scores, "fp32")[-1] == (
        "Paired differences: from two rescored pairs on.")
    assert rescore.report_lines(study.comparisons, "nvfp4", here, {}, "fp32")[-1] == "Not rescored yet."
    # in the study's report, after its own results
    rows = [{"step": s, "rollout/reward_mean": 0.3, "train/entropy": 1.0, "train/kl_mu_pi_old": 1e-3} for s in (1, 2)]
    res = {"nvfp4": {n: [{**r, "start": 0.1, "collapse": None, "steps": 2, "rows": rows, "lr": 1e-4, "slope": 0.0}
                         for r in runs] for n, runs in here.items()}}
    report = study_report.write_report(study, sp, res, None, tmp_path, rescored=("fp32", scores)).read_text()
    assert report.index("## Arms at nvfp4") < report.index("## Exploratory: the last checkpoints served at fp32")
    assert "![served at fp32](study-is-rescore-fp32.png)" in report
    assert (tmp_path / "study-is-rescore-fp32.png").stat().st_size > 10_000


def test_cold_starts_are_compared_only_once_they_plateau():
    study = studies.STUDIES["coldstart"]
    a, b = "cold start @10%", "cold start @40%"
    rising = studies.decide(study, {a: _arm([0.5, 0.52, 0.49], slope=0.06), b: _arm([0.6, 0.61, 0.63])})[0][1]
    assert rising.startswith("not yet converged") and "cold start @10%: held-out still rising by +0.060" in rising
    flat = studies.decide(study, {a: _arm([0.5, 0.52, 0.49], slope=0.01), b: _arm([0.5, 0.51, 0.50], slope=-0.01)})[0][1]
    assert flat.startswith(("reproduced", "not observed", "contradicted"))
    # a mean above the bound that the seeds do not bear out (the first coldstart study's 40% arm)
    # is noise, not a rise; the same mean carried by every seed is a rise
    noisy = _arm([0.77, 0.79, 0.84])
    for run, slope in zip(noisy, [0.031, -0.014, 0.049]):
        run["slope"] = slope
    assert not studies.decide(study, {a: _arm([0.5, 0.5, 0.5]), b: noisy})[0][1].startswith("not yet converged")
    steady = studies.decide(study, {a: _arm([0.5, 0.5, 0.5]), b: _arm([0.77, 0.79, 0.84], slope=0.022)})[0][1]
    assert steady.startswith("not yet converged") and "p = 0 across 3 seed(s)" in steady
    # the slope itself: a run still climbing, and one that has flattened out
    climbing = [{"step": s, "heldout/avg@4": 0.3 + 0.0005 * s} for s in range(25, 401, 25)]
    flattened = [{"step": s, "heldout/avg@4": min(0.3 + 0.002 * s, 0.6)} for s in range(25, 401, 25)]
    assert verdicts.heldout_slope(climbing) == pytest.approx(0.05)
    assert verdicts.heldout_slope(flattened) == pytest.approx(0.0)
    assert verdicts.heldout_slope(climbing[:3]) is None  # too few evaluations in the second half


def test_verdicts_follow_the_rules_on_synthetic_arms():
    study = studies.STUDIES["is"]
    same = [0.40, 0.35, 0.44, 0.38, 0.41, 0.37]
    res = {"MiniRL": _arm([0.40, 0.36, 0.45, 0.39, 0.42, 0.38]),
           "w/o IS": _arm([0.05] * 6, collapses=[8, 9, 7, 12, 10, 9]),
           "R3": _arm(same), "R3 w/o IS": _arm(same),
           "placebo: MiniRL, fp32 rollouts": _arm(same), "placebo: w/o IS, fp32 rollouts": _arm(list(reversed(same)))}
    verdicts = {(d.cmp.finding, d.cmp.kind): d.text for d in studies.decide(study, res)}
    assert verdicts[("F1", "collapse")].startswith("reproduced (collapse rate difference +1.000")
    assert "log-rank" in verdicts[("F1", "collapse")]
    assert verdicts[("F1", "score")].startswith("reproduced (mean paired held-out difference")
    assert verdicts[("F3", "collapse")].startswith("not observed") and "power" in verdicts[("F3", "collapse")]
    assert verdicts[("placebo", "score")].startswith("no difference")
    res["placebo: w/o IS, fp32 rollouts"] = _arm([x + 0.2 for x in same])
    broken = {d.cmp.finding: d.text for d in studies.decide(study, res)}["placebo"]
    assert "the lab itself is broken" in broken
    assert studies.decide(studies.STUDIES["lengthnorm"], {})[0][1] == "not run yet"


def test_a_confirmation_stage_runs_fresh_seeds_for_the_comparisons_short_of_power(tmp_path):
    """The offpolicy study's first stage as it came out (no clip 3/5 collapsed, clip 0/5): F4 is
    not observed at power 0.74, so the second stage runs F4's four arms on the 7 fresh seeds power
    0.8 needs, and F5 (already powered) not at all; its verdicts see the fresh seeds alone."""
    study = studies.STUDIES["offpolicy"]
    fell = [20, None, 15, 18, None]
    res = {"no clip": _arm([0.1, 0.5, 0.1, 0.1, 0.5], collapses=fell), "clip": _arm([0.5] * 5),
           "clip + R2": _arm([0.50, 0.52, 0.49, 0.51, 0.50]), "clip + R3": _arm([0.51, 0.53, 0.50, 0.52, 0.51]),
           "R2, no clip": _arm([0.5] * 5), "R3, no clip": _arm([0.1, 0.5, 0.1, 0.1, 0.5], collapses=fell)}
    assert stages.unpaired(study, res) == ""
    stopped = {**res, "R3, no clip": res["R3, no clip"][:4]}  # the first stage stopped mid-seed: no declaration
    assert stages.unpaired(study, stopped).endswith("R2, no clip 5, R3, no clip 4 seeds")
    assert stages.unpaired(study, {k: r for k, r in res.items() if k != "clip"}).startswith("no clip 5, clip 0,")
    stage1 = studies.decide(study, res)
    assert [d.needed for d in stage1] == [7, 7, 7, 0]
    declared = stages.declare_confirmation(study, stage1, report="/x/report.md")
    assert declared["seeds"] == 7 and declared["first_seed"] == stages.CONFIRM_FIRST_SEED
    assert [f for f, _ in declared["comparisons"]] == ["F4"] * 3 and "power 0.74" in declared["why"][0]
    sub = stages.confirmation_study(study, declared)
    assert [a[0] for a in sub.arms] == ["no clip", "clip", "clip + R3", "R3, no clip"] and not sub.dose
    sp = studies.plan(sub, seeds=7, quick=False, level="e5m2", dose_seeds=2, first_seed=declared["first_seed"])
    todo = sp.todo()
    assert len(todo) == 4 * 7 and todo[:4] == [(a, 1000) for a in sp.arms] and todo[-1][1] == 1006
    rec = recipes.load(recipes.shipped("tiny-scratchpad"), [*lab.common_sets(sp.plan, todo[-1][1]), *todo[-1][0].cell.sets])
    assert rec.train.seed == 1006
    # the first stage's seeds are not the second's: a verdict pairs only what both arms ran
    fresh = {name: [{**r, "seed": 1000 + r["seed"]} for r in _arm([0.1] * 7 if "no clip" in name else [0.5] * 7,
                                                                   collapses=[20] * 7 if "no clip" in name else None)]
             for name, _, _ in sub.arms}
    decided = studies.decide(sub, fresh)
    assert [d.text.split(" (")[0] for d in decided] == ["reproduced", "reproduced", "not observed"]
    assert "n = 14" in decided[0].text
    mech = {"measured_at": "2026-11-25 04:05:50", "doctor": "/x/doctor-1.json", "seeds": 3, "level": "e5m2",
            "why": "w", "route_flips": None, "levels": {}}
    for r in fresh.values():
        for x in r:
            x.update(rows=[{"step": 1, "rollout/reward_mean": 0.3, "train/entropy": 1.0, "train/kl_mu_pi_old": 1e-3}],
                     lr=3e-4)
    text = study_report.write_report(sub, sp, {"e5m2": fresh}, mech, tmp_path, confirmation=declared).read_text()
    assert text.startswith("# minirl lab offpolicy: confirmation stage")
    assert text.index("## Declared before its first run") < text.index("## Verdicts at e5m2")
    assert "7 fresh seeds per arm (train.seed 1000 on)" in text and "| F5 |" not in text
    assert "over both stages its chance of a false positive is at most 0.0975" in text
    # nothing short of power: nothing to confirm
    assert stages.declare_confirmation(study, [d._replace(needed=0) for d in stage1], report="r") is None


@pytest.mark.slow
def test_a_micro_study_runs_paired_seeds_resumes_and_reports(tmp_path):
    from minirl.setup.workspace import init_workspace

    ws = tmp_path / "ws"
    init_workspace(ws, task="scratchpad", overrides=[
        "cold_start.max_steps=30", "cold_start.train_size=400", "cold_start.heldout_size=8", "cold_start.dev_size=4",
        "cold_start.check_every=30", "cold_start.batch_size=16", "train.group_size=4", "train.prompts_per_step=8",
        "eval.k=1", "rollout.max_tokens=40"])
    study = studies.STUDIES["lengthnorm"]
    L = lab.Lab(ws, ws / "lab" / "study-lengthnorm" / "micro")
    mech = studies.mechanism(L, seeds=1)  # the dial, measured by `minirl doctor` before any run
    assert set(mech["levels"]) == {"fp32", *studies.DIAL} and mech["level"] in studies.DIAL
    assert mech["levels"]["fp32"]["kl"] < mech["levels"]["bf16"]["kl"]
    assert studies.mechanism(L, seeds=1) == mech and len(list((L.out / "doctor").glob("*.json"))) == 1  # once
    assert studies.study_endpoint(mech) == "late"  # declared with the dial, before any run
    # one seed: the pairing of seeds and the verdicts' statistics have tests of their own (above);
    # this one is about a study running end to end, resuming and reporting (each run ~40 s here)
    sp = studies.plan(study, seeds=1, quick=True, level=mech["level"])
    sp = dataclasses.replace(sp, plan=dataclasses.replace(sp.plan, steps=2, eval_every=1))
    seen = []
    studies.run(L, study, sp, on_run=lambda what, i, n: seen.append(what))
    lvl = mech["level"]
    assert seen[:2] == [f"lengthnorm: MiniRL @ {lvl} (seed 0)", f"lengthnorm: length norm @ {lvl} (seed 0)"]
    n_runs = len(list((ws / "runs").iterdir()))
    studies.run(lab.Lab(ws, L.out), study, sp)  # resumed: nothing redone
    assert len(list((ws / "runs").iterdir())) == n_runs == 2
    seeds = {}
    for key, run in L.state["runs"].items():
        rec = json.loads((Path(run) / "summary.json").read_text())["recipe"]
        seeds.setdefault(key.rsplit("/s", 1)[1], set()).add(rec["train"]["seed"])
    assert seeds == {"0": {0}}
    res = studies.arm_results(L, sp)
    assert sorted(res[lvl]) == ["MiniRL", "length norm"] and all(len(r) == 1 for r in res[lvl].values())
    text = study_report.write_report(study, sp, res, mech, L.out).read_text()
    assert text.index("## The mismatch dial, measured before any arm ran") < text.index("## Verdicts")
    assert f"Level: **{lvl}**" in text
    assert "| F2 | length normalisation ends lower | length norm − MiniRL |" in text and "inconclusive" not in text
    assert "![the study](study-lengthnorm.png)" in text and (L.out / "study-lengthnorm.png").stat().st_size > 10_000
    # --rescore: a run's last checkpoint evaluated again at fp32 by a real `minirl eval`, and only once
    first = dict(list(studies.primary_runs(L, sp).items())[:1])
    scores = rescore.rescore(L, first, "fp32")
    [(key, got)] = scores.items()
    result = json.loads(Path(got["file"]).read_text())
    assert result["rollout_precision"] == "fp32" and Path(result["checkpoint"]).is_relative_to(first[key])
    assert result["problems"] == 8 and result["k"] == 1 and 0 <= result["avg@1"] <= result["pass@1"] <= 1
    assert got["score"] == result[got["metric"]] and got["metric"] == "avg@1"
    evals = sorted((ws / "evals").glob("heldout-*.json"))
    assert rescore.rescore(lab.Lab(ws, L.out), first, "fp32") == scores  # resumed: not evaluated again
    assert sorted((ws / "evals").glob("heldout-*.json")) == evals
    text = study_report.write_report(study, sp, studies.arm_results(L, sp), mech, L.out, rescored=("fp32", scores)).read_text()
    assert "## Exploratory: the last checkpoints served at fp32" in text


def test_a_run_is_scored_on_the_endpoint_its_study_declared(tmp_path):
    """The late third's mean for a study declared with it; the last evaluation for one declared
    before it existed (its mechanism.json has no endpoint), so no verdict moves after its runs."""
    study = studies.STUDIES["lengthnorm"]
    L = lab.Lab(tmp_path, tmp_path / "lab")
    evals = {25: 0.5, 50: 0.6, 75: 0.7, 100: 0.8, 125: 0.6, 150: 0.7}
    for name, seed in [("MiniRL", 0), ("length norm", 0)]:
        run = tmp_path / "runs" / f"{name}-{seed}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({
            "heldout": {"metric": "avg@4", "start": {"avg@4": 0.4}, "end": {"avg@4": evals[150]}},
            "recipe": {"train": {"lr": 3e-4}}}))
        rows = [{"step": s, "rollout/reward_mean": 0.5, "train/entropy": 1.0, "train/kl_mu_pi_old": 1e-3,
                 **({"heldout/avg@4": evals[s]} if s in evals else {})} for s in range(1, 151)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    declared = studies.plan(study, seeds=1, quick=False, level="e5m2")
    for arm in declared.arms:
        L.state["runs"][f"{arm.cell.id}/s0"] = str(tmp_path / "runs" / f"{arm.name}-0")
    assert declared.endpoint == "late" == studies.study_endpoint({"endpoint": "late"})
    late = studies.arm_results(L, declared)["e5m2"]["MiniRL"][0]["final"]
    assert late == pytest.approx((0.8 + 0.6 + 0.7) / 3)  # steps 100, 125, 150: the last third of 150
    # a run whose last step is off the schedule logs its closing evaluation in summary.json only
    rows = [json.loads(x) for x in (tmp_path / "runs" / "MiniRL-0" / "metrics.jsonl").read_text().splitlines()]
    rows[-1].pop("heldout/avg@4")
    (tmp_path / "runs" / "MiniRL-0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert studies.arm_results(L, declared)["e5m2"]["MiniRL"][0]["final"] == pytest.approx(late)
    old = studies.plan(study, seeds=1, quick=False, level="e5m2", endpoint=studies.study_endpoint({}))
    assert studies.arm_results(L, old)["e5m2"]["MiniRL"][0]["final"] == 0.7
    text = study_report.write_report(study, old, studies.arm_results(L, old), None, tmp_path).read_text()
    assert "Final held-out score: the last held-out evaluation (declared before the late-third" in text


def test_a_study_not_about_the_gap_keeps_the_papers_level_whatever_the_dial_chose():
    """F6 asks whether cold starts end alike under stable training: it runs at the paper's FP8
    whatever level the mechanism picked for the IS findings, and its report says so."""
    mech = {"level": "e5m2", "why": "the mildest level whose per-response spread reaches 1 (1.00)"}
    assert studies.study_level(studies.STUDIES["coldstart"], mech)[0] == "fp8"
    assert studies.study_level(studies.STUDIES["is"], mech) == ("e5m2", mech["why"])
    mech.update(seeds=3, measured_at="now", doctor="/x/doctor-1.json", levels={
        lvl: {"kl": 1e-3, "kl_spread": 0.0, "sd": 0.5, "sd_spread": 0.0, "predicted": 0.4, "length": 32.0}
        for lvl in ("bf16", "fp8", "e5m2")})
    text = "\n".join(study_report.mechanism_lines(mech, studies.study_level(studies.STUDIES["coldstart"], mech)))
    assert "| fp8 (the study's level) |" in text and "| e5m2 |" in text and "Level: **fp8**, fixed by the study" in text


def test_a_study_piped_to_a_log_says_each_run_in_a_line(tmp_path, capsys):
    """Rich draws no live bars into a log (nohup, CI): the study says each run it starts, with the time."""
    from cli import study as cli_study

    class Cells:  # the seam: each run is a `minirl run` process of its own (lab.Lab.run_cell)
        out, ws_root, state = tmp_path, tmp_path, {"runs": {}}

        def finished(self, cell, seed, plan):
            return seed == 0 and cell.variant == "MiniRL"  # a resumed study: said once, when it ran

        def run_cell(self, cell, seed, plan, progress):
            self.state["runs"][f"{cell.id}/s{seed}"] = None
            del self.state["runs"][f"{cell.id}/s{seed}"]  # nothing left to read: the report says "not run yet"

    (tmp_path / "minirl.toml").write_text('[rollout]\ntemperature = 0.6\n')  # the workspace every run samples from
    study = studies.STUDIES["lengthnorm"]
    sp = studies.plan(study, seeds=2, quick=True, level="e5m2")
    cli_study._run_and_report(Cells(), study, sp, None, report_only=False)
    lines = [x for x in capsys.readouterr().out.splitlines() if re.match(r"\d\d:\d\d:\d\d ", x)]
    assert [x.split(" ", 1)[1] for x in lines] == [
        "run 2/4: lengthnorm: length norm @ e5m2 (seed 0)",
        "run 3/4: lengthnorm: MiniRL @ e5m2 (seed 1)", "run 4/4: lengthnorm: length norm @ e5m2 (seed 1)",
        "done: 4 runs"]
    assert "sampled at T = 0.6" in (tmp_path / "report.md").read_text()


def test_a_follow_up_runs_a_studys_arms_on_fresh_seeds_at_another_dial_level(tmp_path):
    """The long miniature's dose–response showed the IS-corrected arms failing at nvfp4 on one seed:
    `--at nvfp4` declares a test of its own there (fresh seeds, no placebo, the comparisons among
    the arms it runs) and refuses what would not be one."""
    from click.testing import CliRunner

    from cli.main import cli
    from minirl.errors import UsageError

    ws = tmp_path / "ws"
    (ws / "lab" / "study-is" / "full").mkdir(parents=True)
    (ws / "minirl.toml").write_text(recipes.shipped("tiny-scratchpad-long").read_text())
    level = {"kl": 1e-3, "kl_spread": 0.0, "sd_spread": 0.0, "predicted": 0.4, "length": 98.0}
    mech = {"measured_at": "2026-11-25 13:43:14", "doctor": "/x/doctor-1.json", "seeds": 3, "level": "e5m2",
            "why": "w", "route_flips": None, "levels": {lvl: {**level, "sd": sd} for lvl, sd in (
                ("fp32", 0.0), ("bf16", 0.15), ("fp8-weights", 0.37), ("fp8", 0.61), ("e5m2", 1.15))}}
    (ws / "lab" / "study-is" / "full" / "mechanism.json").write_text(json.dumps(mech))

    def refused(*args) -> str:  # the one line `minirl` prints (exit 2) for a UsageError
        r = CliRunner().invoke(cli, ["lab", *args])
        assert isinstance(r.exception, UsageError), r.output
        return str(r.exception)

    assert "is the study's own level" in refused("is", str(ws), "--at", "e5m2")
    assert "nvfp4 is not on the study's measured dial" in refused("is", str(ws), "--at", "nvfp4")
    # lengthnorm never ran here: refused before its dial would be measured
    assert "the lengthnorm study has no dose–response to follow up" in refused("lengthnorm", str(ws), "--at", "bf16")
    assert "no study at" in refused("lengthnorm", str(ws), "--at", "bf16", "--report-only")
    assert not (ws / "lab" / "study-lengthnorm").exists()
    (ws / "lab" / "study-lengthnorm" / "full").mkdir(parents=True)
    (ws / "lab" / "study-lengthnorm" / "full" / "mechanism.json").write_text(json.dumps(mech))
    assert "the lengthnorm study has no dose–response to follow up" in refused("lengthnorm", str(ws), "--at", "bf16")
    assert "no follow-up at" in refused("is", str(ws), "--at", "fp8", "--report-only")
    assert not (ws / "lab" / "study-is" / "full" / "at-fp8").exists()  # refused before anything was written

    declared = stages.declare_follow_up(studies.STUDIES["is"], "fp8", seeds=5, report="/x/report.md",
                                         dial=studies.measured_dial(mech["levels"]))
    sub = stages.follow_up_study(studies.STUDIES["is"], declared)
    assert [a[0] for a in sub.arms] == ["MiniRL", "w/o IS", "R3", "R3 w/o IS"] and not sub.dose
    assert [c.finding for c in sub.comparisons] == ["F1", "F1", "F3", "F3", "F3"]  # the placebo's is gone
    why = f"fixed by the study: a follow-up declared at {declared['declared_at']} after the dose–response"
    assert studies.study_level(sub, mech) == ("fp8", f"{why}, not the dial's e5m2")
    sp = studies.plan(sub, seeds=5, quick=False, level="fp8", first_seed=declared["first_seed"],
                      endpoint=declared["endpoint"])
    assert {a.cell.sets[0] for a in sp.arms} == {"rollout.precision=fp8"} and sp.todo()[0][1] == 2000
    text = study_report.write_report(sub, sp, {}, mech, tmp_path, follow_up=declared).read_text()
    assert text.startswith("# minirl lab is: follow-up at fp8") and "train.seed 2000 on" in text
    assert "after the first stage's dose–response (`/x/report.md`)" in text
    alone = study_report.write_report(sub, sp, {}, mech, tmp_path, follow_up={**declared, "from": ""}).read_text()
    assert "with no first stage in this workspace (its dial measured for this follow-up" in alone
    # declared once: its seeds do not change after
    out = ws / "lab" / "study-is" / "full" / "at-fp8"
    out.mkdir()
    (out / "at.json").write_text(json.dumps(declared))
    assert "declared with 5 seeds per arm" in refused("is", str(ws), "--at", "fp8", "--seeds", "7", "--report-only")
    r = CliRunner().invoke(cli, ["lab", "is", str(ws), "--at", "fp8", "--report-only"])
    assert r.exit_code == 0 and (out / "report.md").read_text().startswith("# minirl lab is: follow-up at fp8")


def _lr_arms(finals: dict[float, list[float]], collapsed: tuple[float, ...] = ()) -> dict[str, list[dict]]:
    return {f"MiniRL, lr {lr:g}": [{**r, "lr": lr, "collapse": 12 if lr in collapsed and r["seed"] == 0 else None}
                                   for r in _arm(f)] for lr, f in finals.items()}


def test_the_learning_rate_is_the_best_stable_one_once_every_rate_ran_every_seed(tmp_path):
    """choose_lr: the highest mean final among rates with no collapsed seed; no choice from a grid
    that has not run whole; the report states it with the runner-up's paired difference, and the
    other studies' reports say where their rate came from."""
    arms = _lr_arms({1e-4: [0.50, 0.55, 0.52], 3e-4: [0.60, 0.62, 0.58], 1e-3: [0.70, 0.75, 0.72]}, collapsed=(1e-3,))
    lr, why = stages.choose_lr(arms)
    assert lr == 3e-4 and why.startswith("the highest mean final held-out (0.600 over 3 seeds)")  # 1e-3 fell once
    assert stages.choose_lr(_lr_arms({1e-4: [0.5], 3e-4: [0.6], 1e-3: [0.7]}))[0] == 1e-3
    assert stages.choose_lr({k: v for k, v in arms.items() if "0.001" not in k})[0] is None  # a rate not run
    partial = {**arms, "MiniRL, lr 0.0001": arms["MiniRL, lr 0.0001"][:2]}
    assert stages.choose_lr(partial)[0] is None  # a seed still to run
    assert stages.choose_lr(_lr_arms({x: [0.5] for x in studies.LR_GRID}, collapsed=studies.LR_GRID))[0] is None

    study = studies.STUDIES[studies.LR_STUDY]
    sp = studies.plan(study, seeds=3, quick=False, level="e5m2")
    rows = [{"step": s, "rollout/reward_mean": 0.3, "train/entropy": 1.0, "train/kl_mu_pi_old": 1e-3,
             **({"heldout/avg@4": 0.4} if s % 5 == 0 else {})} for s in range(1, 11)]
    res = {"e5m2": {name: [{**r, "rows": rows} for r in runs] for name, runs in arms.items()}}
    text = study_report.write_report(study, sp, res, None, tmp_path).read_text()
    assert "## Verdicts" not in text and "| 0.0003 (chosen) | 0.600, 0.620, 0.580 |" in text
    assert "Chosen: **train.lr = 0.0003**" in text and "grid's" not in text.split("Chosen:")[1].split("\n")[0]
    edge = "\n".join(stages.lr_lines(_lr_arms({1e-4: [0.6], 3e-4: [0.5], 1e-3: [0.4]})))
    assert "It is the grid's lowest: a lower rate was not tried." in edge
    assert "Against the next best (0.0001): mean paired held-out difference +0.077" in text
    assert stages.record_lr_choice(tmp_path, res["e5m2"], tmp_path / "report.md") == 3e-4
    choice = stages.chosen_lr(tmp_path)
    assert choice["lr"] == 3e-4 and choice["seeds"] == 3
    assert stages.record_lr_choice(tmp_path / "none", partial, tmp_path / "r.md") is None
    assert stages.chosen_lr(tmp_path / "none") is None  # nothing recorded before the grid ran whole

    is_ = studies.STUDIES["is"]
    assert "Chosen on the MiniRL control arm by the lr study" in stages.lr_source(is_, choice, [3e-4])
    assert stages.lr_source(is_, choice, [1e-4]) == ("learning rate 0.0001 in every arm (NOT the lr study's choice, "
                                                      "0.0003: these runs predate it or the recipe was changed after)")
    assert stages.lr_source(study, choice, [1e-4, 3e-4, 1e-3]).startswith("learning rates 0.0001, 0.0003, 0.001, one an")
    assert "Not tuned on this miniature" in stages.lr_source(is_, None, [3e-4])


def test_some_arms_take_the_comparisons_among_them_and_a_follow_up_declares_them():
    off = studies.STUDIES["offpolicy"]
    sub = studies.with_arms(off, ["clip + R3", "no clip", "clip"])
    assert [a[0] for a in sub.arms] == ["no clip", "clip", "clip + R3"]  # the study's order, not the caller's
    assert [(c.a, c.b) for c in sub.comparisons] == [("clip", "no clip"), ("clip + R3", "clip")]  # F5 needs clip + R2
    sp = studies.plan(sub, seeds=5, quick=False, level="e5m2", dose_seeds=2)
    assert {a.name for a in sp.arms} == {"no clip", "clip", "clip + R3"} and len(sp.todo()) == 3 * 5 + 3 * 4 * 2
    with pytest.raises(ValueError, match=re.escape("'clip+R3' is not an arm of the offpolicy study")):
        studies.with_arms(off, ["clip", "clip+R3"])
    with pytest.raises(ValueError, match="no comparison of the offpolicy study has both its arms there"):
        studies.with_arms(off, ["clip", "clip + R2"])
    assert [a[0] for a in studies.with_arms(off, ["clip + R3", "R3, no clip"]).arms] == ["clip + R3", "R3, no clip"]
    is_ = studies.STUDIES["is"]
    declared = stages.declare_follow_up(is_, "nvfp4", seeds=5, report="r.md", dial=studies.DIAL,
                                         arms=["MiniRL", "w/o IS"])
    follow = stages.follow_up_study(is_, declared)
    assert [a[0] for a in follow.arms] == ["MiniRL", "w/o IS"] and follow.level == "nvfp4"
    assert [c.claim for c in follow.comparisons] == ["without IS correction on-policy training collapses",
                                                     "MiniRL ends higher than without IS"]
    assert "arms" not in stages.declare_follow_up(is_, "nvfp4", seeds=5, report="r.md", dial=studies.DIAL)
    with pytest.raises(ValueError, match="not an arm"):
        stages.declare_follow_up(is_, "nvfp4", seeds=5, report="r.md", dial=studies.DIAL, arms=["MiniRL", "IS"])


def test_a_studys_arms_are_declared_at_its_first_run_and_never_dropped(tmp_path):
    """`--arm` is declared in arms.json before the study's first run: a later session resumes with
    the same arms without naming them, may add arms, and is refused dropping one; a study begun
    before the declaration existed ran every arm; a report alone declares nothing."""
    from click.testing import CliRunner

    from cli.main import cli
    from minirl.errors import UsageError
    from minirl.lab.runner import Lab

    off = studies.STUDIES["offpolicy"]
    out = tmp_path / "ws" / "lab" / "study-offpolicy" / "full"
    out.mkdir(parents=True)

    def declared(arms, report_only=False, where=out):
        return stages.declared_arms(Lab(tmp_path / "ws", where), off, arms, report_only)

    assert declared(["clip", "no clip"], report_only=True) == ["clip", "no clip"]
    assert not (out / "arms.json").exists()
    assert declared(["clip", "no clip"]) == ["clip", "no clip"]
    assert json.loads((out / "arms.json").read_text())["arms"] == ["clip", "no clip"]
    assert declared(None) == ["clip", "no clip"]  # resumed without naming them
    with pytest.raises(UsageError, match="began with the arms clip, no clip: a later run may add arms but never drop"):
        declared(["clip"])
    assert declared(["no clip", "clip", "clip + R3"], report_only=True) == ["no clip", "clip", "clip + R3"]
    assert json.loads((out / "arms.json").read_text())["arms"] == ["clip", "no clip"]  # a report declares nothing
    assert declared(["no clip", "clip", "clip + R3"]) == ["no clip", "clip", "clip + R3"]
    assert declared(None) == ["no clip", "clip", "clip + R3"]
    legacy = tmp_path / "old"
    legacy.mkdir()
    (legacy / "state.json").write_text(json.dumps({"runs": {"offpolicy-clip/s0": "/x"}}))
    assert declared(None, where=legacy) is None
    with pytest.raises(UsageError, match="began with every arm"):
        declared(["clip"], report_only=True, where=legacy)
    assert declared([a[0] for a in off.arms], where=legacy) == [a[0] for a in off.arms]

    # through the CLI: the report of a declared study names its arms, and dropping one is refused
    (out / "arms.json").write_text(json.dumps({"arms": ["clip", "no clip"], "declared_at": "2026-11-26 10:41:00"}))
    ws = tmp_path / "ws"
    (ws / "minirl.toml").write_text(recipes.shipped("tiny-scratchpad-long").read_text())
    level = {"kl": 1e-3, "kl_spread": 0.0, "sd_spread": 0.0, "predicted": 0.4, "length": 98.0, "sd": 1.15}
    (out / "mechanism.json").write_text(json.dumps({
        "measured_at": "2026-11-26 10:40:00", "endpoint": "late", "doctor": "/x/doctor-1.json", "seeds": 3,
        "level": "e5m2", "why": "w",
        "route_flips": None, "levels": {"e5m2": level}}))
    r = CliRunner().invoke(cli, ["lab", "offpolicy", str(ws), "--report-only"])
    assert r.exit_code == 0, r.output
    text = (out / "report.md").read_text()
    assert "2 arms (of its 6, chosen with --arm before the first run)" in text
    assert "without clipping off-policy training collapses | no clip − clip |" in text and "| F5 |" not in text
    r = CliRunner().invoke(cli, ["lab", "offpolicy", str(ws), "--report-only", "--arm", "clip + R3", "--arm", "clip"])
    assert isinstance(r.exception, UsageError) and "never drop one" in str(r.exception)


def test_the_offpolicy_report_shows_how_often_the_clip_bound_per_mini_batch(tmp_path):
    """staleness_lines: per arm that clips, the clipped fraction of each mini-batch averaged over
    steps and seeds; arms without clipping (M_t ≡ 1 by construction) and on-policy runs are left out."""
    off = studies.STUDIES["offpolicy"]

    def runs(*per_mb):
        return [{"rows": [{"step": i, "loss/clip_frac_per_mb": mb} for i, mb in enumerate(seed)]} for seed in per_mb]

    arms = {"clip": runs([[0.0, 0.01, 0.03, 0.05], [0.0, 0.03, 0.05, 0.07]], [[0.0, 0.0, 0.01, 0.0]]),
            "no clip": runs([[0.0, 0.0, 0.0, 0.0]]),
            "clip + R3": runs([[0.0, 0.0, 0.0, 0.004]])}
    text = "\n".join(study_report.staleness_lines(off, arms))
    assert "| clip | 0.00e+00 | 1.33e-02 | 3.00e-02 | 4.00e-02 |" in text  # three steps over two seeds
    assert "| clip + R3 | 0.00e+00 | 0.00e+00 | 0.00e+00 | 4.00e-03 |" in text
    assert "| no clip |" not in text and "mini-batch 4 |" in text
    assert study_report.staleness_lines(studies.STUDIES["is"], {"MiniRL": runs([[0.01]])}) == []  # one mini-batch
