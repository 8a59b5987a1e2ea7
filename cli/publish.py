"""`minirl export` and `minirl push`: a checkpoint as a Hugging Face model folder with its card, and
that folder on the Hub."""

from __future__ import annotations

import signal

from pathlib import Path

import click

from cli.options import SHARD_SIZE, default_workspace
from cli.render import console
from minirl.errors import UsageError
from minirl.models import hub
from minirl.proc.signals import handling
from minirl.publish import export as ex


@click.command("export")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path), metavar="[WORKSPACE_RUN_OR_CHECKPOINT] OUT")
@click.option("-w", "--workspace", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Workspace whose latest run to export when no run or checkpoint is given [default: ./minirl-ws, or "
                   "the current folder where it is a workspace].")
@click.option("--best", is_flag=True, help="The good checkpoint (never one a rollback undid) with the best held-out "
                                           "score; checkpoints without a score are evaluated first.")
@click.option("--step", type=int, default=None, help="The checkpoint of this step.")
@click.option("--max-shard-size", type=SHARD_SIZE, default="5GB", show_default=True,
              help="Safetensors shard size (an index above it): TB, GB, MB or KB.")
@click.option("--adapter", is_flag=True, help="A LoRA run: its adapter alone, as a PEFT folder (adapter_config.json, "
                                              "adapter_model.safetensors) for the run's base model, not the merged model.")
def export_cmd(paths: tuple[Path, ...], workspace: Path | None, best: bool, step: int | None, max_shard_size: int,
               adapter: bool) -> None:
    """Export a run's checkpoint as a Hugging Face model folder OUT with a model card.

    WORKSPACE_RUN_OR_CHECKPOINT: a run folder (runs/<id>), one of its checkpoints, or a workspace
    (its latest run); default: the -w workspace's latest run. The checkpoint: the run's newest (default), --step N, or --best. OUT gets
    safetensors (sharded with an index above --max-shard-size), config, generation config,
    tokenizer, README.md (model card with the recipe, the run's figures and how to load it) and
    training_curves.png. A LoRA run exports merged (W + (α/r)·B·A), or with --adapter as a PEFT
    adapter that `peft` loads onto the base model.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if len(paths) not in (1, 2):
        raise UsageError("minirl export [WORKSPACE_RUN_OR_CHECKPOINT] OUT: give the output folder (and optionally "
                         "the workspace, run or checkpoint)")
    out = paths[-1]
    if len(paths) == 1 and ex.is_source(out):  # `minirl export WS`: what to export, and no folder to write
        raise UsageError(f"{out} is what to export, and OUT is missing: `minirl export {out} OUT` writes it to a new "
                         "folder OUT")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty folder; choose another one")
    # SIGTERM as Ctrl-C while the export works: its cleanup runs and nothing half-written is left (#82); once
    # the folder is in place, a SIGTERM ends the process as it would have before (never a traceback at exit)
    with handling(_interrupt, (signal.SIGTERM,)):
        with Progress(TextColumn("held-out eval of checkpoints"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as prog:
            task = prog.add_task("eval", total=None)
            run_dir, ckpt, why = ex.pick(paths[0] if len(paths) == 2 else None, workspace or default_workspace(),
                                         step=step, best=best,
                                         progress=lambda d, t: prog.update(task, completed=d, total=t))
        with console.status(f"exporting step {ckpt.step} of {run_dir.name}..."):
            folder = ex.export(run_dir, out, ckpt, why=why, max_shard_size=max_shard_size, adapter=adapter,
                               eval_results=ex.eval_results_for(run_dir.parent.parent, ckpt))
    size = sum(f.stat().st_size for f in folder.iterdir())
    console.print(f"[green]exported[/] step {ckpt.step} of run {run_dir.name} ({why}) to {folder} "
                  f"({size / 2**20:.1f} MiB, {len(list(folder.iterdir()))} files)", soft_wrap=True)
    console.print(f"  next: [bold]minirl push {folder} --repo OWNER/NAME[/]")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@click.command("push")
@click.argument("source", type=click.Path(path_type=Path), required=False, metavar="[FOLDER_OR_RUN]")
@click.option("--repo", required=True, metavar="OWNER/NAME", help="The Hub model repo (created when missing).")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--revision", default=None, metavar="BRANCH", help="Branch to commit to (created from main).")
@click.option("--force", is_flag=True, help="Replace what the branch already holds.")
@click.option("--dry-run", is_flag=True, help="List the files and sizes that would be uploaded; touch nothing.")
@click.option("-w", "--workspace", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Workspace whose latest run to push when no folder or run is given [default: ./minirl-ws, or the "
                   "current folder where it is a workspace].")
@click.option("--best", is_flag=True, help="With a run: export its best good checkpoint (see `minirl export`).")
@click.option("--step", type=int, default=None, help="With a run: export the checkpoint of this step.")
@click.option("--adapter", is_flag=True, help="With a LoRA run: export and push its PEFT adapter, not the merged model.")
@click.option("--base-repo", default=None, metavar="OWNER/NAME",
              help="An adapter whose base model is a local folder: the Hub repo of that base, which the uploaded "
                   "adapter_config.json and card then name.")
def push_cmd(source: Path | None, repo: str, private: bool, revision: str | None, force: bool, dry_run: bool,
             workspace: Path | None, best: bool, step: int | None, adapter: bool, base_repo: str | None) -> None:
    """Push an exported model folder to the Hugging Face Hub as one commit.

    FOLDER_OR_RUN: a folder `minirl export` wrote (a model or a LoRA adapter), or a run / checkpoint / workspace (exported
    first); default: the -w workspace's latest run. The token comes from HF_TOKEN or a saved login (`hf auth login`)
    and is never printed or written. A branch that already holds files is refused without --force.
    """
    import json
    import tempfile

    from rich.table import Table

    hub.check_repo_name(repo)  # before any export
    with tempfile.TemporaryDirectory(prefix="minirl-push-") as tmp:
        if source is not None and any((source / f).exists() for f in ("config.json", "adapter_config.json")):
            folder = source  # an exported model or adapter
            if adapter and not (folder / "adapter_config.json").exists():
                raise UsageError(f"push --adapter: {folder} is a whole model folder (config.json, no adapter_config.json); "
                                 "push it without --adapter, or export the LoRA run with --adapter first")
        else:
            run_dir, ckpt, why = ex.pick(source, workspace or default_workspace(), step=step, best=best)
            with console.status(f"exporting step {ckpt.step} of {run_dir.name}..."):
                folder = ex.export(run_dir, Path(tmp) / repo.split("/")[-1], ckpt, why=why, repo_id=repo, adapter=adapter,
                                   eval_results=ex.eval_results_for(run_dir.parent.parent, ckpt))
        meta = folder / "minirl_export.json"
        origin = json.loads(meta.read_text()) if meta.exists() else {}
        message = (f"minirl: run {origin['run']}, step {origin['step']}" if origin else f"minirl: {folder.name}")
        if dry_run:
            files = hub.push(folder, repo, dry_run=True, base_repo=base_repo)["files"]
            console.print(f"would upload to {repo}@{revision or 'main'} ({message}):", soft_wrap=True)
            table = Table(box=None)
            table.add_column("file")
            table.add_column("bytes", justify="right")
            for rel, size in files:
                table.add_row(rel, f"{size:,}")
            table.add_row("[bold]total[/]", f"[bold]{sum(s for _, s in files):,}[/]")
            console.print(table)
            return
        from huggingface_hub.utils import enable_progress_bars

        enable_progress_bars()  # large files go through huggingface_hub's own upload bars
        total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        with console.status(f"uploading {folder} ({total / 2**20:.1f} MiB) to {repo}@{revision or 'main'}..."):
            done = hub.push(folder, repo, private=private, revision=revision, force=force, message=message,
                            base_repo=base_repo)
    console.print(f"[green]pushed[/] {len(done['files'])} files to {done['url']} ({message}; commit "
                  f"{done['commit'][:10]})", soft_wrap=True)
