"""Which runs a `minirl lab` command does, and the lab's rules over them: a study's first stage,
its confirmation stage or a follow-up at another dial level, each declared once on disk before any
of its runs (confirm/confirm.json, at-LEVEL/at.json) and never changed after; the learning rate
chosen once by the lr study and then frozen. The CLI prints what a Stage says and runs it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager

from minirl.disk import atomic
from minirl.disk.files import read_json
from minirl.errors import UsageError
from minirl.lab import stages, studies
from minirl.lab import verdicts as v
from minirl.lab.runner import Lab
from minirl.lab.studies import Study, StudyPlan

# what measures the study's mismatch dial (the doctor on the cold start) says how far it is through
Measuring = Callable[[], ContextManager[Callable[[str], None]]]


@contextlib.contextmanager
def _silent():
    yield lambda what: None


@dataclass
class Stage:
    """One declared stage of a study: its runs (`plan`) in `lab`, decided at the dial level the
    first stage measured (`mech`); `headline` is what it says before its runs."""

    lab: Lab
    study: Study
    plan: StudyPlan
    mech: dict
    headline: str
    confirmation: dict | None = None
    follow_up: dict | None = None


def study_lab(ws_root: Path, study: Study, quick: bool) -> Lab:
    return Lab(ws_root, ws_root / "lab" / f"study-{study.name}" / ("quick" if quick else "full"))


def check_lr_frozen(ws_root: Path, recipe_path: Path, lr: float) -> None:
    """The learning rate is set once, on the MiniRL control arm (`minirl lab lr`), and then frozen:
    a study whose workspace recipe has another refuses to start."""
    choice = stages.chosen_lr(ws_root)
    if choice is not None and choice["lr"] != lr:
        raise UsageError(f"the lr study chose train.lr = {choice['lr']:g} on the MiniRL control arm; {recipe_path} "
                         f"has {lr:g}: set it there (every study's arms take the recipe's)")


def first_stage(ws_root: Path, study: Study, arms: list[str] | None, *, quick: bool, seeds: int | None,
                dose_seeds: int, prompts: int, report_only: bool, measuring: Measuring = _silent) -> Stage:
    lab_ = study_lab(ws_root, study, quick)
    mech_path = lab_.out / "mechanism.json"
    if report_only and not mech_path.exists():
        raise UsageError(f"no study at {lab_.out}: run `minirl lab {study.name} {ws_root}` first")
    if not report_only:
        lab_.hold()  # before the arms' declaration: one writer declares it
    if declared := stages.declared_arms(lab_, study, arms, report_only):
        study = studies.with_arms(study, declared)
    seeds = seeds or (2 if quick else study.seeds)
    if not report_only:
        with measuring() as progress:
            studies.mechanism(lab_, seeds=1 if quick else 3, progress=progress)
    mech = read_json(mech_path, "the study's mismatch dial")
    level, why = studies.study_level(study, mech)
    sp = studies.plan(study, seeds=seeds, quick=quick, level=level, dose_seeds=0 if quick else dose_seeds,
                      prompts=prompts, dial=studies.measured_dial(mech["levels"]),
                      endpoint=studies.study_endpoint(mech))
    return Stage(lab_, study, sp, mech, f"rollout precision: {level} ({why})")


def confirmation(ws_root: Path, study: Study, *, quick: bool, prompts: int, report_only: bool) -> Stage | str:
    """The study's confirmation stage (stages.declare_confirmation), declared from the first
    stage's runs; or, where there is nothing to confirm, the sentence that says so."""
    first = study_lab(ws_root, study, quick)
    if not (first.out / "mechanism.json").exists():
        raise UsageError(f"no study at {first.out}: run `minirl lab {study.name} {ws_root}` first")
    mech = read_json(first.out / "mechanism.json", "the study's mismatch dial")
    level, _ = studies.study_level(study, mech)
    lab_ = Lab(ws_root, first.out / "confirm")
    path = lab_.out / "confirm.json"
    if report_only and not path.exists():
        raise UsageError(f"no confirmation stage at {lab_.out}: run `minirl lab {study.name} {ws_root} --confirm`")
    if not report_only:
        lab_.hold()  # before the declaration: one writer declares it
    if not path.exists():
        sp1 = studies.plan(study, seeds=v.SEEDS_MOST, quick=quick, level=level, prompts=prompts,
                           endpoint=studies.study_endpoint(mech))
        res1 = studies.arm_results(first, sp1).get(level, {})
        if why := stages.unpaired(study, res1):
            raise UsageError(f"the study at {first.out} has not finished ({why}): finish it before confirming")
        declared = stages.declare_confirmation(study, studies.decide(study, res1), report=str(first.out / "report.md"))
        if declared is None:
            return ("nothing to confirm: every verdict is significant, already powered, or needs more than "
                    f"{v.SEEDS_MOST} seeds")
        atomic.write_text(path, json.dumps(declared, indent=1))
    declared = read_json(path, "the confirmation stage's declaration")
    sub = stages.confirmation_study(study, declared)
    sp = studies.plan(sub, seeds=declared["seeds"], quick=quick, level=level, prompts=prompts,
                      first_seed=declared["first_seed"], endpoint=studies.study_endpoint(mech))
    headline = (f"confirmation stage: {', '.join(f'{f} ({c})' for f, c in declared['comparisons'])}; "
                f"{declared['seeds']} fresh seeds per arm at {level}")
    return Stage(lab_, sub, sp, mech, headline, confirmation=declared)


def follow_up(ws_root: Path, study: Study, *, level: str, quick: bool, seeds: int | None, arms: list[str] | None,
              prompts: int, report_only: bool, measuring: Measuring = _silent) -> Stage:
    """A study's follow-up at another level of its measured dial (stages.declare_follow_up):
    declared once, in at-LEVEL/at.json, before any of its runs; its seeds and arms never change."""
    first = study_lab(ws_root, study, quick)
    if not (first.out / "mechanism.json").exists():
        if report_only:
            raise UsageError(f"no study at {first.out}: run `minirl lab {study.name} {ws_root}` first")
        try:  # what the dial cannot change is refused before the doctor runs
            stages.declare_follow_up(study, level, seeds=1, report="", dial=(level,), arms=arms)
        except ValueError as e:
            raise UsageError(str(e)) from None
        first.hold()
        with measuring() as progress:
            # no first stage here (a dose–response elsewhere prompted the test): the study's dial,
            # measured as its first stage would and kept for it
            studies.mechanism(first, seeds=1 if quick else 3, progress=progress)
    mech = read_json(first.out / "mechanism.json", "the study's mismatch dial")
    if level == studies.study_level(study, mech)[0]:
        raise UsageError(f"{level} is the study's own level: more seeds there are a confirmation stage (--confirm)")
    lab_ = Lab(ws_root, first.out / f"at-{level}")
    path = lab_.out / "at.json"
    if report_only and not path.exists():
        raise UsageError(f"no follow-up at {lab_.out}: run `minirl lab {study.name} {ws_root} --at {level}`")
    try:  # refused before anything is written
        declared = stages.declare_follow_up(study, level, seeds=seeds or (2 if quick else 5),
                                            report=str(first.out / "report.md") if first.state["runs"] else "",
                                            dial=studies.measured_dial(mech["levels"]), arms=arms)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not report_only:
        lab_.hold()  # before the declaration: one writer declares it
    if not path.exists():
        atomic.write_text(path, json.dumps(declared, indent=1))
    declared = read_json(path, "the follow-up's declaration")
    if seeds is not None and seeds != declared["seeds"]:
        raise UsageError(f"the follow-up at {level} was declared with {declared['seeds']} seeds per arm; "
                         f"its seeds do not change after its first run")
    if arms is not None and arms != declared.get("arms"):
        raise UsageError(f"the follow-up at {level} was declared with "
                         f"{'the arms ' + ','.join(declared['arms']) if declared.get('arms') else 'every arm'}; "
                         f"its arms do not change after its first run")
    sub = stages.follow_up_study(study, declared)
    sp = studies.plan(sub, seeds=declared["seeds"], quick=quick, level=level, prompts=prompts,
                      first_seed=declared["first_seed"], endpoint=declared["endpoint"])
    headline = (f"follow-up at {level}: {', '.join(a[0] for a in sub.arms)}; {declared['seeds']} fresh seeds per "
                f"arm (train.seed {declared['first_seed']} on)")
    return Stage(lab_, sub, sp, mech, headline, follow_up=declared)
