"""The state of a run, read from its files alone (`minirl status`): works from another terminal,
another machine with the same filesystem, and on a finished run.

What a run leaves: `process.json` (who runs it: pid, host, start), `metrics.jsonl` (a row per
step), `checkpoints/step_*`, `recipe.toml`, and `summary.json` at the end. The state is
- running:     process.json names a live minirl process on this host (the pid is checked against
               its command line, so a reused pid is not mistaken for the run);
- finished / interrupted / time_limit / collapsed / engine_fault / grader_fault / env_fault: what
               summary.json says, once no process runs it (engine_fault, grader_fault, env_fault: the
               rollout engine, the grader or the environment broke; its `error` says how);
- killed:      neither (the process died without a summary: `minirl run --resume` continues it);
- running on HOST?: the process is on another host and the run has no summary yet.
"""

from __future__ import annotations

import os
import socket
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from minirl.disk import store
from minirl.disk.files import json_or_empty
from minirl.errors import UsageError
from minirl.setup.workspace import RECIPE_NAME, Workspace

PROCESS_FILE = "process.json"


def process_record(resumed_from: str | None) -> dict:
    """What a starting run writes to process.json (rank 0)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "resumed_from": resumed_from}


@dataclass
class RunStatus:
    run_dir: Path
    state: str
    step: int
    total_steps: int
    steps_per_s: float | None
    eta_s: float | None
    last: dict
    heldout: dict  # {"metric", "start", "end"} as far as known
    rollbacks: list[dict] = field(default_factory=list)  # {"step", "reason", "back_to"}
    skipped: list[int] = field(default_factory=list)
    newest_checkpoint: Path | None = None
    process: dict = field(default_factory=dict)
    preempted: int = 0  # requests the engine's scheduler preempted, over the rows read
    regenerated: int = 0  # of their samples, drawn again because their routes were recomputed (R3)
    parity: float | None = None  # the newest parity check's |Δ log p| (a row has one only where one was due)
    error: str | None = None  # what stopped the run, where the summary says (an engine fault)
    damaged: str | None = None  # what is wrong with the run's summary.json, which is then read as absent
    # sampling ahead (rollout.max_staleness = k ≥ 1), over the rows read: k, the trained tokens by how many
    # updates behind they were, the mean idle shares and the trainer's waits on the engine
    ahead: dict = field(default_factory=dict)


def latest_run(ws_root: Path) -> Path:
    runs = Workspace.open(Path(ws_root)).runs_newest_first()
    if not runs:
        raise UsageError(f"no runs in {ws_root}: start one with `minirl run {ws_root}`")
    return runs[0]


def run_dir_of(ws_root: Path, run_name: str | None) -> Path:
    """The run `--run NAME` names in a workspace, or its newest. A run's folder given for the workspace
    (`minirl status demo/runs/ID`, the path a run prints) is that run."""
    run = Path(ws_root).absolute()  # `minirl status ID` in runs/ too
    if run.parent.name == "runs" and run.is_dir() and not (run / RECIPE_NAME).is_file() \
            and (run.parent.parent / RECIPE_NAME).is_file():
        if run_name not in (None, run.name):
            raise UsageError(f"two runs given: {ws_root} and --run {run_name}; give one")
        ws_root, run_name = run.parent.parent, run.name
    if run_name is None:
        return latest_run(ws_root)
    run_dir = Path(ws_root) / "runs" / run_name
    # a run is a folder in runs/ itself: not runs/ (".", ""), nor a path past it (#82)
    if not run_dir.is_dir() or run_dir.resolve().parent != (Path(ws_root) / "runs").resolve():
        raise UsageError(f"no run {run_name!r} in {Path(ws_root) / 'runs'}")
    return run_dir


def read(run_dir: Path) -> RunStatus:
    run_dir = Path(run_dir)
    rows = store.metric_rows(run_dir / store.METRICS)
    summary = store.read_summary(run_dir)
    proc = json_or_empty(run_dir / PROCESS_FILE)
    recipe = _recipe(run_dir)
    total = int(recipe.get("train", {}).get("steps", 0))
    step = rows[-1]["step"] if rows else 0
    rate = _rate(rows)
    ckpts = store.complete_checkpoints(run_dir)
    state = _state(proc, summary)
    if not ckpts and not rows and not state.startswith("running"):  # ended before its first step: nothing to resume
        state = f"failed start ({state})"

    if state == "running":  # a summary on disk belongs to an earlier attempt of this run
        start = (store.peek_record(ckpts[-1]).get("heldout_start") if ckpts else None) or \
            (summary.get("heldout") or {}).get("start")
        heldout = {"start": start} if start else {}
    else:
        heldout = dict(summary.get("heldout") or {})
    rollbacks = [{"step": r["step"], "reason": r.get("guard/reason", ""), "back_to": r.get("guard/rollback_to_step")}
                 for r in rows if r.get("guard/action") in ("rollback", "stop")]
    return RunStatus(
        run_dir=run_dir, state=state, step=step, total_steps=total, steps_per_s=rate,
        eta_s=(total - step) / rate if rate and state == "running" and total > step else None,
        last=rows[-1] if rows else {}, heldout=heldout, rollbacks=rollbacks,
        skipped=[r["step"] for r in rows if r.get("guard/action") == "skip"],
        newest_checkpoint=ckpts[-1] if ckpts else None, process=proc,
        preempted=sum(r.get("rollout/preempted", 0) for r in rows),
        regenerated=sum(r.get("rollout/regenerated", 0) for r in rows),
        parity=next((r["sync/parity_abs_dlogp"] for r in reversed(rows) if "sync/parity_abs_dlogp" in r), None),
        error=summary.get("error") if state != "running" else None,
        damaged=store.summary_problem(run_dir),
        ahead=_ahead(rows, int(recipe.get("rollout", {}).get("max_staleness", 0) or 0)),
    )


def _ahead(rows: list[dict], k: int) -> dict:
    """What sampling ahead did over the run's rows (k ≥ 1), for `status`; {} otherwise."""
    hist = [r["rollout/staleness_tokens"] for r in rows if isinstance(r.get("rollout/staleness_tokens"), list)]
    if not k or not hist:
        return {}
    tokens = [sum(h[i] for h in hist if i < len(h)) for i in range(max(map(len, hist)))]
    def mean(key: str) -> float:
        got = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(got) / len(got) if got else 0.0

    return {"k": k, "tokens_behind": tokens, "engine_idle": mean("timing/engine_idle_frac"),
            "trainer_idle": mean("timing/trainer_idle_frac"), "trainer_wait_s": rows[-1].get("timing/trainer_wait_s")}


def _state(proc: dict, summary: dict) -> str:
    here = proc.get("host") == socket.gethostname()
    if proc and here and _alive(int(proc.get("pid", 0))):
        return "running"
    if summary and (not proc or float(summary.get("written_at", 0)) >= float(proc.get("started", 0))):
        return summary.get("status", "finished")
    if proc and not here:
        return f"running on {proc.get('host')}?"
    return "killed"


def _alive(pid: int) -> bool:
    """A live process with this pid that is a minirl run (not another program that got the pid)."""
    if pid <= 0:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"minirl" in cmdline or b"cli.main" in cmdline


def _rate(rows: list[dict]) -> float | None:
    """Steps per second over the newest rows of one process (elapsed time only grows within one):
    up to 100 of them, so a checkpoint or held-out evaluation among them moves the rate, and the ETA
    from it, by a little rather than several-fold."""
    tail = []
    for r in reversed(rows[-100:]):
        e = r.get("timing/elapsed_s")
        if not isinstance(e, (int, float)) or (tail and e >= tail[-1][1]):
            break
        tail.append((r["step"], e))
    if len(tail) < 2:
        return None
    (s1, e1), (s0, e0) = tail[0], tail[-1]
    return (s1 - s0) / (e1 - e0) if e1 > e0 else None


def _recipe(run_dir: Path) -> dict:
    try:
        return tomllib.loads((run_dir / "recipe.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
