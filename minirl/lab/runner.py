"""The lab's runner: each (arm, seed) of a study (studies.py) is one `minirl run` in its own
process, one at a time, on a workspace of the long-response task (`minirl init --task scratchpad`).

A lab folder's state file records every finished run with the settings that made it, so an
interrupted study resumes where it stopped (a run cut short continues from its newest checkpoint;
one whose settings changed is run again) and extra cold starts (another dev accuracy) are built
once and reused. The first version of the lab, a fixed grid of F1–F6 cells with its own report,
was retired for the studies; its results are in docs/results/lab.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from minirl.config import recipes
from minirl.config import recipe as recipe_mod
from minirl.disk import atomic
from minirl.disk.store import complete_checkpoints, has_summary, parse_metric_line
from minirl.rollout.seeding import SAMPLING
from minirl.run.runlock import RunLock
from minirl.run.status import PROCESS_FILE
from minirl.run.status import read as run_status  # a run's state, as `minirl status` reads it
from minirl.setup.workspace import init_workspace

NO_IS = ("loss.is_mode=off", "loss.allow_uncorrected=true")
NO_CLIP = ("loss.eps_low=1", "loss.eps_high=1e9")  # M_t ≡ 1: r_t never falls below 0 nor above 1e9


@dataclass(frozen=True)
class Cell:
    regime: str  # what the cell's arm belongs to, e.g. "is @ fp8" (a study at a dial level)
    variant: str
    sets: tuple[str, ...] = ()
    cold_start: float = 0.0  # dev accuracy an extra cold start stops at (F6); 0 = the workspace's own

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", f"{self.regime}-{self.variant}".lower()).strip("-")


@dataclass(frozen=True)
class Plan:
    steps: int
    eval_every: int
    seeds: int
    cells: list[Cell] = field(default_factory=list)


# ----- running -----------------------------------------------------------------------------------
def common_sets(p: Plan, seed: int) -> list[str]:
    """What every cell shares: the stress test (FP8 rollouts), the guard observing only and the schedule."""
    return ["rollout.precision=fp8", "guard.enabled=false", f"train.steps={p.steps}", f"eval.every={p.eval_every}",
            f"train.seed={seed}"]


def resumable_sets(p: Plan) -> list[str]:
    """Checkpoints often enough that a run cut short (a session's end, a kill) loses at most a
    tenth of itself: the next sweep continues it from the newest (Lab.run_cell), the only one
    kept. Not part of what makes a run its cell's: where a run saves changes nothing it computes."""
    return [f"checkpoint.every={max(1, p.steps // 10)}", "checkpoint.keep=1"]


def _legacy_free(recorded: list[str], p: Plan) -> list[str]:
    """A run recorded before resumable_sets carried "no checkpoints but the last" among its cell's
    settings; it is the same cell's run as one recorded since."""
    return [x for x in recorded if x not in (f"checkpoint.every={p.steps + 1}", "checkpoint.keep=1")]


class Lab:
    def __init__(self, ws_root: Path, out: Path):
        self.ws_root, self.out = Path(ws_root), Path(out)
        self.state_path = self.out / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {"runs": {}}

    def _save(self) -> None:
        atomic.write_text(self.state_path, json.dumps(self.state, indent=1))

    def hold(self) -> None:
        """Be this lab folder's one writer until the process ends (runlock.py): a second `minirl lab` on
        it is refused in one line. The report alone (`--report-only`) needs no lock."""
        self._lock = RunLock(self.out, what="lab study")

    def cold_start_model(self, target: float, progress) -> Path:
        """A second cold start of the workspace's own task and data, stopped at another dev accuracy,
        built once, beside the studies' folders, and reused by every later run."""
        name = f"acc{round(100 * target)}"
        root = self.out.parent / "coldstarts" / name
        if not (root / "minirl.toml").exists():
            task = recipes.load(self.ws_root / "minirl.toml").cold_start.task
            progress(f"cold start {name} (dev accuracy {target:.0%}, {task})")
            init_workspace(root, task=task, force=True, overrides=[f"cold_start.target_acc={target}"])
        return root / "model" / "coldstart"

    def minirl(self, args: list[str], log: Path, *, on_start: Callable[[int], None] = lambda pid: None,
               append: bool = False) -> subprocess.Popen:
        """`minirl ARGS` in a process of its own (an engine's memory and threads end with it), its
        output to `log`; on_start(pid) once it runs; returned finished."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a" if append else "w") as f:
            child = subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdout=f, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[2], env={**os.environ, "COLUMNS": "160"})
            on_start(child.pid)
            child.wait()
        return child

    def _recorded(self, sets: list[str]) -> list[str]:
        """What makes a run this cell's: its sets on top of the workspace recipe as it reads now (a
        recipe changed since, say the learning rate the lr study chose, runs the cell again; its
        comments do not) and the sampling scheme."""
        resolved = recipes.load(self.ws_root / "minirl.toml").to_dict()
        # keys added after runs were recorded: at their defaults they change nothing those runs computed
        for section, key, default in (("train", "lora", dataclasses.asdict(recipe_mod.LoraConfig())),
                                      ("train", "warmup_steps", 0), ("train", "offload", "none"),
                                      ("rollout", "cuda_graphs", True), ("rollout", "inflight_updates", False),
                                      ("parallel", "rollout_gpus", 0), ("guard", "slide_window", 30),
                                      ("guard", "slide_z", 4.0), ("guard", "slide_drop_frac", 0.25)):
            if resolved[section][key] == default:
                del resolved[section][key]
        k = resolved["rollout"]["max_staleness"]  # it replaced `overlap`, which runs recorded before hold
        # runs recorded before loss.clip_against clipped as "proximal" does, and nothing is behind at
        # k = 0; "sampler" at k ≥ 1 changes what they computed: those cells run again
        if k == 0 or resolved["loss"]["clip_against"] == "proximal":
            del resolved["loss"]["clip_against"]
        if k <= 1:
            del resolved["rollout"]["max_staleness"]
            resolved["rollout"]["overlap"] = bool(k)
        resolved = json.dumps(resolved, sort_keys=True)
        return [*sets, f"#recipe={hashlib.sha256(resolved.encode()).hexdigest()[:16]}", f"#sampling={SAMPLING}"]

    def _identity(self, cell: Cell, seed: int, p: Plan) -> tuple[str, list[str]]:
        """(key in state.json, settings recorded) of (cell, seed): what makes a run this cell's."""
        return f"{cell.id}/s{seed}", self._recorded([*common_sets(p, seed), *cell.sets])

    def finished(self, cell: Cell, seed: int, p: Plan) -> Path | None:
        """The run folder of (cell, seed) where it finished with the settings it would run with now."""
        key, recorded = self._identity(cell, seed, p)
        done = self.state["runs"].get(key)
        if done and has_summary(Path(done)) and \
                _legacy_free(self.state.get("sets", {}).get(key, []), p) == recorded:
            return Path(done)
        return None

    def _cut_short(self, key: str, recorded: list[str]) -> Path | None:
        """The run of `key` that a sweep began with today's settings and that ended before the
        sweep could record it (the session's end, a kill, a crash), where it has a checkpoint."""
        began = self.state.get("in_flight") or {}
        if began.get("key") != key or began.get("sets") != recorded:
            return None
        run = Path(began["run"]) if began.get("run") else run_of_process(self.ws_root, began["pid"], since=began["since"])
        return run if run is not None and complete_checkpoints(run) else None

    def run_cell(self, cell: Cell, seed: int, p: Plan, *, progress) -> Path:
        """One (cell, seed): a `minirl run` of its own; returns its run folder."""
        key, recorded = self._identity(cell, seed, p)
        sets = [*common_sets(p, seed), *cell.sets, *resumable_sets(p)]
        if done := self.finished(cell, seed, p):
            return done  # the same cell with the same settings: reused
        if cell.cold_start:
            sets.append(f"model.path={self.cold_start_model(cell.cold_start, progress)}")
        log = self.out / "logs" / f"{key.replace('/', '-')}.log"
        args = ["run", str(self.ws_root), *[x for s in sets for x in ("--set", s)]]
        if cut_short := self._cut_short(key, recorded):  # same seed, prompts and sampling seeds from its checkpoint on
            if _ended(cut_short):  # it ended before the sweep could record it: nothing left to run
                progress(f"{key}: run {cut_short.name} had ended; recorded")
                return self._record(key, recorded, cut_short)
            progress(f"{key}: continuing run {cut_short.name} from its newest checkpoint")
            args += ["--resume", str(cut_short)]
        t0 = time.time()

        def began(pid: int) -> None:
            self.state["in_flight"] = {"key": key, "sets": recorded, "pid": pid, "since": t0,
                                       **({"run": str(cut_short)} if cut_short else {})}
            self._save()

        child = self.minirl(args, log, on_start=began, append=cut_short is not None)
        rc = child.returncode
        run = run_of_process(self.ws_root, child.pid, since=t0)
        if rc != 0 or run is None or not has_summary(run):
            if cut_short and rc == 2:  # its checkpoint refused (damaged): the next sweep begins the run again
                self.state.pop("in_flight", None)
                self._save()
            raise RuntimeError(f"lab cell {key} failed (exit {rc}); see {log}")
        return self._record(key, recorded, run)

    def _record(self, key: str, recorded: list[str], run: Path) -> Path:
        self.state["runs"][key] = str(run)
        self.state.setdefault("sets", {})[key] = recorded
        self.state.pop("in_flight", None)
        self._save()
        return run


# ----- reading the runs ----------------------------------------------------------------------------
def run_of_process(ws_root: Path, pid: int, *, since: float) -> Path | None:
    """The run folder that process `pid` started after `since` (its process.json says so). Not "the
    newest folder": another lab or run in the same workspace may have started one meanwhile."""
    for run in sorted((Path(ws_root) / "runs").glob("*/" + PROCESS_FILE), reverse=True):
        try:
            rec = json.loads(run.read_text())
            if rec.get("pid") == pid and rec.get("started", 0) >= since:
                return run.parent
        except (OSError, json.JSONDecodeError):
            continue
    return None


def _ended(run: Path) -> bool:
    """Whether `run` reached its real end (its summary, written last, is this attempt's, as
    `minirl status` reads it): a sweep cut short between its run's end and its record has nothing
    to resume. An interrupted or killed run resumes."""
    state = run_status(run).state
    return state == "finished"


def rows_of(run: Path) -> list[dict]:
    return [parse_metric_line(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
