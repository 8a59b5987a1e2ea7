"""`minirl check`: whether what a run trained is what its engine sampled, from its token record
(minirl/run/token_record.py)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import click
from rich.table import Table

from cli.options import workspace_argument
from cli.render import console
from minirl.errors import UsageError
from minirl.run import status as status_mod
from minirl.run import token_record as tr


@click.command("check")
@workspace_argument
@click.option("--run", "run_name", default=None, help="A run folder's name under WORKSPACE/runs [default: the newest].")
def check_cmd(workspace: Path, run_name: str | None) -> None:
    """Check a run's record of its trained tokens (recipe: metrics.record_tokens, record_tokens_every):
    ids trained = ids sampled, environment tokens out of the loss, no token past k updates behind, log μ
    finite, KL(μ‖π_old) of fresh tokens within the precision's bound, R3 routes for every position.
    Prints what holds and, of what does not, the step and sample; exit code 1 when a check fails."""
    run_dir = status_mod.run_dir_of(workspace, run_name)
    path = run_dir / tr.FILE
    if not path.is_file():
        raise UsageError(f"no token record in {run_dir}: run with --set metrics.record_tokens=N (the first N steps) "
                         "or metrics.record_tokens_every=K")
    records = list(tr.lines(path))
    if not records:
        raise UsageError(f"{path} holds no whole record yet")
    recipe_file = run_dir / "recipe.toml"
    recipe = tomllib.loads(recipe_file.read_text()) if recipe_file.is_file() else {}
    bound, k3, source = tr.bound(run_dir, recipe)
    results = tr.check(records, bound=bound, k3=k3)
    steps = sorted({x["step"] for x in records})
    table = Table(title=f"{run_dir.name}: {len(records):,} samples of {len(steps)} steps ({steps[0]}…{steps[-1]}), "
                        f"{sum(len(x['sampled']) for x in records):,} tokens")
    for col in ("check", "looked at", "holds", "first that does not"):
        table.add_column(col)
    for name, what in tr.CHECKS.items():
        c = results[name]
        if not c.looked:
            table.add_row(what, "—", "[dim]nothing to check[/]", "")
            continue
        first = (f"median {c.median:.2e}, largest {c.largest[0]:.2e} (step {c.largest[1]})"
                 if c.median is not None and not c.failures else "")
        if c.failures:
            s, i, why = c.failures[0]
            first = f"step {s}" + (f" sample {i}" if i is not None else "") + f": {why}"
            if len(c.failures) > 1:
                first += f" (+{len(c.failures) - 1} more)"
        unit = "steps" if name == "mismatch" else "samples"
        table.add_row(what, f"{c.looked:,} {unit}", "[green]yes[/]" if not c.failures else
                      f"[red]no: {len(c.failures):,}[/]", first)
    console.print(table)
    console.print(f"the mismatch's bound: {source}", soft_wrap=True)
    if any(c.failures for c in results.values()):
        sys.exit(1)
