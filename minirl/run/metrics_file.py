"""A run's metrics.jsonl: one JSON row per step, appended with one write each, so a kill can tear
only the last line; readers skip a torn line, and a resume truncates to its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from minirl import atomic


def metric_rows(path: Path, *, upto: int | None = None) -> list[dict]:
    """The rows of a run's metrics.jsonl (steps ≤ `upto` if given); a line a kill cut short is skipped."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and (upto is None or row["step"] <= upto):
            rows.append(row)
    return rows


def truncate(path: Path, step: int) -> None:
    """Keep the rows of steps ≤ `step` (the checkpoint a run resumes from), in one atomic rewrite.
    A line a kill cut short is not JSON and goes too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    atomic.write_text(path, "".join(x + "\n" for x in kept))
