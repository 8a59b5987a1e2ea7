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

from minirl import atomic, rescore
from minirl import verdicts as v
from minirl.lab import NO_CLIP, NO_IS, Cell, Lab, Plan, rows_of
from minirl.recipe import PRECISIONS

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
    p = Plan(steps=steps, eval_every=every, seeds=seeds, offpolicy_n=(4,), cold_start_targets=(),
             cells=[a.cell for a in arms])
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
            summary = json.loads((run / "summary.json").read_text())
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
        elif cmp.plateau and (rising := _still_rising({cmp.a: [a[s] for s in seeds], cmp.b: [b[s] for s in seeds]})):
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


def choose_lr(arms: dict[str, list[dict]], grid: tuple[float, ...] = LR_GRID) -> tuple[float | None, str]:
    """The lr study's rule, fixed before its first run: the learning rate whose MiniRL arm ends
    highest (mean final held-out over its seeds) among the arms none of whose seeds collapsed;
    None until every rate of `grid` has run the same seeds.

    >>> run = lambda lr, *finals: [{"seed": i, "lr": lr, "final": f, "collapse": None} for i, f in enumerate(finals)]
    >>> choose_lr({"a": run(1e-4, 0.5, 0.6), "b": run(3e-4, 0.7, 0.6), "c": run(1e-3, 0.9, 0.1)})[0]
    0.0003
    """
    if ({runs[0]["lr"] for runs in arms.values()} != set(grid)
            or len({tuple(r["seed"] for r in runs) for runs in arms.values()}) != 1):
        return None, "not every learning rate has run the same seeds yet"
    stable = {runs[0]["lr"]: statistics.fmean(r["final"] for r in runs) for runs in arms.values()
              if all(r["collapse"] is None for r in runs)}
    if not stable:
        return None, "every learning rate collapsed in some seed: widen the grid downwards"
    best = max(stable, key=stable.get)
    return best, (f"the highest mean final held-out ({stable[best]:.3f} over {len(next(iter(arms.values())))} seeds) "
                  f"among the learning rates that never collapsed")


def lr_lines(arms: dict[str, list[dict]]) -> list[str]:
    """The lr study's choice and what it rests on: each rate's finals, and the chosen rate against
    the next best, paired by seed (how far apart the two are; the rule does not wait on it)."""
    chosen, why = choose_lr(arms)
    by_lr = {runs[0]["lr"]: runs for runs in sorted(arms.values(), key=lambda runs: runs[0]["lr"])}
    lines = ["## The learning rate", "", "| learning rate | final held-out per seed | mean, collapses |", "|---|---|---|"]
    for lr, runs in by_lr.items():
        finals = ", ".join(f"{r['final']:.3f}" for r in runs)
        lines.append(f"| {lr:g}{' (chosen)' if lr == chosen else ''} | {finals} | {_summary(runs)} |")
    if chosen is None:
        return [*lines, "", f"No choice yet: {why}."]
    edge = (" It is the grid's lowest: a lower rate was not tried." if chosen == min(by_lr) else
            " It is the grid's highest: a higher rate was not tried." if chosen == max(by_lr) else "")
    lines += ["", f"Chosen: **train.lr = {chosen:g}**, {why}.{edge} Set it in the workspace's minirl.toml before "
              f"any other study runs there: they refuse a recipe whose learning rate is not this one."]
    mean = {lr: statistics.fmean(r["final"] for r in runs) for lr, runs in by_lr.items()
            if lr != chosen and all(r["collapse"] is None for r in runs)}  # the next best by the same rule
    if mean and len(by_lr[chosen]) > 1:
        runner = max(mean, key=mean.get)
        ev = v.paired_scores([r["final"] for r in by_lr[runner]], [r["final"] for r in by_lr[chosen]])
        lines.append(f"Against the next best ({runner:g}): {ev.text()}.")
    return lines


def lr_choice_path(ws_root: Path) -> Path:
    return Path(ws_root) / "lab" / f"study-{LR_STUDY}" / "full" / "chosen.json"


def record_lr_choice(ws_root: Path, arms: dict[str, list[dict]], report: Path) -> float | None:
    """Once the lr study has run every seed: its choice, where the other studies read it (chosen_lr)."""
    lr, why = choose_lr(arms)
    if lr is not None:
        lr_choice_path(ws_root).parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(lr_choice_path(ws_root), json.dumps(
            {"lr": lr, "why": why, "seeds": len(next(iter(arms.values()))), "report": str(report),
             "chosen_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return lr


def chosen_lr(ws_root: Path) -> dict | None:
    """What the workspace's lr study chose (record_lr_choice), or None where it has not finished."""
    path = lr_choice_path(ws_root)
    return json.loads(path.read_text()) if path.exists() else None


def lr_source(study: Study, choice: dict | None, lrs: list[float]) -> str:
    """The study's learning rate and where it came from, for its report."""
    rates = ", ".join(f"{x:g}" for x in lrs) or "of the recipe"
    if study.name == LR_STUDY:
        return f"learning rates {rates}, one an arm (the grid's; the rest of the recipe the workspace's)"
    return f"learning rate {rates} in every arm ({_lr_origin(choice, lrs)})"


def _lr_origin(choice: dict | None, lrs: list[float]) -> str:
    if choice is None:
        return ("the workspace recipe's, set once; no arm sets it. Not tuned on this miniature: the workspace has "
                "no finished lr study (`minirl lab lr`)")
    if lrs == [choice["lr"]]:
        return (f"the workspace recipe's, set once; no arm sets it. Chosen on the MiniRL control arm by the lr study "
                f"({choice['chosen_at']}, {choice['seeds']} seeds)")
    return f"NOT the lr study's choice, {choice['lr']:g}: these runs predate it or the recipe was changed after"


# A confirmation stage: where a study's verdicts were "not observed" for want of power, the seeds
# power 0.8 needs (verdicts.seeds_for_power, from the first stage's own spread) run again as fresh
# seeds, and those comparisons are decided on the fresh seeds alone. The first stage sized the
# second and nothing more: pooling both would give each comparison a second look at α = 0.05, and
# a test repeated until it passes is not a test at α.
CONFIRM_FIRST_SEED = 1000  # the fresh seeds' train.seed: far from any first stage's 0, 1, …


def unpaired(study: Study, res: dict[str, list[dict]]) -> str:
    """Why a first stage is not finished ("" when it is): an arm with no runs, or arms with unequal
    seed counts (a stage stopped mid-seed). A confirmation sized from it would rest on the seeds
    that happened to finish.

    >>> unpaired(STUDIES["lengthnorm"], {"MiniRL": [{}, {}], "length norm": [{}]})
    'MiniRL 2, length norm 1 seeds'
    """
    counts = {name: len(res.get(name, [])) for name, _, _ in study.arms}
    if len(set(counts.values())) == 1 and 0 not in counts.values():
        return ""
    return ", ".join(f"{name} {n}" for name, n in counts.items()) + " seeds"


def declare_confirmation(study: Study, stage1: list[Decision], *, report: str) -> dict | None:
    """The confirmation stage, declared from the first stage's decisions before any of its runs:
    the comparisons short of power with a seed count within verdicts.SEEDS_MOST, their arms, and
    as many seeds as the most demanding of them needs. None when no comparison qualifies."""
    chosen = [d for d in stage1 if 0 < d.needed <= v.SEEDS_MOST]
    if not chosen:
        return None
    return {"declared_at": time.strftime("%Y-%m-%d %H:%M:%S"), "from": report,
            "seeds": max(d.needed for d in chosen), "first_seed": CONFIRM_FIRST_SEED,
            "comparisons": [[d.cmp.finding, d.cmp.claim] for d in chosen],
            "why": [f"{d.cmp.finding} ({d.cmp.claim}): {d.text}" for d in chosen]}


def confirmation_study(study: Study, declared: dict) -> Study:
    """The study cut down to the declared comparisons and the arms they compare (no dose–response)."""
    keep = {tuple(c) for c in declared["comparisons"]}
    comparisons = tuple(c for c in study.comparisons if (c.finding, c.claim) in keep)
    names = {x for c in comparisons for x in (c.a, c.b)}
    return replace(study, arms=tuple(a for a in study.arms if a[0] in names), comparisons=comparisons, dose=False)


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


# A follow-up: a study's arms on fresh seeds at another level of its measured dial, where its
# dose–response (a seed or two per level) showed something worth a test of its own. Declared in
# the follow-up's at.json before its first run; its verdicts rest on its own seeds alone, so the
# dose–response seeds that prompted it are not counted twice.
FOLLOW_UP_FIRST_SEED = 2000  # far from a first stage's 0, 1, … and a confirmation's 1000, …


def declare_follow_up(study: Study, level: str, *, seeds: int, report: str, dial: tuple[str, ...],
                      arms: list[str] | None = None) -> dict:
    """The follow-up at `level`, declared before any of its runs (at.json); `arms`: some of the
    study's arms (with_arms), else all that take the dial's precision."""
    if not study.dose:
        raise ValueError(f"the {study.name} study has no dose–response to follow up")
    if level not in dial:
        raise ValueError(f"{level} is not on the study's measured dial ({', '.join(dial)})")
    if arms:
        with_arms(study, arms)  # refused here, before anything is declared
    return {"declared_at": time.strftime("%Y-%m-%d %H:%M:%S"), "from": report, "level": level, "seeds": seeds,
            "first_seed": FOLLOW_UP_FIRST_SEED, "endpoint": ENDPOINT, **({"arms": arms} if arms else {})}


def follow_up_study(study: Study, declared: dict) -> Study:
    """The study at the declared level: its arms that take the dial's precision (the placebo sets
    its own and is the same at any level), or the declared ones, the comparisons among them, no
    dose–response."""
    if declared.get("arms"):
        study = with_arms(study, declared["arms"])
    arms = tuple(a for a in study.arms if not any(x.startswith("rollout.precision=") for x in a[1]))
    names = {a[0] for a in arms}
    return replace(study, arms=arms, comparisons=tuple(c for c in study.comparisons if {c.a, c.b} <= names),
                   dose=False, level=declared["level"],
                   level_why=f"a follow-up declared at {declared['declared_at']} after the dose–response")


def _still_rising(arms: dict[str, list[dict]]) -> str:
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


PANELS = (("rollout/reward_mean", "reward"), ("train/entropy", "token entropy"),
          ("train/kl_mu_pi_old", "KL(μ_old ‖ π_old)"), ("heldout", "held-out avg@k"))


def plot(study: Study, res: dict[str, list[dict]], out: Path) -> Path:
    """The study at a glance: reward, entropy, KL(μ_old‖π_old) and held-out per arm (mean over
    seeds, min–max band), and the share of each arm's seeds not yet collapsed (survival)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 4.0), constrained_layout=True)
    for arm, runs in res.items():
        color = None
        for ax, (key, _) in zip(axes, PANELS):
            if key == "heldout":
                series = [[(0, r["start"])] + [(x["step"], x[h]) for x in r["rows"] for h in x if h.startswith("heldout/avg@")]
                          for r in runs]
            else:
                series = [[(x["step"], x[key]) for x in r["rows"]] for r in runs]
            n = min(len(s) for s in series)
            if n == 0:
                continue
            steps = [t for t, _ in series[0][:n]]
            vals = [[s[i][1] for s in series] for i in range(n)]
            line, = ax.plot(steps, [sum(v) / len(v) for v in vals], lw=1.3, label=arm, color=color)
            color = line.get_color()
            if len(series) > 1:
                ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15)
        last = max((r["steps"] for r in runs), default=0)
        grid = range(0, last + 1)
        alive = [sum(r["collapse"] is None or r["collapse"] > t for r in runs) / len(runs) for t in grid]
        axes[-1].step(list(grid), alive, where="post", color=color, lw=1.3, label=arm)
    for ax, title in zip(axes, [t for _, t in PANELS] + ["not collapsed (share of seeds)"]):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[-1].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"minirl lab {study.name}: {study.question}")
    path = out / f"study-{study.name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_dose(study: Study, res: dict[str, dict[str, list[dict]]], mech: dict, out: Path) -> Path | None:
    """Final held-out score and collapse rate per arm against the dial, each level placed at its
    measured per-response spread of log π(y)/μ(y)."""
    levels = [lvl for lvl in DIAL if lvl in res]
    if len(levels) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = {lvl: mech["levels"][lvl]["sd"] for lvl in levels}
    fig, (score, fell) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    names = [a for a in dict.fromkeys(a for lvl in levels for a in res[lvl]) if sum(a in res[lvl] for lvl in levels) > 1]
    for name in names:  # the arms the dial moves (not the placebo's fixed fp32)
        pts = [(x[lvl], res[lvl][name]) for lvl in levels if name in res[lvl]]
        xs = [px for px, _ in pts]
        mean = [statistics.fmean(r["final"] for r in runs) for _, runs in pts]
        low = [m - min(r["final"] for r in runs) for m, (_, runs) in zip(mean, pts)]
        high = [max(r["final"] for r in runs) - m for m, (_, runs) in zip(mean, pts)]
        line = score.errorbar(xs, mean, yerr=[low, high], marker="o", capsize=3, lw=1.3, label=name)
        fell.plot(xs, [sum(r["collapse"] is not None for r in runs) / len(runs) for _, runs in pts], marker="o",
                  lw=1.3, color=line[0].get_color(), label=name)
    for ax, title in ((score, "final held-out (mean, min–max over seeds)"), (fell, "collapse rate")):
        ax.set_xscale("log")
        # slanted: levels whose spreads lie close (fp8-weights 0.37, fp8 0.41) would print over each other
        ax.set_xticks([x[lvl] for lvl in levels], [f"{lvl} ({x[lvl]:.2f})" for lvl in levels], fontsize=8,
                      rotation=30, ha="right")
        ax.minorticks_off()
        ax.axvline(MECHANISM_TARGET, color="grey", ls=":", lw=1)
        ax.set_xlabel("dial level: SD of log π(y)/μ(y) per response at the cold start")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fell.set_ylim(-0.05, 1.05)
    score.legend(fontsize=7)
    fig.suptitle(f"minirl lab {study.name}: dose–response")
    path = out / f"study-{study.name}-dose.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _summary(runs: list[dict]) -> str:
    finals = [r["final"] for r in runs]
    spread = f" [{min(finals):.3f}, {max(finals):.3f}]" if len(finals) > 1 else ""  # one seed has no range
    return (f"{statistics.fmean(finals):.3f}{spread}, "
            f"{sum(r['collapse'] is not None for r in runs)}/{len(runs)} collapsed")


def staleness_lines(study: Study, arms: dict[str, list[dict]]) -> list[str]:
    """How far the policy moved within a step's N updates, in the arms that clip: the fraction of
    tokens clipped (M_t = 0) on each mini-batch, mean over steps and seeds. Mini-batch 1 is
    on-policy to π_old (r_t = 1); the last has N − 1 updates behind it. Where it stays near 0 the
    clip seldom binds and "no clip" is nearly the algorithm "clip" is: the drift F4 is about is small."""
    clips = {name for name, sets, _ in study.arms if not set(NO_CLIP) <= set(sets)}
    table = {}
    for name, runs in arms.items():
        if name not in clips:
            continue
        per_mb = [r["loss/clip_frac_per_mb"] for run in runs for r in run["rows"]
                  if len(r.get("loss/clip_frac_per_mb", [])) > 1]
        if per_mb:
            table[name] = [statistics.fmean(x) for x in zip(*per_mb)]
    if not table:
        return []
    n = max(len(x) for x in table.values())
    return ["## How off-policy the updates were", "",
            "Tokens clipped (M_t = 0) per mini-batch of a step, mean over steps and seeds, in the arms that clip "
            "(ε_low, ε_high of the recipe): mini-batch 1 is π_old itself; the last has N − 1 updates behind it. "
            "Near 0 the clip seldom binds, and removing it can change little.", "",
            "| arm | " + " | ".join(f"mini-batch {i + 1}" for i in range(n)) + " |", "|---" * (n + 1) + "|",
            *(f"| {name} | " + " | ".join(f"{x:.2e}" for x in fr) + " |" for name, fr in table.items()), ""]


def mechanism_lines(mech: dict | None, level: tuple[str, str] | None = None) -> list[str]:
    """The dial as measured before any arm ran, and how the study's level (`level`: the level and
    why, study_level; default the dial's) was chosen."""
    if mech is None:
        return ["## The mismatch dial", "", "Not measured yet: the study measures it before its first run."]
    lines = ["## The mismatch dial, measured before any arm ran", "",
             f"`minirl doctor --checkpoint coldstart --seeds {mech['seeds']}` at {mech['measured_at']} "
             f"(`{Path(mech['doctor']).name}`): per token KL(μ‖π), per response the SD of log π(y)/μ(y) over "
             f"responses of L tokens, and the √(2·L·KL) a sum of independent tokens predicts.", "",
             "| rollout precision | KL(μ‖π) per token | SD of log π(y)/μ(y) per response | √(2·L·KL) | L | "
             "tokens with a route flip |", "|---|---|---|---|---|---|"]
    chosen, why = level or (mech["level"], mech["why"])
    for lvl, m in mech["levels"].items():
        mark = " (the study's level)" if lvl == chosen else ""
        flips = "—" if m.get("route_flips") is None else f"{m['route_flips']:.1%}"
        lines.append(f"| {lvl}{mark} | {m['kl']:.2e} ± {m['kl_spread']:.1e} | {m['sd']:.3f} ± {m['sd_spread']:.2f} | "
                     f"{m['predicted']:.2f} | {m['length']:.1f} | {flips} |")
    lines += ["", f"Level: **{chosen}**, {why} (the dial's target: {MECHANISM_TARGET:g}; the paper's long "
              f"responses: 4.5–8)."]
    if mech.get("route_flips") is not None:
        lines.append(f"Routes (top-k experts) differ between engine and trainer on {mech['route_flips']:.1%} of "
                     f"tokens per layer at the workspace's own precision; a token has a route flip when its top-k "
                     f"differs in any layer (the miniature's target: ≥ 30% of response tokens).")
    return lines


def _prompted_by(declared: dict) -> str:
    if declared["from"]:
        return f"after the first stage's dose–response (`{declared['from']}`)"
    return ("with no first stage in this workspace (its dial measured for this follow-up, as a first stage would "
            "measure it; what prompted the test is on the results page)")


def _chosen_arms(declared: dict) -> str:
    return f" ({', '.join(declared['arms'])}, chosen before its first run)" if declared.get("arms") else ""


def write_report(study: Study, sp: StudyPlan, res: dict[str, dict[str, list[dict]]], mech: dict | None,
                 out: Path, *, confirmation: dict | None = None, follow_up: dict | None = None,
                 lr_choice: dict | None = None, rescored: tuple[str, dict[str, dict]] | None = None) -> Path:
    """report.md of a study (or of its confirmation stage or a follow-up, `confirmation` or
    `follow_up` its declaration); `lr_choice`: the workspace's lr study's (chosen_lr); `rescored`:
    a precision and the runs' last checkpoints scored at it (rescore.rescore), if asked for."""
    p, here = sp.plan, res.get(sp.level, {})
    lrs = sorted({r["lr"] for arms in res.values() for runs in arms.values() for r in runs})
    stage = ": confirmation stage" if confirmation else f": follow-up at {follow_up['level']}" if follow_up else ""
    lines = [f"# minirl lab {study.name}{stage}", "", f"{study.question}", ""]
    if follow_up:
        lines += ["## Declared before its first run", "",
                  f"At {follow_up['declared_at']}, {_prompted_by(follow_up)}: "
                  f"the study's arms{_chosen_arms(follow_up)} at {follow_up['level']} on {follow_up['seeds']} "
                  f"fresh seeds per arm (train.seed "
                  f"{follow_up['first_seed']} on), decided on those alone: the dose–response's own seeds prompted "
                  f"the test and are not counted in it.", ""]
    if confirmation:
        lines += ["## Declared before its first run", "",
                  f"At {confirmation['declared_at']}, from the first stage's report (`{confirmation['from']}`): "
                  f"these comparisons were not observed for want of power, and {confirmation['seeds']} fresh seeds "
                  f"per arm (train.seed {confirmation['first_seed']} on) give the most demanding of them power {v.POWER:g} "
                  f"at the first stage's own spread. They are decided on the fresh seeds alone: the first stage "
                  f"only sized this one (pooling would look twice at α = {v.ALPHA}). A comparison reproduced here "
                  f"after failing there has had two tries: over both stages its chance of a false positive is at "
                  f"most {v.ALPHA + (1 - v.ALPHA) * v.ALPHA:.4g}.", "",
                  *(f"- {line}" for line in confirmation["why"]), ""]
    whole = STUDIES.get(study.name)
    some = (f" (of its {len(whole.arms)}, chosen with --arm before the first run)"
            if whole and len(study.arms) < len(whole.arms) and not (follow_up or confirmation) else "")
    lines += [f"{len(study.arms)} arms{some} × {max(a.seeds for a in sp.arms)} paired seed(s) at the study's level, "
             f"{p.steps} steps each, the guard observing only; held-out avg@k every {p.eval_every} steps; "
             f"{lr_source(study, lr_choice, lrs)}. Final held-out score: {v.ENDPOINTS[sp.endpoint]}"
             f"{' (declared before the late-third endpoint existed)' if sp.endpoint == 'last' else ''}. "
             f"Collapsed: the rule of `minirl/verdicts.py` (reward under "
             f"{v.COLLAPSE_REWARD_FRAC} × its best window with the entropy out of [{v.ENTROPY_LOW}, {v.ENTROPY_HIGH}] × "
             f"its start, or held-out under {v.COLLAPSE_HELDOUT_FRAC} × its start). α = {v.ALPHA}.", "",
             *mechanism_lines(mech, study_level(study, mech) if mech else None), ""]
    if study.name == LR_STUDY:  # a choice, not a finding: no comparisons
        lines += lr_lines(here)
    else:
        lines += [f"## Verdicts at {sp.level}", "", "| | the paper | B − A | verdict |", "|---|---|---|---|"]
        lines += [f"| {cmp.finding} | {cmp.claim} | {cmp.b} − {cmp.a} | {text} |" for cmp, text, _ in decide(study, here)]
    lines += ["", f"## Arms at {sp.level}", "", "| arm | seeds | collapsed | held-out start | final (per seed) |",
              "|---|---|---|---|---|"]
    for name, runs in here.items():
        finals = ", ".join(f"{r['final']:.3f}" for r in runs)
        lines.append(f"| {name} | {len(runs)} | {sum(r['collapse'] is not None for r in runs)}/{len(runs)} | "
                     f"{statistics.fmean(r['start'] for r in runs):.3f} | {finals} |")
    if study.dose:
        levels = [lvl for lvl in DIAL if lvl in res]
        names = [a.name for a in sp.arms if not a.primary]
        lines += ["", "## Dose–response", "", "Final held-out per arm and level: mean [min, max] over seeds, and "
                  "collapses.", ""]
        if len(levels) < 2:
            lines.append("Not run yet: the other levels run after the study's own.")
        else:
            heads = [f"{lvl} (SD {mech['levels'][lvl]['sd']:.2f})" if mech and lvl in mech["levels"] else lvl
                     for lvl in levels]  # each level's measured per-response spread: the dose
            lines += ["| arm | " + " | ".join(heads) + " |", "|---" * (len(levels) + 1) + "|"]
            for name in dict.fromkeys(names):
                lines.append(f"| {name} | " + " | ".join(_summary(res[lvl][name]) if name in res[lvl] else "—"
                                                      for lvl in levels) + " |")
            dose_png = plot_dose(study, res, mech, out) if mech else None
            if dose_png:
                lines += ["", f"![dose–response]({dose_png.name})"]
    if stale := staleness_lines(study, here):
        lines += ["", *stale]
    if rescored and study.name != LR_STUDY:
        lines += ["", *rescore.report_lines(study.comparisons, sp.level, here, rescored[1], rescored[0])]
        if png := rescore.plot(here, rescored[1], sp.level, rescored[0], out, f"study-{study.name}"):
            lines += ["", f"![served at {rescored[0]}]({png.name})"]
    if here:
        lines += ["", "## Figure", "", f"![the study]({plot(study, here, out).name})"]
    path = out / "report.md"
    atomic.write_text(path, "\n".join(lines) + "\n")
    return path
