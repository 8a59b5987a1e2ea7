"""What a study declares and what follows its first stage (`minirl lab STUDY`): the arms it runs
(`--arm`, declared at its first run, widened never narrowed), the learning rate the lr study
chooses and freezes for every other study, the confirmation stage (`--confirm`: the comparisons
short of power, on as many fresh seeds as power 0.8 needs) and the follow-up at another level of
the dial (`--at LEVEL`), each declared before its first run and decided on its own seeds alone.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from minirl.disk import atomic
from minirl.disk.files import read_json
from minirl.errors import UsageError
from minirl.lab import verdicts as v
from minirl.lab.runner import Lab
from minirl.lab.studies import ENDPOINT, LR_GRID, LR_STUDY, Decision, Study, runs_summary, with_arms


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
        lines.append(f"| {lr:g}{' (chosen)' if lr == chosen else ''} | {finals} | {runs_summary(runs)} |")
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


def declared_arms(lab_: Lab, study: Study, arms: list[str] | None, report_only: bool) -> list[str] | None:
    """The study's arms (`--arm`'s names; None: every arm), declared in `arms.json` at its first
    run. Later runs may add arms (the new ones join the same seeds) but never drop one, so that no
    session picks arms by how they came out; a resumed study may leave `--arm` out. A study that
    ran before the declaration existed ran every arm."""
    path = lab_.out / "arms.json"
    if path.exists():
        declared = read_json(path, "the study's arms")
    elif lab_.state["runs"]:
        declared = {"arms": None}  # begun before arms were declared: every arm
    elif report_only:
        return arms  # nothing has run, nothing to declare
    else:
        atomic.write_text(path, json.dumps({"arms": arms, "declared_at": time.strftime("%Y-%m-%d %H:%M:%S")}))
        return arms
    if arms is None:
        return declared["arms"]
    had = set(declared["arms"] or [a[0] for a in study.arms])
    if not had <= set(arms):
        what = "the arms " + ", ".join(declared["arms"]) if declared["arms"] else "every arm"
        raise UsageError(f"the {study.name} study in {lab_.out} began with {what}: a later run may add arms but "
                         f"never drop one (leave --arm out to resume it)")
    if not report_only and had != set(arms):  # widened (the same arms in another order change nothing)
        widened = {**declared, "arms": arms, "widened_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        atomic.write_text(path, json.dumps(widened))
    return arms
