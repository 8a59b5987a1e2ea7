"""`minirl guard ROWS`: what the guard would decide on a run's recorded rows (minirl/run/guard_replay.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from cli.render import console
from minirl.run import guard_replay


@click.command("guard")
@click.argument("rows", type=click.Path(exists=True, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="guard.KEY=VALUE",
              help="A [guard] setting instead of the run's own (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a step: step, decision, reason.")
@click.option("--all", "every", is_flag=True, help="Every step in the table, not only those with a decision or reason.")
def guard_cmd(rows: Path, overrides: tuple[str, ...], as_json: bool, every: bool) -> None:
    """What the guard would decide on ROWS (a run folder or its metrics.jsonl), step by step and
    why, without training: with the run's own [guard] settings, or with --set guard.KEY=VALUE. The
    decisions: step, skip (a non-finite update), rollback, stop (the rollbacks used up; the replay
    ends there)."""
    recorded, rec = guard_replay.load(rows, list(overrides))
    got = guard_replay.replay(recorded, rec)
    if as_json:
        for d in got:
            click.echo(json.dumps(d))
        return
    table = Table(title=f"the guard on {rows} ({len(got)} of {len(recorded)} steps)")
    for col in ("step", "decision", "reason"):
        table.add_column(col)
    for d in got:
        if every or d["decision"] != "step" or d["reason"]:
            table.add_row(str(d["step"]), d["decision"], d["reason"])
    console.print(table)
    acted = {k: [d["step"] for d in got if d["decision"] == k] for k in ("rollback", "stop", "skip")}
    bad = sum(bool(d["reason"]) for d in got)
    console.print(f"{len(got)} steps: {bad} bad or skipped; rollbacks at {acted['rollback'] or 'none'}; "
                  f"stop at {acted['stop'] or 'none'}; skipped updates at {acted['skip'] or 'none'}", soft_wrap=True)
