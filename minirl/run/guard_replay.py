"""What the guard would decide on a run's recorded rows, step by step and why, without training
(`minirl guard ROWS`, #80): how a user tunes [guard] on a run they already have, and how the
guard's rules are calibrated on traces (tests/test_guard.py, docs/runs.md).

Each row gives the signals the step's decision read (run/loop.py's row):
KL(μ‖π_old), the entropy, the reward, the loss and gradient norm, the batch's lag and, where
recorded, the fresh tokens' KL; a row's parity check is observed after its decision, as the loop
does after the sync. One decision per row (a step's first mini-batch judges its signals; the rows
keep means over mini-batches, so a skip of one mini-batch among several is not seen). After a
"stop" the run would have ended: the replay ends there. Rows after a rollback the run itself took
are the restored weights' own; after one only the replay takes, they are what the run did instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from minirl.config import recipes
from minirl.config.recipe import Recipe
from minirl.disk.store import parse_metric_line
from minirl.errors import UsageError
from minirl.run.guard import Guard


def load(source: Path, sets: list[str]) -> tuple[list[dict], Recipe]:
    """(rows, recipe) of a run folder (its metrics.jsonl and recipe.toml) or of a metrics.jsonl
    (the defaults' recipe, or the recipe.toml beside it), with `sets` over the recipe; only
    guard.… settings change what the guard decides, so others are refused."""
    source = Path(source)
    rows_path = source / "metrics.jsonl" if source.is_dir() else source
    if not rows_path.is_file():
        raise UsageError(f"{source}: no metrics.jsonl (give a run folder or a metrics.jsonl file)")
    other = [s for s in sets if not s.startswith("guard.")]
    if other:
        raise UsageError(f"--set {other[0]}: only guard.… settings change what the guard decides on recorded rows")
    recipe = rows_path.parent / "recipe.toml"
    rec = recipes.load(recipe if recipe.is_file() else None, list(sets))
    try:
        lines = rows_path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UsageError(f"{rows_path}: not UTF-8 text (byte {e.start}); give a run's metrics.jsonl") from None
    except OSError as e:
        raise UsageError(f"{rows_path}: cannot be read ({e.strerror or e})") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = parse_metric_line(line)
        except ValueError:
            if n == len(lines):  # a run killed mid-write tears its last line only
                break
            raise UsageError(f"{rows_path}:{n}: not a JSON row") from None
        if not isinstance(row, dict) or "step" not in row:
            raise UsageError(f"{rows_path}:{n}: a row without its step")
        rows.append(_checked(row, f"{rows_path}:{n}"))
    return rows, rec


# the signals a decision reads: a number, or null (how a run's strict JSON writes a non-finite one)
SIGNALS = ("train/kl_mu_pi_old", "train/entropy", "rollout/reward_mean", "train/loss", "train/grad_norm",
           "rollout/staleness_mean", "train/kl_mu_pi_old_fresh", "sync/parity_abs_dlogp")


def _checked(row: dict, where: str) -> dict:
    """A row whose step is a whole number and whose signals are numbers or null, else one line naming it."""
    if isinstance(row["step"], bool) or not isinstance(row["step"], int):
        raise UsageError(f"{where}: step = {row['step']!r} is not a whole number")
    for key in SIGNALS:
        v = row.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise UsageError(f"{where}: {key} = {json.dumps(v)[:40]} is not a number")
    return row


def replay(rows: list[dict], rec: Recipe) -> list[dict]:
    """[{"step", "decision" (step | skip | rollback | stop), "reason"}] for each row, as the recipe's
    [guard] decides them; a signal a row lacks reads as not finite."""
    g = Guard.from_settings(rec.guard, prompts=rec.train.prompts_per_step)
    out = []
    for row in rows:
        def get(key: str, missing: float = math.nan) -> float:  # a missing or null signal is no good signal
            v = row.get(key)
            return missing if v is None else float(v)

        fresh = row.get("train/kl_mu_pi_old_fresh")
        v = g.decide(kl=get("train/kl_mu_pi_old"), entropy=get("train/entropy"), reward=get("rollout/reward_mean"),
                     loss=get("train/loss"), grad_norm=get("train/grad_norm"), lag=get("rollout/staleness_mean", 0.0),
                     kl_fresh=None if fresh is None else float(fresh))
        out.append({"step": row["step"], "decision": v.action, "reason": v.reason})
        if v.action == "stop":
            break
        parity = row.get("sync/parity_abs_dlogp")
        if parity is not None and math.isfinite(parity):
            g.observe_parity(parity)
    return out
