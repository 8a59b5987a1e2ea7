"""`minirl eval`: a checkpoint scored on a benchmark (minirl/eval/bench.py), its table, and where its
results and responses went; an interrupted evaluation says what it kept."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from cli.options import default_workspace, workspace_argument
from cli.render import SET_HELP, console
from minirl import faults
from minirl.config import recipes
from minirl.eval.bench import bench_records, eval_benchmark
from minirl.eval.benchmarks import get as get_bench
from minirl.eval.checkpoints import resolve_checkpoint
from minirl.setup.workspace import RECIPE_NAME, Workspace


@click.command("eval")
@click.argument("bench", default="heldout")
@workspace_argument
@click.option("--checkpoint", default="latest", show_default=True,
              help="'latest' (newest run checkpoint), 'coldstart', a run checkpoint folder, an exported HF folder, "
                   "or an HF model id.")
@click.option("--data", type=click.Path(exists=True, path_type=Path), default=None,
              help="Local benchmark file or folder (JSONL/Parquet) instead of the Hub.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder holding <bench>.jsonl files (sets eval.data_dir).")
@click.option("--k", type=int, default=None, help="Samples per problem (sets eval.k).")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (sets eval.temperature).")
@click.option("--max-problems", type=click.IntRange(min=1), default=None,
              help="Score only the first N problems (a named benchmark is scored whole by default; heldout as the "
                   "recipe's eval.max_problems).")
@click.option("--no-samples", is_flag=True, help="Keep no responses (by default every one is kept beside its grade: "
                                               "`minirl samples --eval`).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def eval_cmd(bench: str, workspace: Path, checkpoint: str, data: Path | None, data_dir: Path | None, k: int | None,
             temperature: float | None, max_problems: int | None, no_samples: bool, overrides: tuple[str, ...]) -> None:
    """Evaluate a checkpoint on BENCH and report avg@k, pass@k (and the unbiased pass@1, @5, @10
    below k) and maj@k.

    BENCH is one of aime24, aime25, hmmt25, amc23, math500, gsm8k, humaneval (Hugging Face
    datasets, or a local copy with --data / --data-dir) or heldout (the workspace's held-out split,
    the default). humaneval runs each answer's program against the problem's tests in a sandbox.
    Results go to <workspace>/evals/ (or ./minirl-evals/ without a workspace) as JSON with a
    per-problem breakdown, and every response beside its grade (`minirl samples --eval BENCH` shows
    them). An interrupted eval resumes where it stopped.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if (Path(bench) / RECIPE_NAME).is_file() and workspace == default_workspace():  # `minirl eval demo`, as `run demo`
        bench, workspace = "heldout", Path(bench)
    get_bench(bench)  # an unknown name fails before anything loads
    ws = Workspace.open(workspace) if (workspace / RECIPE_NAME).exists() else None
    if ws is None and checkpoint in ("latest", "coldstart"):
        Workspace.open(workspace)  # raises the one-line "not a workspace" error
    extra = list(overrides)
    for key, value in (("eval.k", k), ("eval.temperature", temperature), ("eval.data_dir", data_dir)):
        if value is not None:
            extra.append(f"{key}={value}")
    rec = recipes.load(ws.recipe_path if ws else None, extra)
    # the problems before the model: a missing benchmark, or a Hub out of reach, fails at once
    records = bench_records(bench, rec, heldout_path=ws.path(rec.data.heldout) if ws else None, data=data,
                            data_dir=Path(rec.eval.data_dir) if rec.eval.data_dir else None,
                            max_problems=max_problems or 0)
    if records.name != bench:
        console.print(f"[yellow]{data} holds {records.total:,} problems and {bench} has "
                      f"{get_bench(bench).problems:,}: it is not {bench}; its results are filed as {records.name!r}[/] "
                      f"(scored with {bench}'s prompt and grader)")
    model_dir = resolve_checkpoint(ws, rec, checkpoint)
    from minirl.setup import limits  # deferred: Platform.here imports torch

    # what this machine cannot give the engine: refused before it starts
    limits.check_engine(rec.rollout, limits.Platform.here())
    out_dir = ws.root / "evals" if ws else Path("minirl-evals")
    if ws:  # the workspace's vLLM compile cache, which its runs fill (#73)
        from minirl.rollout import cache as engine_cache  # deferred: the rollout package imports torch

        engine_cache.use(ws.root)
    kept = [0, 0]  # problems done and kept, of all: what a Ctrl-C leaves for the same command to resume

    def progress(done: int, total: int) -> None:
        kept[:] = done, total
        prog.update(task, completed=done, total=total)

    try:  # in a log, no bar: rich draws none live there, and its last frame would stand before a refusal's line
        with Progress(TextColumn(f"eval {bench}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=not console.is_terminal) as prog:
            task = prog.add_task("eval", total=None)
            result = eval_benchmark(bench_name=bench, model_dir=model_dir, out_dir=out_dir, rec=rec, records=records,
                                    keep_samples=not no_samples, on_progress=faults.eval_progress(progress))
    except KeyboardInterrupt:
        if not kept[0]:
            raise
        print(f"minirl: eval stopped: {kept[0]:,} of {kept[1]:,} problems kept; the same command resumes from there",
              file=sys.stderr)
        sys.exit(130)
    from rich.table import Table

    kk = result["k"]
    scores = [f"avg@{kk}", *(f"pass@{j}" for j in (1, 5, 10, 100) if j < kk), f"pass@{kk}", f"maj@{kk}"]
    table = Table(title=f"{result['benchmark']}: {result['checkpoint']}")
    for col in ("problems", *scores, "T", "truncated prompts", "grader timeouts"):
        table.add_column(col, justify="right")
    scored = f"{result['problems']:,}" + (f" of {result['of']:,}" if result["of"] != result["problems"] else "")
    table.add_row(scored, *(f"{result[c]:.3f}" for c in scores), str(result["temperature"]),
                  str(result["truncated_prompts"]), str(result["grader_timeouts"]))
    console.print(table)
    if result.get("env_faults"):  # samples the environment's fault ended: left out of the scores above
        console.print(f"[yellow]the environment failed in {result['env_faults']} episodes: left out of each problem's "
                      "samples (past env.max_error_frac of them an evaluation stops)[/]")
    if result["resumed_problems"]:
        console.print(f"resumed: {result['resumed_problems']} problems were already done")
    console.print(f"results: {result['results_file']}")
    if result.get("samples_file"):
        console.print(f"responses: {result['samples_file']} (`minirl samples --eval {result['samples_file']}`)")
