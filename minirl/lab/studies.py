"""`minirl lab STUDY`: one study per question of the paper, its arms run over K paired seeds, its
verdicts computed by the rules of verdicts.py, fixed before any run.

    is          F1, F3: MiniRL against "without IS", R3 against R3 without IS; a placebo pair
                with fp32 rollouts (μ = π up to kernels: the two are one algorithm there)
    offpolicy   F4, F5: N = 4 mini-batches, each the on-policy batch's size: no clip,
                clip, clip + R2, clip + R3, and R2 / R3 without clipping
    lengthnorm  F2: MiniRL against MiniRL with length normalisation
    coldstart   F6: MiniRL from cold starts stopped at two dev accuracies

The mismatch dial: before any arm runs, `minirl doctor` measures every rollout precision level
on the cold start, and the study's level is the mildest whose per-response spread of
log π(y)/μ(y) reaches MECHANISM_TARGET (choose_level): chosen by the mechanism, never by a verdict,
and kept in the study's mechanism.json. The verdicts are decided at that level; the other levels
run after it, with fewer seeds, for the dose–response.

Pairing: seed i of every arm uses `train.seed = i`, so it draws the same prompts in the same
order and the same sampling seeds; arms run seed by seed (every arm's seed 0, then seed 1, …), so
an interrupted study still holds whole pairs. One run at a time, resumable (lab.Lab's state).
The verdicts name their test, effect, interval and p-value, or the seeds' power to have seen the
paper's effect (verdicts.verdict).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from minirl.config.precisions import NAMES as PRECISIONS
from minirl.disk import atomic
from minirl.disk.store import read_summary
from minirl.lab import verdicts as v
from minirl.lab.runner import NO_CLIP, NO_IS, Cell, Lab, Plan, rows_of

# The mismatch dial: rollout.precision levels, mildest first. On the CPU `fp8` is the W8A8
# emulation (what FP8 vLLM does on CUDA); `fp8-weights` and `e5m2` (beyond the paper) are lab levels.
DIAL = PRECISIONS[1:]  # fp32 is the placebo's: the gap is kernels alone
# What the IS findings need to be visible at all: per response, log π(y)/μ(y) spreading by at
# least this much. Below it rollouts are near-typical samples of π and "without IS" is nearly
# on-policy; the paper's long responses spread by 4.5–8 (PAPER.md).
MECHANISM_TARGET = 1.0
ENDPOINT = "late"  # what a study declares from now on (verdicts.ENDPOINTS); recorded in its mechanism.json


@dataclass(frozen=True)
class Comparison:
    finding: str
    claim: str  # the paper's, in one line
    a: str  # arm names: the effect is B − A
    b: str
    kind: str  # "collapse": Fisher on collapse rates (and log-rank on time); "score": paired held-out scores
    sign: int  # the paper's direction of B − A: +1, −1, or 0 for a placebo (no difference expected)
    expect: tuple[float, float] = (0.0, 0.8)  # collapse rates (A, B) the paper's claim implies, for power
    effect: float = 0.1  # the score difference the power is stated for
    plateau: bool = False  # compare only runs whose held-out score has stopped rising (verdicts.heldout_slope)


@dataclass(frozen=True)
class Study:
    name: str
    question: str
    arms: tuple[tuple[str, tuple[str, ...], float], ...]  # (name, recipe sets, cold start's dev accuracy or 0)
    comparisons: tuple[Comparison, ...]
    steps: int = 150
    quick_steps: int = 20
    dose: bool = True  # run the other dial levels for the dose–response (F6's cold starts: no)
    eval_every: int = 0  # held-out every this many steps; 0: six evaluations a run
    level: str = ""  # a fixed rollout precision for a finding that is not about the gap; "": the dial's level
    level_why: str = "the paper's own rollouts"  # why `level` is fixed (the report's words)
    seeds: int = 5  # paired seeds per arm unless --seeds says otherwise


# The learning rate, set once on the MiniRL control arm (`minirl lab lr`) and then frozen: every
# other study's arms take the workspace recipe's, and a study refuses to start where the recipe's
# is not the one the lr study chose (cli/study.py). A factor of 3 each way around the lab
# miniatures' shipped 3e-4.
LR_STUDY = "lr"
LR_GRID = (1e-4, 3e-4, 1e-3)


OFF = ("train.minibatches=4",)  # N = 4 mini-batches, each of the on-policy batch's size (plan adds prompts_per_step)
STUDIES = {s.name: s for s in [
    Study("is", "does the token IS correction keep on-policy training stable (F1, F3)?",
          arms=(("MiniRL", (), 0.0), ("w/o IS", NO_IS, 0.0), ("R3", ("train.replay=r3",), 0.0),
                ("R3 w/o IS", ("train.replay=r3", *NO_IS), 0.0),
                ("placebo: MiniRL, fp32 rollouts", ("rollout.precision=fp32",), 0.0),
                ("placebo: w/o IS, fp32 rollouts", ("rollout.precision=fp32", *NO_IS), 0.0)),
          comparisons=(
              Comparison("F1", "without IS correction on-policy training collapses", "MiniRL", "w/o IS", "collapse", 1),
              Comparison("F1", "MiniRL ends higher than without IS", "w/o IS", "MiniRL", "score", 1),
              Comparison("F3", "R3 without IS collapses", "R3", "R3 w/o IS", "collapse", 1),
              # added after the first full study had run (its data suggested it): a test there, not evidence
              Comparison("F3", "R3 without IS ends lower than R3", "R3", "R3 w/o IS", "score", -1),
              Comparison("F3", "R3 brings no gain on-policy", "MiniRL", "R3", "score", 0),
              Comparison("placebo", "fp32 rollouts: MiniRL and w/o IS are one algorithm",
                         "placebo: MiniRL, fp32 rollouts", "placebo: w/o IS, fp32 rollouts", "score", 0))),
    Study("offpolicy", "does off-policy training need clipping and routing replay (F4, F5)?",
          arms=(("no clip", (*OFF, *NO_CLIP), 0.0), ("clip", OFF, 0.0), ("clip + R2", (*OFF, "train.replay=r2"), 0.0),
                ("clip + R3", (*OFF, "train.replay=r3"), 0.0), ("R2, no clip", (*OFF, *NO_CLIP, "train.replay=r2"), 0.0),
                ("R3, no clip", (*OFF, *NO_CLIP, "train.replay=r3"), 0.0)),
          steps=40, quick_steps=5,  # 4 updates a step: as many updates as the on-policy studies' 150 steps, near enough
          comparisons=(
              Comparison("F4", "without clipping off-policy training collapses", "clip", "no clip", "collapse", 1),
              Comparison("F4", "replay without clipping does not save it", "clip + R3", "R3, no clip", "collapse", 1),
              # F4's other half ("dropping either collapses"), missing from the study until both
              # of its stages had run (where clip never collapsed): recorded, not yet tested on seeds of its own
              Comparison("F4", "without routing replay clipped off-policy training collapses", "clip + R3", "clip",
                         "collapse", 1),
              Comparison("F5", "at N = 4, R3 ends higher than R2", "clip + R2", "clip + R3", "score", 1))),
    Study("lengthnorm", "does length normalisation cost accuracy (F2)?",
          arms=(("MiniRL", (), 0.0), ("length norm", ("loss.length_norm=true",), 0.0)),
          comparisons=(Comparison("F2", "length normalisation ends lower", "MiniRL", "length norm", "score", -1),),
          dose=False),
    Study("coldstart", "do different cold starts end alike (F6)?",
          arms=(("cold start @10%", (), 0.1), ("cold start @40%", (), 0.4)),
          comparisons=(Comparison("F6", "cold starts end alike", "cold start @10%", "cold start @40%", "score", 0,
                                  plateau=True),),
          steps=400, eval_every=25, dose=False,  # to a plateau: the 150 steps of the first lab were not
          level="fp8"),  # "once stable" under the paper's own FP8 rollouts: F6 asks about starts, not the gap
    Study(LR_STUDY, "at which learning rate does the MiniRL control arm learn best? (set once, then frozen for every "
                    "arm of the other studies)",
          arms=tuple((f"MiniRL, lr {x:g}", (f"train.lr={x:g}",), 0.0) for x in LR_GRID),
          comparisons=(), dose=False, seeds=3),  # a choice, not a finding: ranked by choose_lr's rule
]}


def measured_dial(measured: dict[str, dict]) -> tuple[str, ...]:
    """The dial's levels a study's doctor measured, mildest first: a study measured before a level
    existed keeps its own dial (its level and dose–response never grow)."""
    return tuple(lvl for lvl in DIAL if lvl in measured)


def choose_level(measured: dict[str, dict]) -> tuple[str, str]:
    """The study's dial level from the doctor's figures alone (never from an arm's result): the
    mildest level whose per-response spread reaches MECHANISM_TARGET, else the widest there is.

    >>> choose_level({"bf16": {"sd": 0.1}, "fp8-weights": {"sd": 0.4}, "fp8": {"sd": 1.2}, "e5m2": {"sd": 2.0}})[0]
    'fp8'
    """
    dial = measured_dial(measured)
    for level in dial:
        if measured[level]["sd"] >= MECHANISM_TARGET:
            return level, (f"the mildest level whose per-response spread reaches {MECHANISM_TARGET:g} "
                           f"({measured[level]['sd']:.2f})")
    widest = max(dial, key=lambda lvl: measured[lvl]["sd"])
    return widest, (f"no level reaches {MECHANISM_TARGET:g}: the widest ({measured[widest]['sd']:.2f}), at which "
                    f"the IS findings may not show")


def mechanism(lab: Lab, *, seeds: int, progress: Callable[[str], None] = lambda s: None) -> dict:
    """The dial measured once, before any arm runs: `minirl doctor` on the cold start at every
    level; kept in the study's mechanism.json, with the endpoint the study is decided on, and never
    measured again in that folder, so the level and the endpoint are fixed before any verdict exists."""
    path = lab.out / "mechanism.json"
    if path.exists():
        return json.loads(path.read_text())
    if lab.state["runs"]:
        raise RuntimeError(f"{lab.out} holds runs but no mechanism.json: start the study in a fresh folder")
    progress("the mismatch dial: minirl doctor on the cold start")
    out, log = lab.out / "doctor", lab.out / "logs" / "doctor.log"
    rc = lab.minirl(["doctor", "-w", str(lab.ws_root), "--checkpoint", "coldstart", "--seeds", str(seeds),
                     "--out", str(out)], log).returncode
    reports = sorted(out.glob("doctor-*.json"))
    if rc != 0 or not reports:
        raise RuntimeError(f"minirl doctor failed (exit {rc}); see {log}")
    fig = json.loads(reports[-1].read_text())["figures"]
    measured = {lvl: {"kl": fig[f"kl/{lvl}"]["mean"], "kl_spread": fig[f"kl/{lvl}"]["spread"],
                      "sd": fig[f"response_sd/{lvl}"]["mean"], "sd_spread": fig[f"response_sd/{lvl}"]["spread"],
                      "predicted": fig[f"response_sd_predicted/{lvl}"]["mean"], "length": fig[f"length/{lvl}"]["mean"],
                      "route_flips": fig.get(f"routing/tokens_with_a_flip/{lvl}", {}).get("mean")}
                for lvl in PRECISIONS if f"kl/{lvl}" in fig}
    level, why = choose_level(measured)
    mech = {"measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "endpoint": ENDPOINT, "doctor": str(reports[-1]),
            "seeds": seeds,
            "levels": measured, "level": level, "why": why,
            "route_flips": fig["routing/disagree"]["mean"] if "routing/disagree" in fig else None}
    atomic.write_text(path, json.dumps(mech, indent=1))
    return mech


def study_endpoint(mech: dict) -> str:
    """The final score the study declared with its dial (verdicts.ENDPOINTS); a study declared
    before the "late" endpoint existed keeps the last evaluation it was declared with."""
    return mech.get("endpoint", "last")


def study_level(study: Study, mech: dict) -> tuple[str, str]:
    """The level the study's verdicts are decided at, and why: its own where it fixes one, else the
    dial's (chosen by the mechanism alone, choose_level)."""
    if study.level:
        return study.level, f"fixed by the study: {study.level_why}, not the dial's {mech['level']}"
    return mech["level"], mech["why"]


@dataclass(frozen=True)
class Arm:
    """One arm of the study at one dial level."""

    name: str
    level: str  # the dial level, or the arm's own precision (the placebo's fp32)
    cell: Cell
    seeds: int
    primary: bool  # at the study's level: the verdicts are decided on these


@dataclass(frozen=True)
class StudyPlan:
    plan: Plan  # the schedule every run shares (lab.run_cell)
    level: str
    arms: list[Arm]
    first_seed: int = 0  # seed i of an arm runs with train.seed = first_seed + i
    endpoint: str = ENDPOINT  # a run's final score (verdicts.ENDPOINTS), as its study declared it

    def todo(self) -> list[tuple[Arm, int]]:
        """The study's level first, seed by seed (every arm's seed 0, then seed 1, …), so pairs
        complete in order; then each other level, mildest first, seed by seed."""
        groups = [[a for a in self.arms if a.primary]]
        groups += [[a for a in self.arms if not a.primary and a.level == lvl] for lvl in DIAL]
        out = []
        for arms in groups:
            for s in range(max((a.seeds for a in arms), default=0)):
                out += [(a, self.first_seed + s) for a in arms if s < a.seeds]
        return out


def plan(study: Study, *, seeds: int, quick: bool, level: str, dose_seeds: int = 0, prompts: int = 16,
         first_seed: int = 0, dial: tuple[str, ...] = DIAL, endpoint: str = ENDPOINT) -> StudyPlan:
    """The study's arms as cells of a lab plan: every arm at `level` over `seeds`, and, for a
    dose–response, at every other dial level over `dose_seeds` (an arm that sets its own precision,
    the placebo, runs once). `prompts`: the workspace's prompts per on-policy step; an off-policy
    arm's N mini-batches are each that size, so every arm updates on equal mini-batches. One
    folder per study: runs are never shared. `first_seed`: where the seeds start (a confirmation
    stage's are fresh, CONFIRM_FIRST_SEED on). `dial`: the levels the study's doctor measured
    (a study measured before a level existed does not grow it). `endpoint`: the final score the
    study declared (study_endpoint)."""
    steps = study.quick_steps if quick else study.steps
    arms = []
    for name, sets, acc in study.arms:
        n = next((int(x.split("=", 1)[1]) for x in sets if x.startswith("train.minibatches=")), 1)
        sets = (*sets, f"train.prompts_per_step={n * prompts}") if n > 1 else sets
        own = any(x.startswith("rollout.precision=") for x in sets)
        levels = [level] if own or not study.dose or dose_seeds == 0 else [level, *(x for x in dial if x != level)]
        for lvl in levels:
            at = sets if own else (f"rollout.precision={lvl}", *sets)
            tag = next(x.split("=", 1)[1] for x in at if x.startswith("rollout.precision="))
            arms.append(Arm(name, tag, Cell(f"{study.name} @ {tag}", name, at, cold_start=acc),
                            seeds if lvl == level else dose_seeds, lvl == level))
    every = study.eval_every if study.eval_every and not quick else max(5, steps // 6)
    p = Plan(steps=steps, eval_every=every, seeds=seeds, cells=[a.cell for a in arms])
    return StudyPlan(p, level, arms, first_seed, endpoint)


def run(lab: Lab, study: Study, sp: StudyPlan, *, on_run: Callable[[str, int, int], None] = lambda *a: None,
        progress: Callable[[str], None] = lambda s: None) -> None:
    todo = sp.todo()
    for i, (arm, seed) in enumerate(todo):
        if lab.finished(arm.cell, seed, sp.plan):
            continue  # a resumed study: said once, when it ran
        on_run(f"{study.name}: {arm.name} @ {arm.level} (seed {seed})", i, len(todo))
        lab.run_cell(arm.cell, seed, sp.plan, progress=progress)
    on_run("done", len(todo), len(todo))


def arm_results(lab: Lab, sp: StudyPlan) -> dict[str, dict[str, list[dict]]]:
    """Per dial level, per arm, per seed run so far: its key in the lab's state, collapse step
    (verdicts.collapse_step), held-out start, final score (the study's endpoint) and last evaluation. The study's own level also holds the arms that set their own precision."""
    out: dict[str, dict[str, list[dict]]] = {}
    for arm in sp.arms:
        for s in range(sp.first_seed, sp.first_seed + arm.seeds):
            key = f"{arm.cell.id}/s{s}"
            if key not in lab.state["runs"]:
                continue
            run = Path(lab.state["runs"][key])
            summary = read_summary(run)
            metric = summary["heldout"]["metric"]
            start, last = summary["heldout"]["start"][metric], summary["heldout"]["end"][metric]
            rows = rows_of(run)
            end = last
            if sp.endpoint == "late" and (late := v.late_score(rows, end=end)) is not None:
                end = late
            out.setdefault(sp.level if arm.primary else arm.level, {}).setdefault(arm.name, []).append({
                "key": key, "seed": s, "collapse": v.collapse_step(rows, heldout_start=start), "start": start,
                "final": end, "last": last,
                "steps": rows[-1]["step"] if rows else 0, "rows": rows, "lr": summary["recipe"]["train"]["lr"],
                "slope": v.heldout_slope(rows)})
    return out


def primary_runs(lab: Lab, sp: StudyPlan) -> dict[str, Path]:
    """The study's runs at its own level so far, by their key in the lab's state."""
    return {key: Path(lab.state["runs"][key]) for arm in sp.arms if arm.primary
            for s in range(sp.first_seed, sp.first_seed + arm.seeds)
            if (key := f"{arm.cell.id}/s{s}") in lab.state["runs"]}


class Decision(NamedTuple):
    cmp: Comparison
    text: str
    needed: int = 0  # seeds per arm for power 0.8, where the verdict is "not observed" for want of them


def decide(study: Study, res: dict[str, list[dict]]) -> list[Decision]:
    """Each comparison's verdict on the seeds both arms have (paired by seed)."""
    out = []
    for cmp in study.comparisons:
        a, b = ({r["seed"]: r for r in res.get(arm, [])} for arm in (cmp.a, cmp.b))
        seeds = sorted(a.keys() & b.keys())
        if not seeds:
            out.append(Decision(cmp, "not run yet"))
            continue
        n = len(seeds)
        if cmp.kind == "collapse":
            ca, cb = [a[s]["collapse"] is not None for s in seeds], [b[s]["collapse"] is not None for s in seeds]
            evidence = v.collapse_rates(ca, cb)
            steps = max(max(a[s]["steps"], b[s]["steps"]) for s in seeds)
            timing = v.time_to_collapse([a[s]["collapse"] for s in seeds], [b[s]["collapse"] for s in seeds],
                                        steps=steps)
            power = v.power_collapse(n, *cmp.expect)
            needed = v.seeds_for_power(lambda k: v.power_collapse(k, *cmp.expect))
            text = v.verdict(evidence, claim_sign=cmp.sign, power=power, seeds_needed=needed)
            text += f"; time to collapse: {timing.text()} (log-rank)"
        elif cmp.plateau and (rising := still_rising({cmp.a: [a[s] for s in seeds], cmp.b: [b[s] for s in seeds]})):
            out.append(Decision(cmp, f"not yet converged: {rising}"))
            continue
        else:
            fa, fb = [a[s]["final"] for s in seeds], [b[s]["final"] for s in seeds]
            evidence = v.paired_scores(fa, fb)
            sd = statistics.stdev(y - x for x, y in zip(fa, fb)) if n > 1 else math.inf
            power = v.power_paired(n, cmp.effect, sd)
            needed = v.seeds_for_power(lambda k: v.power_paired(k, cmp.effect, sd))
            text = v.verdict(evidence, claim_sign=cmp.sign, power=power, placebo=cmp.finding == "placebo",
                             seeds_needed=needed)
        short = evidence.p >= v.ALPHA and power < v.POWER and cmp.finding != "placebo"
        out.append(Decision(cmp, text, needed if short else 0))
    return out


def with_arms(study: Study, names: list[str]) -> Study:
    """The study cut down to some of its arms and the comparisons among them (`--arm`): where a
    machine affords fewer runs, which comparisons to test is chosen before the first run, rather
    than every arm cut short of the seeds a verdict needs."""
    known = [a[0] for a in study.arms]
    if unknown := [n for n in names if n not in known]:
        raise ValueError(f"--arm {unknown[0]!r} is not an arm of the {study.name} study "
                         f"({', '.join(repr(k) for k in known)})")
    comparisons = tuple(c for c in study.comparisons if {c.a, c.b} <= set(names))
    if study.comparisons and not comparisons:
        raise ValueError(f"--arm {' --arm '.join(repr(n) for n in names)}: no comparison of the {study.name} study "
                         f"has both its arms there")
    return replace(study, arms=tuple(a for a in study.arms if a[0] in names), comparisons=comparisons)


def still_rising(arms: dict[str, list[dict]]) -> str:
    """Why the arms have not plateaued ("" when they have): an arm's held-out slope over the second
    half of its runs at or above verdicts.PLATEAU_SLOPE on average and above 0 across seeds
    (verdicts.still_rising), or too few evaluations to tell. A bound alone does not do: one run's
    slope over 8 evaluations is uncertain by about the bound itself (docs/results/lab.md)."""
    out = []
    for name, runs in arms.items():
        slopes = [r.get("slope") for r in runs]
        if any(x is None for x in slopes):
            out.append(f"{name}: fewer than {v.PLATEAU_MIN_EVALS} held-out evaluations in the runs' second half")
        elif (rise := v.still_rising(slopes))[0] >= v.PLATEAU_SLOPE and rise[1] < v.ALPHA:
            out.append(f"{name}: held-out still rising by {rise[0]:+.3f} per 100 steps (bound {v.PLATEAU_SLOPE}; "
                       f"p = {rise[1]:.2g} across {len(slopes)} seed(s))")
    return "; ".join(out)


def runs_summary(runs: list[dict]) -> str:
    finals = [r["final"] for r in runs]
    spread = f" [{min(finals):.3f}, {max(finals):.3f}]" if len(finals) > 1 else ""  # one seed has no range
    return (f"{statistics.fmean(finals):.3f}{spread}, "
            f"{sum(r['collapse'] is not None for r in runs)}/{len(runs)} collapsed")
