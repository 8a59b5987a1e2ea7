"""A run folder's one owner: the files a run leaves and what they mean, read and written here alone.

    runs/<id>/metrics.jsonl                 one row per step, appended; a kill tears the last line only
    runs/<id>/summary.json                  the end: status, steps, held-out, phases (run/summary.py says what)
    runs/<id>/checkpoints/step_NNNNNN/      DCP shards (train/checkpoint.py) and
        minirl.json                         the record: step, data position, guard, lr, "good", LoRA…,
                                            written last, so a folder without it was never finished
        heldout.json                        the held-out scores of the weights it holds, where measured

What a checkpoint is, once: *complete* (its record is there and its name has no suffix: a folder
being written or deleted carries `.tmp` / `.del`); *good* (the guard saw nothing pending when it
was saved, and no rollback undid it since); *undone* (a rollback went back past it: between the
target's step and the step that rolled back); *best* (the good one with the highest score); the
*latest trained* (the newest checkpoint past step 0 of the newest run that has one); which one a
`--resume` continues. Every other module asks here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minirl.disk import atomic
from minirl.disk.files import json_or_empty, read_json
from minirl.errors import UsageError

RECORD = "minirl.json"
SCORES = "heldout.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
ENDED = ("finished", "collapsed")  # a run in one of these states is not resumed by `--resume auto`


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    good: bool


# ----- a checkpoint's record and scores -------------------------------------------------------
def has_record(folder: Path) -> bool:
    """A finished checkpoint folder (its record is written last)."""
    return (Path(folder) / RECORD).exists()


def read_record(folder: Path) -> dict:
    """A checkpoint's record; a missing or broken one is one line naming the file."""
    return read_json(Path(folder) / RECORD, "checkpoint")


def record_text(record: dict) -> tuple[str, str]:
    """(file name, text) of a checkpoint's record, for the writer that finishes the folder with it."""
    return RECORD, json.dumps(record, indent=2)


def record_step(folder: Path) -> int:
    """A checkpoint's step, from its record (one line when the record is damaged)."""
    try:
        return json.loads((Path(folder) / RECORD).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"checkpoint {folder}: {RECORD} is damaged; move the folder aside to resume from the one "
                         "before it") from None


def peek_record(folder: Path) -> dict:
    """A checkpoint's record, or {} where it is missing or unreadable (for what only reports)."""
    return json_or_empty(Path(folder) / RECORD)


def read_scores(folder: Path) -> dict:
    """The held-out scores of a checkpoint's weights, {} where none were measured (or they are unreadable)."""
    return json_or_empty(Path(folder) / SCORES)


def write_scores(folder: Path, scores: dict) -> None:
    atomic.write_text(Path(folder) / SCORES, json.dumps(scores))


def drop_scores(folder: Path) -> None:
    """A checkpoint a rollback undid is no candidate for the best: its scores go."""
    (Path(folder) / SCORES).unlink(missing_ok=True)


# ----- a run's checkpoints --------------------------------------------------------------------
def complete_checkpoints(run_dir: Path) -> list[Path]:
    """A run's finished step checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(c for c in root.glob("step_*") if c.is_dir() and "." not in c.name and has_record(c))


def undone_stretches(run_dir: Path) -> list[tuple[int, int]]:
    """(t, s) for each rollback: at step s, back to the checkpoint of step t."""
    rows = metric_rows(Path(run_dir) / METRICS)
    return [(int(r["guard/rollback_to_step"]), int(r["step"])) for r in rows if "guard/rollback_to_step" in r]


def checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The run's complete checkpoints, oldest first, each marked good or not: good when the guard
    saw nothing pending as it was saved and no rollback undid it since."""
    undone = undone_stretches(run_dir)
    out = []
    for path in complete_checkpoints(run_dir):
        record = read_record(path)
        step = int(record["step"])
        good = bool(record.get("good", True)) and not any(t < step <= s for t, s in undone)
        out.append(Checkpoint(path, step, good))
    return out


def rollback_target(resume_from: Path) -> Path:
    """After a resume, where a rollback goes: the newest good checkpoint at or before the one resumed
    from (#80: a run preempted in the middle of a collapse resumes from a checkpoint that is no
    target), else that one (a run's step_000000, its start, is always good)."""
    step = record_step(resume_from)
    good = [c.path for c in checkpoints(Path(resume_from).parent.parent) if c.good and c.step <= step]
    return good[-1] if good else Path(resume_from)


def best_scored(ckpts: list[Path], metric: str) -> Path | None:
    """The good checkpoint (its record's `good`) with the highest `metric` among its scores, the
    newest among equals; None if none has a score."""
    scored = []
    for path in ckpts:
        score = read_scores(path).get(metric)
        good = peek_record(path).get("good", True)
        if score is not None and good:
            scored.append((float(score), path.name, path))
    return max(scored)[2] if scored else None


def latest_trained(ws) -> Path | None:
    """What "latest" means wherever a command takes a checkpoint: the newest checkpoint of the
    newest run that trained (a checkpoint past step 0). A run stopped at step 0 holds only the
    policy it started from, which `coldstart` names."""
    for run in ws.runs_newest_first():
        trained = [c for c in complete_checkpoints(run) if int(c.name.removeprefix("step_")) > 0]
        if trained:
            return trained[-1]
    return None


def run_of(source: Path) -> tuple[Path, Path | None]:
    """(run folder, the checkpoint named by `source` or None) for a run or a checkpoint folder."""
    source = Path(source)
    if has_record(source) and source.parent.name == "checkpoints":
        return source.parent.parent, source
    if (source / "checkpoints").is_dir():
        return source, None
    raise UsageError(f"{source} is neither a minirl run folder (runs/<id>) nor one of its checkpoints")


def is_checkpoint(folder: Path) -> bool:
    """A run's step checkpoint folder (DCP and its record), as opposed to an HF folder."""
    return has_record(folder)


# ----- the summary ------------------------------------------------------------------------------
# the summary's fields its readers use, and the types they must have (a hand-edited or damaged file
# is read as no summary, and `summary_problem` says why: #75)
_NUMBER, _TEXT = (int, float), (str,)
SUMMARY_TYPES = {"status": _TEXT, "written_at": _NUMBER, "steps": (int,), "wall_s": _NUMBER, "phases_s": (dict,),
                 "heldout": (dict,), "last_metrics": (dict,), "checkpoint": _TEXT, "hf_folder": (str, type(None)),
                 "metrics": _TEXT, "run_dir": _TEXT, "guard": (dict,), "recipe": (dict,), "error": _TEXT,
                 "startup_s": (dict,), "engine_cache": (dict,)}
HELDOUT_TYPES = {"metric": _TEXT, "start": (dict, type(None)), "end": (dict, type(None)),
                 "gain_points": (int, float, type(None))}


def summary_problem(run: Path) -> str | None:
    """What is wrong with a run's summary.json, in words, or None (sound, or not there)."""
    path = Path(run) / SUMMARY
    if not path.exists():
        return None
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"{path} is not readable JSON"
    if not isinstance(got, dict):
        return f"{path} holds {type(got).__name__}, not the summary's fields"
    got = _restored(got)
    held = got.get("heldout") if isinstance(got.get("heldout"), dict) else {}
    fields = [(key, got, types) for key, types in SUMMARY_TYPES.items()]
    fields += [(f"heldout.{key}", held, types) for key, types in HELDOUT_TYPES.items()]
    for name, where, types in fields:
        key = name.rsplit(".", 1)[-1]
        if key in where and (not isinstance(where[key], types) or isinstance(where[key], bool)):
            kinds = " or ".join(t.__name__ for t in types if t is not type(None))
            return f"{path}: {name} is {where[key]!r}, not a {kinds}"
    return None


def read_summary(run: Path) -> dict:
    """The run's summary, or {} (a run killed before it wrote one, or a damaged one: `summary_problem`)."""
    return {} if summary_problem(run) else _restored(json_or_empty(Path(run) / SUMMARY))


def _restored(summary: dict) -> dict:
    """A summary `write_summary` wrote, its non-finite numbers back where they were (as its readers
    have always had them).

    >>> _restored({"a": {"b": None, "c": [1.0, None]}, "nonfinite": {"a.b": "nan", "a.c[1]": "-inf"}})
    {'a': {'b': nan, 'c': [1.0, -inf]}}
    """
    bad = summary.pop("nonfinite", None)
    if not isinstance(bad, dict):
        return summary
    for at, kind in bad.items():
        if kind not in ("nan", "inf", "-inf"):
            continue
        *parents, last = re.findall(r"[^.\[\]]+|\[\d+\]", at)
        where = summary
        try:
            for p in parents:
                where = where[int(p[1:-1])] if p.startswith("[") else where[p]
            key = int(last[1:-1]) if last.startswith("[") else last
            if where[key] is None:
                where[key] = float(kind)
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # a hand-edited summary: the rest is read as it is
    return summary


def has_summary(run: Path) -> bool:
    return (Path(run) / SUMMARY).exists()


def write_summary(run: Path, summary: dict) -> Path:
    """The summary as strict JSON (#82): a value that is not a finite number anywhere in it (a poisoned
    step's figure) is written as null, and `nonfinite` says where (dotted keys) and what it was.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> write_summary(d, {"status": "stopped", "heldout": {"end": {"avg@4": float("nan")}}}).read_text().split()
    ['{', '"status":', '"stopped",', '"heldout":', '{', '"end":', '{', '"avg@4":', 'null', '}', '},', '"nonfinite":', '{', '"heldout.end.avg@4":', '"nan"', '}', '}']
    """
    bad: dict[str, str] = {}

    def finite(v, at: str):
        if isinstance(v, float) and not math.isfinite(v):
            bad[at] = str(v)
            return None
        if isinstance(v, dict):
            return {k: finite(x, f"{at}.{k}" if at else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x, f"{at}[{i}]") for i, x in enumerate(v)]
        return v

    clean = finite(summary, "")
    atomic.write_text(Path(run) / SUMMARY, json.dumps({**clean, **({"nonfinite": bad} if bad else {})}, indent=2,
                                                      allow_nan=False))
    return Path(run) / SUMMARY


def status(run: Path) -> str | None:
    """How the run ended, by its summary; None: it never wrote one (killed, or still running)."""
    return read_summary(run).get("status")


# ----- which run a --resume continues ------------------------------------------------------------
def run_folder(ws, name: str) -> Path:
    """A run of this workspace named by its folder (a path, or its name under runs/)."""
    for p in (Path(name), ws.runs / name):
        if p.is_dir() and p.resolve().parent == ws.runs.resolve():
            return p
    raise UsageError(f"--resume {name}: not a run of {ws.root} (one of the folders in {ws.runs}, or "
                     "'latest' / 'auto')")


def resume_run(ws, resume: str | None) -> Path | None:
    """The run folder a `--resume` continues (as `resume_checkpoint` finds it), or None: a new run
    (no --resume, `auto` past an ended run, or nothing to resume: `resume_checkpoint` says so)."""
    if not resume:
        return None
    if resume not in ("latest", "auto"):
        return run_folder(ws, resume)
    for folder in ws.runs_newest_first():
        if complete_checkpoints(folder):
            return None if resume == "auto" and status(folder) in ENDED else folder
    return None


def resume_checkpoint(ws, *, check: Callable[[Path], object], auto: bool = False, run: Path | None = None) -> Path | None:
    """The newest complete checkpoint of the newest run that has one (of `run`, when given),
    checked by `check` (preflight's: its shards against the model). A damaged newest checkpoint is
    an error, not a silent step back: the user decides what to lose.

    auto: None when there is nothing to continue (no run with a checkpoint, or that run ended as
    finished or collapsed); a killed, interrupted or timed-out run is continued. The checkpoint
    carries the guard's state, so a restarted job decides exactly as the killed one would have."""
    for folder in [run] if run else ws.runs_newest_first():
        ckpts = complete_checkpoints(folder)
        if not ckpts:
            continue
        if auto and status(folder) in ENDED:
            return None
        newest = max(ckpts, key=record_step)
        check(newest)
        return newest
    if auto:
        return None
    again = f"start it again: `minirl run {ws.root}` without --resume"
    if run:
        raise UsageError(f"nothing to resume in {run}: it stopped before its first checkpoint; " + again)
    newest = next(iter(ws.runs_newest_first()), None)
    if newest is not None:
        raise UsageError(f"nothing to resume in {ws.runs}: no run has a checkpoint (the newest, {newest.name}, stopped "
                         f"before its first); {again}")
    raise UsageError(f"nothing to resume in {ws.runs}: no run yet; start one: `minirl run {ws.root}`")


# ----- the metrics file -------------------------------------------------------------------------
def _good_lines(path: Path) -> list[tuple[str, dict]]:
    """The rows of a metrics.jsonl a run wrote, in order, damage left out: a line a kill cut short,
    and a row whose step is not above the last good one (out of order or twice: hand-edited or
    torn). #75: `status` read "step 1/3" of a run that had finished 3, and a resume kept step 1 twice."""
    out: list[tuple[str, dict]] = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            row = parse_metric_line(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)):
            continue
        if out and row["step"] <= out[-1][1]["step"]:
            continue
        out.append((line, row))
    return out


def metric_rows(path: Path, *, upto: int | None = None) -> list[dict]:
    """The good rows of a run's metrics.jsonl (`_good_lines`; steps ≤ `upto` if given)."""
    return [row for _, row in _good_lines(path) if upto is None or row["step"] <= upto]


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the good rows of steps ≤ `step` (the checkpoint a run resumes from), in one atomic
    rewrite: a line a kill cut short, and a row out of order or twice, go."""
    if not path.exists():
        return
    kept = [line for line, row in _good_lines(path) if row["step"] <= step]
    atomic.write_text(path, "".join(x + "\n" for x in kept))


def metric_line(row: dict) -> str:
    """A metrics row as one line of strict JSON (#82): a value that is not a finite number (NaN,
    ±inf: a poisoned step's loss or reward) is written as null, and the row's `nonfinite` says
    which keys held one and what it was (within a list or table: "nested"), so that
    `parse_metric_line` gives the row back as it was; Python's json would write a bare NaN, which
    no other JSON reader takes.

    >>> metric_line({"step": 3, "train/loss": float("nan"), "h": [1.0, float("-inf")]})
    '{"step": 3, "train/loss": null, "h": [1.0, null], "nonfinite": {"h": "nested", "train/loss": "nan"}}'
    """
    def finite(v):
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        return v

    bad = {k: (str(v) if isinstance(v, float) else "nested") for k, v in sorted(row.items()) if _has_nonfinite(v)}
    if not bad:
        return json.dumps(row, allow_nan=False)
    return json.dumps({**{k: finite(v) if k in bad else v for k, v in row.items()}, "nonfinite": bad}, allow_nan=False)


def parse_metric_line(line: str) -> dict:
    """A row `metric_line` wrote, its non-finite scalars back as they were (a nested one stays
    null). Raises json.JSONDecodeError on a line that is not JSON."""
    row = json.loads(line)
    if isinstance(row, dict) and isinstance(row.get("nonfinite"), dict):
        for k, kind in row.pop("nonfinite").items():
            if kind in ("nan", "inf", "-inf") and row.get(k) is None:
                row[k] = float(kind)
    return row


def _has_nonfinite(v) -> bool:
    if isinstance(v, float):
        return not math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return any(map(_has_nonfinite, v))
    if isinstance(v, dict):
        return any(map(_has_nonfinite, v.values()))
    return False
