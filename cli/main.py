"""The `minirl` command line. It parses arguments, loads the recipe, calls `minirl`, renders with rich.

No algorithm code lives here. Bad input of any kind prints one line and exits with code 2.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

STARTED = time.time()  # the process's start, near enough: the run's summary counts its imports from here

import click

from cli.guard import guard_cmd
from cli.options import POSITIVE_FINITE, new_workspace_argument, workspace_argument
from cli.publish import export_cmd, push_cmd
from cli.render import SET_HELP, RunView, console, print_plan, status_view
from cli.check import check_cmd
from cli.evaluate import eval_cmd
from cli.samples import samples_cmd
from cli.study import doctor, lab
from minirl.config import recipes
from minirl.config.precisions import NAMES as PRECISION_NAMES
from minirl.errors import EngineFault, EnvFault, RunIOError, UsageError
from minirl.models.hub import resolution
from minirl.models.shapes import TINY_ID
from minirl.proc import team as team_env
from minirl.proc.collector import collect_less_often
from minirl.proc.quick_exit import quick_exit
from minirl.proc.signals import handling
from minirl.run import status as status_mod
from minirl.run.plots import plot_metrics
from minirl.setup.dryrun import dry_run as plan_dry_run
from minirl.setup.run_inputs import run_recipe
from minirl.setup.workspace import RECIPE_NAME, Workspace, init_workspace


def _prepare_env(verbose: bool) -> None:
    """Engine settings that must be in place before torch/vLLM are imported."""
    if "OMP_NUM_THREADS" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        # minirl chooses both, and so may change them: a run that trains and samples in one process
        # spins long and sizes its team to the cores free (minirl/proc/team.py); its children inherit the mark
        os.environ[team_env.AUTO] = "auto"
    elif "GOMP_SPINCOUNT" not in os.environ and team_env.AUTO not in os.environ:
        os.environ[team_env.AUTO] = team_env.USER_THREADS  # the user's team, the CLI's spin: `run` says so
    # vLLM shrinks torch to 1 thread "for serving" unless OMP_NUM_THREADS is set; the trainer
    # shares the process, so give it every core.
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    # an OpenMP thread that waits at a barrier spins 300,000 rounds (libgomp's default) before it
    # sleeps: beside another busy process the spinning takes the core its own peer needs, and each
    # of a step's thousands of small parallel regions waits a scheduler slice (one busy process
    # made the RL loop several times slower: docs/results/speed.md). 1,000 rounds keep most of the quiet
    # speed (tests/bench/busy.py); `run` lengthens them where its team follows the free cores (below)
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    # oneDNN keeps up to 1,024 compiled primitives (a kernel and its scratch each) for every matmul shape
    # it has met; the engine meets many (each batch size of a rollout and of an evaluation): 64 keep the
    # step's own in reach at ~100 MB less peak memory, with the same numbers (docs/results/memory.md)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    # torch's bf16 CPU matmuls (ideep, the engine's linear layers) keep a cache of their own, of up to 1,024
    # oneDNN primitives with their JIT kernels: each new row count adds one, and an evaluation's shrinking
    # batches meet hundreds (~150 MiB over a long run); 64 keep the step's own, with the same numbers
    os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not verbose:
        os.environ.setdefault("TORCH_LOGS", "-all")  # torch's own loggers at ERROR (import-time pytree notices)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # vLLM's NUMA-binding notice
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        for name in ("torchao", "torch", "transformers", "datasets", "torchtitan", "huggingface_hub", "root"):
            logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger().setLevel(logging.ERROR)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Show the engines' own logs (vLLM, TorchTitan, torchao).")
@click.version_option(package_name="minirl")
def cli(verbose: bool) -> None:
    """minirl: RL post-training of LLMs with the MiniRL recipe (token-level IS correction,
    decoupled clipping, Routing Replay).

    \b
    Typical use:
      minirl init ws      # workspace + tiny Qwen3-MoE, cold-started on an embedded task
      minirl run ws       # RL with vLLM rollouts and TorchTitan training
      minirl eval -w ws   # held-out accuracy of the latest checkpoint
      minirl eval aime25 -w ws --data aime25.jsonl   # a benchmark, from a local copy
      minirl export -w ws out/ --best                # the best good checkpoint as an HF folder + card
      minirl push out/ --repo me/tiny-rl             # to the Hugging Face Hub
    """
    _prepare_env(verbose)


@cli.command()
@new_workspace_argument
@click.option("--model", "model_id", default=None,
              help="A Qwen3 / Qwen3-MoE to train instead of the embedded default: a short name (Qwen3-8B, "
                   "Qwen3-30B-A3B, ...), a Hugging Face repo id or a local HF folder. The workspace gets a math RL "
                   "recipe suited to its architecture and no cold start; only its config is read.")
@click.option("--recipe", "recipe_name", default=None,
              help="Shipped recipe (a file stem in recipes/) to start from [default: tiny; with --model, the "
                   "model's own recipe if one is shipped, else qwen3].")
@click.option("--task", default=None, metavar="TASK",
              help="Task for the tiny model: addition (the default; 3-digit sums, 4-5 response tokens), "
                   "scratchpad (3-5-digit sums written out column by column, 20-46 tokens; recipe tiny-scratchpad, "
                   "the stage of `minirl lab`), scratchpad-long (10-13-digit sums, 71-127 tokens, on a tiny MoE "
                   "with stressed routing; recipe tiny-scratchpad-long), or rg:NAME, any task of reasoning-gym "
                   "(rg:chain_sum, rg:basic_arithmetic, ...; recipe tiny-rg, its config in "
                   "cold_start.task_params, its own scorer as the grader: docs/tasks.md).")
@click.option("--force", is_flag=True, help="Rebuild an existing workspace (deletes its data, model and runs).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def init(workspace: Path, model_id: str | None, recipe_name: str | None, task: str | None, force: bool,
         overrides: tuple[str, ...]) -> None:
    """Create a workspace in WORKSPACE (default ./minirl-ws).

    On the embedded default (model tiny-qwen3-moe) it also writes the synthetic task's train and
    held-out splits, builds a tiny Qwen3-MoE with its tokenizer (HF folder + TorchTitan DCP), and
    cold-starts it with SFT through TorchTitan (about a minute on 2 CPU cores; the cold start
    stops once sampled dev accuracy reaches cold_start.target_acc).
    Re-running on an existing workspace leaves it untouched when it already is what was asked for,
    and refuses another request (another --model, --task, --recipe or --set value) unless --force
    rebuilds it.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    labels = {"data": "task splits", "model": "tiny Qwen3-MoE + tokenizer", "cold-start": "cold-start SFT",
              "save": "save HF + DCP"}
    plain = not console.is_terminal  # a log: rich draws no live bars there, so init says where it is in lines
    # (and no bars at all: their last frame would repeat the lines, or be a blank line before an early error)
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, disable=plain) as prog:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int, info: dict) -> None:
            if stage not in tasks:
                tasks[stage] = prog.add_task(labels.get(stage, stage), total=total, info="")
            text = f"loss {info['loss']:.3f}  dev acc {info['dev_acc']:.2f}" if "loss" in info else ""
            prog.update(tasks[stage], completed=done, total=total, info=text)
            if plain and (done == total or stage == "cold-start" and done % 100 == 1):
                where = "done" if done == total else f"step {done}/{total}"
                console.print(f"{labels.get(stage, stage)}: {where}  {text}".rstrip(), soft_wrap=True)

        try:
            report = init_workspace(workspace, recipe_name=recipe_name, model=model_id, task=task, force=force,
                                    overrides=list(overrides),
                                    progress=progress)
        except FileExistsError:
            prog.stop()
            console.print(f"[yellow]workspace {workspace} exists; left as it is[/] (use --force to rebuild)")
            return
    console.print(f"[green]workspace ready:[/] {report['workspace']}")
    if "cold_start_steps" in report:
        lens = report["response_tokens"]
        acc = ("not checked (max_steps below check_every)" if report["cold_start_dev_acc"] is None
               else f"{report['cold_start_dev_acc']:.2f}")
        console.print(f"  tiny-qwen3-moe on {report['task']}: {report['params']:,} params; cold start: "
                      f"{report['cold_start_steps']} SFT steps in {report['cold_start_s']} s, dev accuracy "
                      f"{acc} (target {report['cold_start_target_acc']}); responses "
                      f"{lens['min']}-{lens['max']} tokens (mean {lens['mean']:.1f})")
    if "moe" in report:
        kind = f"Qwen3-MoE, {report['active'] / 1e9:.2f}B active" if report["moe"] else "dense Qwen3"
        console.print(f"  model {report['model']}: {report['params'] / 1e9:.2f}B params ({kind}); recipe from "
                      f"recipes/{report['recipe']}.toml; no cold start (the checkpoint is the starting policy)")
        if resolution(report["model"]):
            console.print(f"  {resolution(report['model'])}", soft_wrap=True)
        console.print(f"  plan: [bold]minirl run {workspace} --dry-run[/] (add --nodes/--gpus-per-node)")
    import torch  # deferred: after _prepare_env

    asleep = recipes.load(workspace / RECIPE_NAME).rollout.sleep_level
    if asleep > 0 and not torch.cuda.is_available():  # the recipe is the GPUs'; this machine's vLLM cannot sleep
        console.print(f"  next, on GPUs: [bold]minirl run {workspace}[/]; on this machine (no GPU): "
                      f"[bold]minirl run {workspace} --set rollout.sleep_level=0[/]", soft_wrap=True)
    else:
        console.print(f"  next: [bold]minirl run {workspace}[/]")


@cli.command()
@workspace_argument
@click.option("--model", "model_id", default=None,
              help="Model to train (sets model.id and clears model.path): a short name (Qwen3-30B-A3B, Qwen3-8B, ...), "
                   "a Hugging Face repo id, or a local HF folder of a Qwen3 / Qwen3-MoE. The architecture comes from "
                   "its config.json; one process on this machine trains what fits in memory.")
@click.option("--replay", type=click.Choice(["off", "r2", "r3"]), default=None,
              help="Routing Replay for MoE (sets train.replay): off, r2 (trainer routes), r3 (rollout routes).")
@click.option("--steps", type=int, default=None, help="RL steps (sets train.steps).")
@click.option("--rollout-precision", type=click.Choice(PRECISION_NAMES),
              default=None,
              help="Rollout engine precision (sets rollout.precision); fp8: FP8 weights and activations (W8A8; "
                   "emulated on CPU); fp8-weights, e5m2, nvfp4: the lab's CPU levels.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--resume", metavar="latest|auto|RUN", is_flag=False, flag_value="latest", default=None,
              help="Continue the latest run from its newest checkpoint. `--resume auto`: the same when that run has "
                   "not ended, else start a new run (for jobs that restart themselves: torchrun --max-restarts, SLURM "
                   "requeue). `--resume RUN`: that run (a folder in runs/), from its newest checkpoint.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (mesh, memory per GPU by component, tokens and FLOPs per step) and stop; needs no "
                   "GPU, no weights and no workspace (the shipped recipe of --model, if any, else the defaults).")
@click.option("--recipe", "recipe_name", default=None,
              help="With --dry-run and no workspace: plan this shipped recipe (a file stem in recipes/, e.g. "
                   "qwen3-30b-a3b-offpolicy) instead of the model's own.")
@click.option("--nodes", type=int, default=None, help="Nodes for the plan (sets parallel.nodes).")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node for the plan (sets parallel.gpus_per_node).")
@click.option("--gpu-mem-gib", type=POSITIVE_FINITE, default=80.0, show_default=True, help="Memory of one GPU, for the plan.")
@click.option("--rollout-gpus", type=int, default=None,
              help="GPUs of each node that only sample, apart from the trainer's (sets parallel.rollout_gpus): "
                   "launch one rank per training GPU; each node's first rank starts its engines on the GPUs after them.")
def run(workspace: Path, model_id: str | None, replay: str | None, steps: int | None,
        rollout_precision: str | None, overrides: tuple[str, ...], resume: str | None, dry_run: bool,
        recipe_name: str | None, nodes: int | None, gpus_per_node: int | None,
        gpu_mem_gib: float, rollout_gpus: int | None) -> None:
    """Run RL in WORKSPACE (default ./minirl-ws) with its recipe.

    Every step: sample prompts, generate G responses each with vLLM (keeping log μ_old), grade,
    compute group advantages, recompute log π_old in TorchTitan, apply N mini-batch updates of the
    MiniRL loss, sync weights into vLLM in place. With --set rollout.max_staleness=k the engine
    samples up to k steps ahead in a process of its own while the trainer trains (every token at
    most k updates stale, nothing dropped; the guard allows the KL that lag adds: docs/async.md).
    Metrics stream to runs/<id>/metrics.jsonl;
    runs/<id>/summary.json is written at the end. Ctrl-C stops after the current step and saves a
    checkpoint (a second Ctrl-C aborts at once; exit code 130). Guardrails ([guard] in the recipe)
    watch KL(μ‖π_old) and entropy and roll back to the last good checkpoint on collapse; when
    their rollbacks are used up the run ends as "collapsed" (exit code 3). A rollout engine that
    returns log-probs no loss may use (non-finite) stops the run before it trains on them, in one
    line naming the setting that avoids it (exit code 5).
    """
    extra = list(overrides)
    if model_id is not None:
        extra += [f"model.id={model_id}"] + ([] if model_id == TINY_ID else ["model.path="])
    for key, value in (("train.replay", replay), ("train.steps", steps), ("rollout.precision", rollout_precision),
                       ("parallel.nodes", nodes),
                       ("parallel.gpus_per_node", gpus_per_node), ("parallel.rollout_gpus", rollout_gpus)):
        if value is not None:
            extra.append(f"{key}={value}")
    if dry_run:
        report = plan_dry_run(workspace, model_id=model_id, recipe_name=recipe_name, sets=extra,
                              user_sets=list(overrides), nodes=nodes, gpus_per_node=gpus_per_node, gpu_gib=gpu_mem_gib,
                              launch_flags=[("--model", model_id), ("--replay", replay), ("--steps", steps),
                                            ("--rollout-gpus", rollout_gpus)])
        for note in report.notes:
            console.print(note, soft_wrap=True)
        print_plan(console, report.plan, recipe=report.recipe_label, resolved=report.recipe.to_toml(),
                   launch=report.launch, advice=report.advice)
        if not report.fits:
            raise UsageError(report.refused)
        return
    # the job's node: its ranks, then its rollout GPUs (given by the flag or by --set alike, #74)
    given = {k.strip(): v.strip() for k, _, v in (x.partition("=") for x in overrides)}
    asked = rollout_gpus if rollout_gpus is not None else given.get("parallel.rollout_gpus")
    if str(asked or "0").isdigit() and int(asked or 0) > 0 and gpus_per_node is None \
            and "parallel.gpus_per_node" not in given:
        extra.append(f"parallel.gpus_per_node={int(os.environ.get('LOCAL_WORLD_SIZE', '1')) + int(asked)}")
    ws = Workspace.open(workspace)
    rec = run_recipe(ws, resume, extra)  # a resumed run's own recipe, not the workspace's
    if team_env.adapts(rec):
        assert "torch" not in sys.modules, "libgomp reads its spin count once, as torch loads it"
        os.environ["GOMP_SPINCOUNT"] = team_env.SPIN
    if resolution(rec.model.id):
        console.print(resolution(rec.model.id), soft_wrap=True)
    if note := team_env.fixed_team_note(rec):
        console.print(f"[dim]{note}[/]", soft_wrap=True, highlight=False)

    from minirl import launch  # deferred: torch, after _prepare_env set the engines' environment
    from minirl.run import lifecycle

    world = launch.start()  # the whole job, or one rank of a torchrun job (rank 0 prints)

    def on_stop_signal(signum, frame):
        if signum == signal.SIGHUP:  # the terminal is gone: what would be shown goes nowhere, not to EIO
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                os.dup2(devnull, fd)
        if lifecycle.Stop.requested:
            raise KeyboardInterrupt
        lifecycle.Stop.requested, lifecycle.Stop.signal = True, signum
        if world.main:
            console.print(f"[yellow]{signal.Signals(signum).name}: stopping after this step (again to abort)...[/]")

    # Ctrl-C, SIGTERM (kill, schedulers) and SIGHUP (a closed terminal, #82) alike: finish the step,
    # checkpoint, summary, then exit; the handler goes with the run it guards (never raised at exit)
    if not world.main:
        console.quiet = True
    with handling(on_stop_signal, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
        with RunView(console, total_steps=rec.train.steps, eval_key=f"avg@{rec.eval.k}") as view:
            summary = lifecycle.run(ws, rec, resume=resume, on_event=view.on_event, world=world, started=STARTED)
    if world.main:
        view.print_summary(summary)
    if summary["status"] == "interrupted":
        sys.exit(128 + lifecycle.Stop.signal)  # 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP); `--resume` continues
    if summary["status"] == "collapsed":
        sys.exit(3)  # the guard used up its rollbacks; the final checkpoint holds the last good weights
    if summary["status"] == "engine_fault":  # the engine broke (errors.EngineFault): what, and what avoids it
        _fail(summary.get("error", "the rollout engine broke"), code=5)
    if summary["status"] == "grader_fault":  # the grader broke (errors.GraderFault): which, and its first error
        _fail(summary.get("error", "the grader broke"), code=6)
    if summary["status"] == "env_fault":  # the environment broke (errors.EnvFault): which, and its first fault
        _fail(summary.get("error", "the environment broke"), code=7)
    if summary.get("error"):  # every step done, the end not whole (its HF folder): what, and what writes it
        _fail(summary["error"], code=4)


@cli.command()
@workspace_argument
@click.option("--run", "run_name", default=None, help="A run folder's name under WORKSPACE/runs [default: the newest].")
@click.option("--follow", is_flag=True, help="Refresh every 2 s while the run goes on.")
@click.option("--plot", "plot_png", type=click.Path(dir_okay=False, path_type=Path), default=None, is_flag=False,
              flag_value=Path("metrics.png"),
              help="Also write the run's figure now (to runs/<id>/metrics.png, or the path given).")
def status(workspace: Path, run_name: str | None, follow: bool, plot_png: Path | None) -> None:
    """How a run goes, from its files alone: state (running, finished, interrupted, time_limit,
    collapsed, or killed), step, steps per second and ETA, the last metrics, held-out figures,
    the guard's rollbacks and skipped updates, and the newest checkpoint. Works from another
    terminal while the run goes on, and on a finished run."""
    import time

    from rich.live import Live

    run_dir = status_mod.run_dir_of(workspace, run_name)
    if plot_png is not None:
        out = run_dir / plot_png.name if plot_png == Path("metrics.png") else plot_png
        console.print(f"plot: {plot_metrics(run_dir / 'metrics.jsonl', out)}")
    st = status_mod.read(run_dir)
    if not follow:
        console.print(status_view(st, console.width))
        return
    with Live(status_view(st, console.width), console=console, refresh_per_second=1) as live:
        while st.state == "running":
            time.sleep(2)
            st = status_mod.read(run_dir)
            live.update(status_view(st, console.width))


for command in (eval_cmd, doctor, lab, export_cmd, push_cmd, guard_cmd, samples_cmd, check_cmd):
    cli.add_command(command)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        _fail(e.format_message())
    except UsageError as e:
        _fail(str(e))
    except RunIOError as e:
        _fail(str(e), code=4)
    except EngineFault as e:  # before a run's first step (its first sync): nothing started, no folder left
        _fail(str(e), code=5)
    except EnvFault as e:  # an evaluation whose environment failed past env.max_error_frac (a run's is in its summary)
        _fail(str(e), code=7)
    except (KeyboardInterrupt, click.exceptions.Abort):
        print("minirl: aborted", file=sys.stderr)
        sys.exit(130)


def _fail(message: str, code: int = 2) -> None:
    """One line on stderr (plain print: rich would wrap it at the terminal width), exit code 2
    (bad input), 4 (a run could not write its files), 5 (the rollout engine broke) or 7 (an evaluation's
    environment broke). Under
    torchrun rank 0 alone says it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"minirl: error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(code)


def entry() -> None:
    """The `minirl` console script and `python -m cli.main`: `main`, then exit without the
    interpreter's teardown (minirl/proc/quick_exit.py)."""
    collect_less_often()  # before any big import (minirl/proc/collector.py)
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    quick_exit(code)


if __name__ == "__main__":
    entry()
