"""The life of a run around its steps: the run folder and its writer's lock, the metrics file, the
held-out evaluations, checkpoints on a schedule, and the end (final checkpoint, HF folder,
summary). A full disk or a read-only folder ends a run with one line; every complete checkpoint
stays whole. The steps themselves are loop.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minirl.config import recipes
from minirl.config.recipe import Recipe
from minirl.disk import atomic, store
from minirl.disk.oserrors import os_error_of
from minirl.errors import EngineFault, EnvFault, GraderFault, RunIOError, UsageError
from minirl.launch import World
from minirl.proc.team import Team, adapts
from minirl.rollout import cache as engine_cache
from minirl.run import final_weights
from minirl.run import status as status_mod
from minirl.run.loop import RLRun
from minirl.run.runlock import RunLock
from minirl.run import token_record
from minirl.run.samples import FILE as SAMPLES, SampleLog, truncate as truncate_samples
from minirl.run.token_record import TokenRecord
from minirl.run.sinks import Sinks
from minirl.run.summary import write_summary
from minirl.setup.run_inputs import RunInputs, prepare_run
from minirl.setup.workspace import Workspace
from minirl.stopwatch import Stopwatch


class Stop:
    """Set by the CLI's SIGINT/SIGTERM handler; the run checks it between steps."""

    requested = False
    signal = 2  # which signal asked (the exit code is 128 + it)


def run(
    ws: Workspace,
    rec: Recipe,
    *,
    resume: str | None = None,
    on_event: Callable[[str, dict], None] = lambda kind, data: None,
    world: World | None = None,
    started: float | None = None,
) -> dict:
    """Run (or resume) RL in `ws`; returns the summary dict (also written to summary.json).

    resume: None (a new run), "latest" (the newest checkpoint of the newest run; an error when
    there is none), "auto" (that, when the newest run has not ended; else a new run: the form a
    job that restarts itself uses) or a run folder's name or path (its newest checkpoint).

    on_event(kind, data) with kind in: "start", "eval", "step", "checkpoint", "warning", "note", "guard",
    "fault", "done"; called on the main rank only. world: this process's place in a torchrun job
    (default: the whole job).
    started: when the process began (the CLI's clock), for the summary's start-up by part.
    """
    t_start = time.time()
    imports = {"imports": t_start - started} if started else {}
    world = world or World()
    inputs = prepare_run(ws, rec, resume=resume, world_size=world.size)  # every check that can fail on input
    try:
        return _start_and_train(ws, rec, inputs, on_event if world.main else _quiet, t_start=t_start, world=world,
                                imports=imports)
    except Exception as err:  # noqa: BLE001 - an OSError however a library wrapped it (safetensors: its own error)
        e = os_error_of(err, chained=False)
        if e is None or e.errno not in _DISK_ERRORS:
            raise
        # A full disk or a read-only folder: one line. Checkpoints are written aside and renamed
        # into place, so every complete one on disk is still whole.
        where = e.filename or ws.runs
        newest = next(iter(ws.runs_newest_first()), None)  # this run's folder, where it got to making one
        if newest is not None and store.complete_checkpoints(newest):
            then = f"every complete checkpoint is intact (free space, then `minirl run {ws.root} --resume`)"
        else:  # nothing to resume (#82): the advice is what works from here
            then = f"the run had no checkpoint yet (free space, then `minirl run {ws.root}` starts it again)"
        raise RunIOError(f"cannot write {where}: {e.strerror}; {then}") from None


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def _quiet(kind: str, data: dict) -> None:
    """on_event of the ranks that do not print."""


def _start_and_train(ws: Workspace, rec: Recipe, inputs: RunInputs, on_event, *, t_start: float,
                     world: World, imports: dict) -> dict:
    resume_from = inputs.resume_from
    if resume_from:
        run_dir = resume_from.parent.parent
    else:  # rank 0 names the folder, every rank uses it
        run_dir = world.broadcast(_new_run_dir(ws.runs) if world.main else None)
    lock = _writer_lock(run_dir, world)  # before anything in the folder changes; refused: nothing did
    try:
        return _locked_start_and_train(ws, rec, inputs, on_event, t_start=t_start, world=world, run_dir=run_dir,
                                       imports=imports)
    finally:
        if lock is not None:
            lock.release()


ENDING = "end_started"  # in a run folder: the step whose end (held-out eval, HF folder) began; see _train
RECIPE_CHANGES = "recipe_changes.jsonl"  # in a run folder: what each --resume changed of its recipe


def _record_changes(run_dir: Path, rec: Recipe, resume_from: Path | None) -> dict:
    """A resumed run's recipe against the one it ran under until now: each change (a flag given
    with --resume) is appended to the run's recipe_changes.jsonl with the step it applies from,
    before recipe.toml is rewritten; returned for the start line to say."""
    before = run_dir / "recipe.toml"
    if resume_from is None or not before.is_file():
        return {}
    changed = recipes.load(before).changes(rec)
    if changed:
        step = store.record_step(resume_from)
        with open(run_dir / RECIPE_CHANGES, "a") as f:
            f.write(json.dumps({"from_step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "changes": {k: list(v) for k, v in changed.items()}}) + "\n")
    return changed


def _writer_lock(run_dir: Path, world: World) -> RunLock | None:
    """Rank 0 locks the run folder for the job (runlock.py); every rank gets its answer."""
    lock, refused = None, None
    if world.main:
        try:
            lock = RunLock(run_dir)
        except UsageError as e:
            refused = str(e)
    refused = world.broadcast(refused)
    if refused:
        raise UsageError(refused)
    return lock


def _locked_start_and_train(ws: Workspace, rec: Recipe, inputs: RunInputs, on_event, *, t_start: float,
                            world: World, run_dir: Path, imports: dict) -> dict:
    resume_from = inputs.resume_from
    changed = {}
    try:
        if world.main:
            atomic.sweep(run_dir / "checkpoints")  # what a killed writer or deleter left behind
            changed = _record_changes(run_dir, rec, resume_from)
            atomic.write_text(run_dir / "recipe.toml", rec.to_toml())
            atomic.write_text(run_dir / status_mod.PROCESS_FILE,  # who runs it, for `minirl status`
                              json.dumps(status_mod.process_record(str(resume_from) if resume_from else None)))
        cache = engine_cache.use(ws.root)  # vLLM's compile cache in the workspace: later runs and evals reuse it
        t_built = time.time()
        # before the engine binds the team's threads to cores (minirl/proc/team.py)
        team = Team(watch=adapts(rec))
        rl = RLRun(ws, rec, inputs, run_dir=run_dir, world=world)
    except BaseException:
        if resume_from is None and world.main:  # a run that never started leaves no folder for --resume to pick
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    startup_s = time.time() - t_start  # input checks, data, trainer and vLLM
    # the start by part: imports (before the run began), the input checks and data, then RLRun's own
    # (the trainer, the engine and within it vLLM's compile and graph capture)
    startup = {k: round(v, 2) for k, v in {**imports, "inputs": t_built - t_start, **rl.startup}.items()}
    if rec.loss.is_mode == "off":  # allowed explicitly (the validator); said once, recorded in the summary
        on_event("warning", {"text": f"IS correction is off: the gap between vLLM ({rec.rollout.precision}) and the "
                                     "trainer is left uncorrected (loss.allow_uncorrected = true)"})
    on_event("start", {"run_dir": str(run_dir), "step": rl.state.step, "startup_s": round(startup_s, 1),
                       "skipped_rows": rl.skipped, "train_rows": len(rl.train_problems), "startup_parts": startup,
                       "engine_cache": cache.describe(),
                       "resumed_from": str(resume_from) if resume_from else None,
                       "recipe_changes": {k: list(v) for k, v in changed.items()}})

    try:
        team.start()
        t0 = time.time()
        if not rl.state.heldout_start:
            rl.state.heldout_start = rl.heldout_eval()
            on_event("eval", {"which": "start", **rl.state.heldout_start})
        eval_s = time.time() - t0
        _resize(team, on_event)  # the evaluation was a window, if long enough: the first step's team
        return _train(rl, on_event, t_start=t_start, startup_s=startup_s, eval_s=eval_s,
                      startup={"parts_s": startup, "engine_cache": cache.describe()}, team=team)
    finally:
        rl.close()


@dataclass
class _Stopped:
    """How a run's steps ended: its status ("finished" unless a stop, a fault or the guard ended them), the
    fault said (None: none), the newest periodic held-out eval as (step, result), and the seconds of the
    held-out evaluations (off the RL clock) and of the RL clock."""

    status: str
    fault: str | None
    last_eval: tuple
    eval_s: float
    rl_s: float


def _train(rl: RLRun, on_event, *, t_start: float, startup_s: float, eval_s: float, startup: dict,
           team: Team) -> dict:
    """The steps, the checkpoints and the end of a run (final checkpoint, held-out eval, summary)."""
    rec, run_dir, world = rl.rec, rl.state.run_dir, rl.world
    if rl.last_good is None:  # a fresh run: its starting point is the first rollback target
        rl.save("step_000000")
    metrics_path = run_dir / "metrics.jsonl"
    if world.main:
        store.truncate_metrics(metrics_path, rl.state.step)  # rows past the checkpoint are redone; a torn last line goes
    before = dict(rl.state.timing)  # what earlier attempts spent: the summary's phases are this attempt's
    sinks = Sinks(rec.metrics, run_dir=run_dir, recipe=rec.to_dict(),
                  resumed_at=rl.state.step if rl.state.step else None) if world.main else None
    stopped = _steps(rl, on_event, team=team, metrics_path=metrics_path, sinks=sinks, eval_s=eval_s)
    return _end(rl, on_event, stopped, t_start=t_start, startup_s=startup_s, startup=startup, before=before,
                sinks=sinks, metrics_path=metrics_path)


def _steps(rl: RLRun, on_event, *, team: Team, metrics_path: Path, sinks: Sinks | None, eval_s: float) -> _Stopped:
    """The run's steps until its last, a stop, a fault or the guard's stop: each step's row, samples and
    trained tokens written, the periodic held-out evals and checkpoints."""
    rec, world = rl.rec, rl.world
    status, fault = "finished", None
    last_eval = (None, {})  # (step, held-out result) of the newest periodic eval (eval.every)
    t_rl = time.time()
    timing = rl.state.timing  # summed over the run's attempts (a checkpoint carries it)
    rl_clock = Stopwatch(timing)
    samples = _sample_log(rl) if world.main else None  # after the resume's checkpoint: none past it
    tokens = _token_record(rl) if world.main else None
    with metrics_path.open("a") if world.main else open(os.devnull, "w") as mf:
        while rl.state.step < rec.train.steps:
            if world.any(Stop.requested):  # every rank stops after the same step
                status = "interrupted"
                break
            if world.any(rec.train.time_limit_s and time.time() - t_rl > rec.train.time_limit_s):
                status = "time_limit"
                break
            rl_clock.start()
            try:
                m = rl.step()
            except EngineFault as e:  # the engine broke: nothing untrained-on is lost, no rollback mends it
                status = "engine_fault"
                fault = (f"{e}; the newest checkpoint is intact: `minirl run {rl.ws.root} --resume` continues from "
                         "it (a --set given with it applies from there)")
                if e.row is not None:  # the step trained before its parity check failed: its row stays
                    if samples:
                        samples.write(e.row["step"], *rl.drawn)
                    if tokens:
                        tokens.write(e.row["step"], *rl.trained, update=e.row.get("guard/action", "step"))
                    mf.write(store.metric_line(e.row) + "\n")
                    mf.flush()
                on_event("fault", {"text": fault})
                break
            except (GraderFault, EnvFault) as e:  # the grader or the environment broke: the step trained nothing
                status = "grader_fault" if isinstance(e, GraderFault) else "env_fault"
                fault = f"{e}; `minirl run {rl.ws.root} --resume` continues from the newest checkpoint"
                on_event("fault", {"text": fault})
                break
            rl_clock.lap("loop")  # "loop": the RL clock, every step's wall, held-out evals left out
            m["timing/loop_s"] = round(timing["loop"], 4)
            if team.watched:
                m["timing/threads"] = team.threads  # the team that ran this step
            if rec.eval.every and rl.state.step % rec.eval.every == 0:
                t0 = time.time()
                heldout = rl.heldout_eval()  # of this step's weights, off the RL clock
                last_eval = (rl.state.step, heldout)
                m.update({f"heldout/{k}": v for k, v in heldout.items() if "@" in k})
                on_event("eval", {"which": f"step {rl.state.step}", **heldout})
                eval_s += time.time() - t0
                timing["heldout"] = timing.get("heldout", 0.0) + time.time() - t0
            rl_clock.start()
            written = samples.write(rl.state.step, *rl.drawn) if samples else []  # before its row: never ahead
            if tokens:
                tokens.write(rl.state.step, *rl.trained, update=m.get("guard/action", "step"))
            mf.write(store.metric_line(m) + "\n")  # one write per row; a kill can tear only the last line
            mf.flush()
            if sinks:
                sinks.log(m, written)  # TensorBoard / W&B, as enabled in [metrics]
            on_event("step", m)
            if m.get("guard/action") in ("rollback", "stop", "skip"):
                on_event("guard", {"step": m["step"], "action": m["guard/action"], "reason": m["guard/reason"],
                                   "to": str(rl.last_good), "lr": rl.state.lr})
            if m.get("guard/action") == "stop":
                status = "collapsed"
                break
            if rl.state.step % rec.checkpoint.every == 0 and rl.state.step < rec.train.steps:
                saving = Stopwatch(timing)
                path = rl.save(f"step_{rl.state.step:06d}")
                if last_eval[0] == rl.state.step:
                    rl.record_heldout(path, last_eval[1])
                rl.prune(rec.checkpoint.keep)
                saving.lap("checkpoint")
                on_event("checkpoint", {"path": str(path), "step": rl.state.step})
            _resize(team, on_event)
            rl_clock.lap("loop")  # writing the row, the sinks and the checkpoint are RL time too
    if samples:
        samples.close()
    if tokens:
        tokens.close()
    return _Stopped(status, fault, last_eval, eval_s, time.time() - t_rl)


def _end(rl: RLRun, on_event, stopped: _Stopped, *, t_start: float, startup_s: float, startup: dict, before: dict,
         sinks: Sinks | None, metrics_path: Path) -> dict:
    """The end of a run however its steps ended: its final checkpoint, then (where it ended as it should)
    the held-out eval and the HF folder, and the summary."""
    rec, run_dir, world = rl.rec, rl.state.run_dir, rl.world
    status, fault, last_eval, eval_s = stopped.status, stopped.fault, stopped.last_eval, stopped.eval_s
    final = rl.state.run_dir / "checkpoints" / f"step_{rl.state.step:06d}"
    # A fault right after a scheduled checkpoint, or a resume of a run whose steps were all done: it
    # holds these weights already
    if not final.is_dir():
        final = rl.save(final.name)
        rl.prune(rec.checkpoint.keep)
        on_event("checkpoint", {"path": str(final), "step": rl.state.step})
    # A stop signal asks for a prompt exit (a scheduler's grace period is seconds): the checkpoint
    # above is all `--resume` needs, so the held-out eval and the HF folder, minutes each on a large
    # model, wait for the run's real end (or `minirl export`); a periodic eval of these weights counts.
    # A broken engine cannot evaluate anything
    stopping = status in ("interrupted", "engine_fault", "grader_fault", "env_fault")
    # The end's held-out eval and HF folder are the largest allocations of a run. Their start is
    # marked until the summary is written: a resume that finds the mark at this step (the end died:
    # out of memory, killed) writes the summary with what is there and says what is missing, never
    # tries the same end again. Rank 0 reads it for every rank (a collective), then marks
    ending = run_dir / ENDING
    cut_short = world.any(world.main and not stopping and ending.is_file()
                          and ending.read_text().strip() == str(rl.state.step))
    if world.main and not stopping and not cut_short:
        atomic.write_text(ending, str(rl.state.step))
    stopping = stopping or cut_short
    heldout_end = last_eval[1] if last_eval[0] == rl.state.step else None  # the same weights: once
    if cut_short:
        fault = (f"the end of this run was cut short at step {rl.state.step} (killed or out of memory in its held-out "
                 f"eval or HF folder); its final checkpoint {final} is whole: `minirl export {run_dir} OUT` writes the "
                 "folder, `minirl eval heldout --checkpoint` scores it")
    if heldout_end is None and not stopping:
        t0 = time.time()
        heldout_end = rl.heldout_eval()
        eval_s += time.time() - t0
    if heldout_end is not None:
        on_event("eval", {"which": "end", **heldout_end})

    hf_dir = None
    if not stopping:  # a collective: every rank takes part, layer by layer; rank 0 writes
        try:
            hf_dir = final_weights.write(rl.trainer, final / "hf", main=world.main, tokenizer_dir=rl.model_dir,
                                         bucket_bytes=rec.rollout.sync_bucket_mib * 2**20)
        except Exception as e:  # noqa: BLE001 - the run's steps and checkpoint are whole: the summary says what failed
            fault = (f"the final HF folder was not written ({type(e).__name__}: {e}); the final checkpoint {final} is "
                     f"whole: `minirl export {run_dir} OUT` writes the folder")
            on_event("fault", {"text": fault})
    if not world.main:
        return {"status": status}
    phases = {"startup": startup_s, "eval": eval_s, "rl": stopped.rl_s,
              **{k: v - before.get(k, 0.0) for k, v in rl.state.timing.items()}}
    summary = write_summary(rl, status=status, stop_signal=Stop.signal, wall_s=time.time() - t_start, phases=phases,
                            heldout_end=heldout_end, checkpoint=final, hf_dir=hf_dir, metrics_path=metrics_path,
                            error=fault, startup=startup)
    ending.unlink(missing_ok=True)  # the end is written: a later --resume of this run makes it anew
    sinks.close(summary)
    on_event("done", summary)
    return summary


def _resize(team: Team, on_event) -> None:
    """The team for the next step, as the cores were used since the last window; said when it changes."""
    was = team.threads
    now = team.after_step()
    if now < was:
        on_event("note", {"text": f"other processes keep {team.most - now} of this run's {team.most} cores busy: "
                                  f"{now} thread{'s' * (now > 1)} until they are free (timing/threads)"})
    elif now > was:
        on_event("note", {"text": f"cores free again: {now} threads"})


def _token_record(rl: RLRun) -> TokenRecord | None:
    """The record of the trained tokens (token_record.py) from the run's step on, or None where the recipe
    keeps none (a resumed run's lines past its checkpoint go either way)."""
    m, run_dir = rl.rec.metrics, rl.state.run_dir
    if not (m.record_tokens or m.record_tokens_every):
        token_record.truncate(run_dir / token_record.FILE, rl.state.step)
        return None
    return TokenRecord(run_dir, rl.state.step, first=m.record_tokens, every=m.record_tokens_every,
                       k=rl.rec.rollout.max_staleness)


def _sample_log(rl: RLRun) -> SampleLog | None:
    """The run's samples file (samples.py) from its step on, or None where the recipe keeps none (a
    resumed run's lines past its checkpoint go either way)."""
    m, run_dir = rl.rec.metrics, rl.state.run_dir
    if not m.samples_groups:
        truncate_samples(run_dir / SAMPLES, rl.state.step)
        return None
    fmt = rl.episodes.fmt if rl.episodes is not None else None
    return SampleLog(run_dir, rl.state.step, groups=m.samples_groups, most=m.samples_max_chars, decode=rl.decode,
                     eos_id=rl.eos, calls=(fmt.open, fmt.close) if fmt is not None and fmt.open else None)


def _new_run_dir(runs: Path) -> Path:
    """runs/<YYYYmmdd-HHMMSS>, with a suffix if another run started in the same second."""
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = runs / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run folder in {runs}")
