"""`minirl doctor` and `minirl lab`: what the training–inference gap is made of, and the paper's
findings reproduced on the embedded default."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import click

from cli.options import workspace_argument
from cli.render import SET_HELP, console
from minirl.config import recipes
from minirl.config.precisions import NAMES as PRECISIONS
from minirl.disk.store import latest_trained
from minirl.errors import UsageError
from minirl.eval.checkpoints import resolve_checkpoint
from minirl.setup.workspace import Workspace, init_workspace


@click.command()
@workspace_argument
@click.option("--checkpoint", default="latest", show_default=True,
              help="'latest' (newest run checkpoint, else the cold start), 'coldstart', a run checkpoint or an HF folder.")
@click.option("--seeds", type=int, default=3, show_default=True, help="Fixed batches to draw (figures: mean ± spread).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the report [default: the workspace's doctor/].")
def doctor(workspace: Path, checkpoint: str, seeds: int, overrides: tuple[str, ...], out: Path | None) -> None:
    """Say where the training–inference mismatch KL(μ‖π) comes from.

    On one fixed batch of rollouts (the recipe's B × G, --seeds times): rollout precision (fp32,
    bf16, fp8, and weights alone), engine and kernels at equal precision, MoE routing (per-layer
    disagreement, KL with and without R3) and staleness (KL(π_θ‖π_θold) after 1, 2, 4, 8
    mini-batch updates without replay, with R2 and with R3). Prints a table and advice; writes
    doctor-<time>.json and .png in the workspace's doctor/ folder (or --out).
    """
    from rich.table import Table

    from minirl.lab import doctor as doc  # deferred: torch, after _prepare_env set the engines' environment

    if seeds < 1:
        raise UsageError(f"--seeds {seeds}: at least 1")
    ws = Workspace.open(workspace)
    rec = recipes.load(ws.recipe_path, list(overrides))
    n = max(doc.STALENESS_UPDATES)
    if rec.train.prompts_per_step % n:
        raise UsageError(f"train.prompts_per_step = {rec.train.prompts_per_step}: the doctor measures staleness over "
                         f"{n} mini-batches of one step's prompts, so it needs a multiple of {n} "
                         f"(--set train.prompts_per_step=…)")
    if checkpoint == "latest" and latest_trained(ws) is None:
        checkpoint = "coldstart"  # no run has trained yet: the starting policy (a damaged checkpoint is an error)
        console.print("doctor: no run has trained a step yet; diagnosing the cold start")
    folder = resolve_checkpoint(ws, rec, checkpoint)
    with console.status("doctor...") as status:
        report = doc.diagnose(ws, rec, folder, seeds=seeds, progress=lambda what: status.update(f"doctor: {what}"))
    f = report["figures"]
    pm = lambda k: f"{f[k]['mean']:.2e} ± {f[k]['spread']:.1e}"  # noqa: E731
    table = Table(title=f"KL(μ‖π), k3 estimator (never below 0; runs log k1), and its sources ({report['batch']}, "
                        f"sampled at T = {report['temperature']:g}{cut_note(report['cuts'])}, {seeds} seed(s), "
                        f"checkpoint {folder})")
    table.add_column("source")
    table.add_column("what is compared")
    table.add_column("KL", justify="right")
    rows = [("precision", "fp32 rollouts (vLLM fp32 vs TorchTitan fp32: engine and kernels alone)", "kl/fp32"),
            ("precision", "bf16 rollouts (vLLM bf16)", "kl/bf16"),
            ("precision", "fp8-weights rollouts (vLLM bf16, FP8 weights alone)", "kl/fp8-weights"),
            ("precision", "fp8 rollouts (W8A8: FP8 weights and per-token activations)", "kl/fp8"),
            ("precision", "e5m2 rollouts (W8A8 in e5m2: beyond the paper)", "kl/e5m2"),
            ("precision", "nvfp4 rollouts (W4A4 in NVFP4: beyond the paper)", "kl/nvfp4"),
            ("weights", "bf16-rounded weights in fp32 vLLM (same tokens as fp32)", "kl/weights_bf16"),
            ("weights", "fp8-rounded weights in fp32 vLLM (same tokens as fp32)", "kl/weights_fp8")]
    if report["moe"]:
        rows[6:6] = [("precision", f"{p} rollouts, vLLM's routes replayed (R3)", f"kl_r3/{p}") for p in ("bf16", "fp8")]
        rows += [("routing", f"{rec.rollout.precision} rollouts, trainer's own routes", "kl/run_no_replay"),
                 ("routing", f"{rec.rollout.precision} rollouts, vLLM's routes replayed (R3)", "kl/run_r3")]
    if "kl/uncut_pi" in f:  # the recipe cuts its sampler: what π over the whole vocabulary would add
        rows.append(("truncation", f"{rec.rollout.precision} rollouts, π over the whole vocabulary instead of the "
                     "sampler's kept set", "kl/uncut_pi"))
    for src, what, k in rows:
        table.add_row(src, what, pm(k))
    for p in PRECISIONS[1:]:
        table.add_row("per response", f"SD of log π(y)/μ(y), {p} (√(2·L·KL) predicts "
                      f"{f[f'response_sd_predicted/{p}']['mean']:.2f}; L = {f[f'length/{p}']['mean']:.1f})",
                      f"{f[f'response_sd/{p}']['mean']:.3f} ± {f[f'response_sd/{p}']['spread']:.2f}")
    if report["moe"]:
        per_layer = ", ".join(f"{x['mean']:.1%}" for x in f["routing/disagree_per_layer"])
        table.add_row("routing", "tokens whose top-k differ, per layer", per_layer)
        table.add_row("routing", "tokens whose top-k differ in any layer: " + ", ".join(PRECISIONS),
                      ", ".join(f"{f[f'routing/tokens_with_a_flip/{p}']['mean']:.1%}" for p in PRECISIONS))
    for mode in ("off", "r2", "r3") if report["moe"] else ("off",):
        table.add_row("staleness", f"KL(π_θ‖π_θold) after 1/2/4/8 updates, {mode}",
                      " / ".join(f"{f[f'staleness/{mode}/{n}']['mean']:.1e}" for n in doc.STALENESS_UPDATES))
    if "staleness/behind" in f:  # sampling ahead: the KL over how far behind the trained tokens were
        table.add_row("staleness", f"sampling {report['max_staleness']} ahead: KL(π_θ‖π_θold) over the trained tokens' "
                      f"lag ({report['staleness_source']})", pm("staleness/behind"))
    console.print(table)
    js, png = doc.write(report, out or ws.root / "doctor")
    for line in report["advice"]:
        console.print(f"[bold]advice:[/] {line}", soft_wrap=True)
    console.print(f"report: {js}  plot: {png}", soft_wrap=True)


def cut_note(cuts: dict | None) -> str:
    """The sampler's cuts a doctor report sampled with, for its table's title ('' where none)."""
    if not cuts:
        return ""
    named = {"top_p": ("top-p", 1.0), "top_k": ("top-k", 0), "min_p": ("min-p", 0.0)}
    return "".join(f", {label} {cuts[k]:g}" for k, (label, off) in named.items() if cuts[k] != off)


@click.command()
@click.argument("args", nargs=-1, metavar="STUDY [WORKSPACE]")
@click.option("--quick", is_flag=True, help="A study's smoke check (2 seeds, 20 steps).")
@click.option("--seeds", type=int, default=None, help="Runs per arm [default: 5 for a study, 3 for lr, 2 with --quick]; "
                                                      "a study pairs arms by seed.")
@click.option("--dose-seeds", type=int, default=2, show_default=True,
              help="A study's seeds at each other level of the mismatch dial (the dose–response); 0: the study's "
                   "level only (as with --quick).")
@click.option("--report-only", is_flag=True, help="Write the report and figures from the runs done so far; run nothing.")
@click.option("--confirm", is_flag=True,
              help="A study's confirmation stage: the comparisons its report found short of power, run again on as "
                   "many fresh seeds as power 0.8 needs and decided on those alone.")
@click.option("--at", "at", default=None, metavar="LEVEL",
              help="A study's follow-up at another level of its measured dial, where its dose–response showed "
                   "something: its arms on fresh seeds (--seeds, default 5) at LEVEL, decided on those alone.")
@click.option("--arm", "arms", multiple=True, metavar="NAME",
              help="One of a study's arms, by name (repeat it): those arms only, and the comparisons among them; "
                   "which to test chosen before the first run where the machine cannot afford every arm at the seeds "
                   "a verdict needs.")
@click.option("--rescore", default=None, metavar="PRECISION", type=click.Choice(PRECISIONS),
              help="After a study's runs: each run's last checkpoint evaluated again on the held-out split with "
                   "PRECISION rollouts (fp32: the trainer's policy itself), reported beside its own engine's score "
                   "as an exploratory section; resumable, never redone.")
def lab(args: tuple[str, ...], quick: bool, seeds: int | None, dose_seeds: int, report_only: bool,
        confirm: bool, at: str | None, arms: tuple[str, ...], rescore: str | None) -> None:
    """Reproduce the paper's stability findings (F1-F6) in miniature.

    `minirl lab STUDY [WORKSPACE]` runs one study (is: F1, F3 with a placebo; offpolicy: F4, F5;
    lengthnorm: F2; coldstart: F6) over paired seeds and decides each finding by a statistical
    test fixed in advance (WORKSPACE/lab/study-STUDY/report.md). `minirl lab lr [WORKSPACE]`
    first: the learning rate chosen on the MiniRL control arm, then frozen for every other study.

    `minirl lab STUDY [WORKSPACE] --confirm`, once the study has run: where its verdicts were
    "not observed" for want of power, a second stage runs the seeds power 0.8 needs, fresh, and
    decides those comparisons on them alone (.../study-STUDY/full/confirm/report.md).

    `minirl lab STUDY [WORKSPACE] --at LEVEL`, once the study has run: its arms (not the placebo)
    at another level of the dial it measured, on fresh seeds, decided on those alone
    (.../study-STUDY/full/at-LEVEL/report.md).

    Each builds WORKSPACE (default ./minirl-lab) with `minirl init --task scratchpad` when it
    does not exist.
    """
    from minirl.lab.studies import LR_STUDY, STUDIES, with_arms  # deferred: torch and scipy, after _prepare_env

    if len(args) > 2:
        raise UsageError(f"minirl lab STUDY [WORKSPACE]: {len(args)} arguments given")
    study = args[0] if args and args[0] in STUDIES else None
    rest = args[1:] if study else args
    if len(rest) > 1:
        raise UsageError(f"{rest[0]!r} is not a study ({', '.join(STUDIES)})")
    workspace = Path(rest[0]) if rest else Path("minirl-lab")
    if seeds is not None and seeds < 1:
        raise UsageError(f"--seeds {seeds}: at least 1")
    if dose_seeds < 0:
        raise UsageError(f"--dose-seeds {dose_seeds}: 0 or more")
    if confirm and study is None:
        raise UsageError("--confirm confirms a study: minirl lab STUDY [WORKSPACE] --confirm")
    if confirm and seeds is not None:
        raise UsageError("--confirm takes its seeds from the first stage's power, not from --seeds")
    if at is not None and (study is None or confirm):
        raise UsageError("--at follows up a study at another dial level: minirl lab STUDY [WORKSPACE] --at LEVEL "
                         "(not with --confirm)")
    if at is not None and at not in PRECISIONS[1:]:
        raise UsageError(f"--at {at}: not a level of the mismatch dial ({', '.join(PRECISIONS[1:])})")
    if arms and (study is None or confirm):
        raise UsageError("--arm picks some of a study's arms: minirl lab STUDY [WORKSPACE] --arm A --arm B (not "
                         "with --confirm, whose arms its declaration names)")
    if rescore is not None and (study is None or study == LR_STUDY):
        raise UsageError("--rescore evaluates a study's runs again to compare its arms: minirl lab STUDY [WORKSPACE] "
                         "--rescore PRECISION (not the lr study)")
    if study is None:
        raise UsageError(f"minirl lab STUDY [WORKSPACE]: name a study ({', '.join(STUDIES)}); the first version's "
                         "grid was retired for them (its results: docs/results/lab.md)")
    arm_names = list(arms) or None
    if arm_names is not None:
        try:
            with_arms(STUDIES[study], arm_names)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if not (workspace / "minirl.toml").exists():
        if report_only:
            raise UsageError(f"no lab workspace at {workspace}: run `minirl lab STUDY {workspace}` first")
        with console.status(f"building {workspace} (minirl init --task scratchpad; a few minutes)..."):
            init_workspace(workspace, task="scratchpad")
    ws = Workspace.open(workspace)
    rec = recipes.load(ws.recipe_path)
    if rec.cold_start.task not in ("scratchpad", "scratchpad-long"):
        raise UsageError(f"{workspace} is not a scratchpad workspace: the lab needs long responses "
                         f"(`minirl init DIR --task scratchpad` or `--task scratchpad-long`)")
    from minirl.lab import staging, stages  # deferred: torch and scipy, after _prepare_env

    if study != LR_STUDY and not report_only:
        staging.check_lr_frozen(ws.root, ws.recipe_path, rec.train.lr)
    prompts = rec.train.prompts_per_step
    if confirm:
        stage = staging.confirmation(ws.root, STUDIES[study], quick=quick, prompts=prompts, report_only=report_only)
    elif at is not None:
        stage = staging.follow_up(ws.root, STUDIES[study], level=at, quick=quick, seeds=seeds, arms=arm_names,
                                  prompts=prompts, report_only=report_only, measuring=_measuring)
    else:
        stage = staging.first_stage(ws.root, STUDIES[study], arm_names, quick=quick, seeds=seeds,
                                    dose_seeds=dose_seeds, prompts=prompts, report_only=report_only,
                                    measuring=_measuring)
    if isinstance(stage, str):  # nothing to run
        console.print(stage, soft_wrap=True)
        return
    console.print(stage.headline, soft_wrap=True)
    res, report = _run_and_report(stage.lab, stage.study, stage.plan, stage.mech, report_only=report_only,
                                  confirmation=stage.confirmation, follow_up=stage.follow_up, rescore=rescore)
    if study == LR_STUDY and not quick and not report_only:  # every seed has run: the choice stands
        lr = stages.record_lr_choice(ws.root, res.get(stage.plan.level, {}), report)
        if lr is not None:
            console.print(f"learning rate: {lr:g}; every other study in {ws.root} takes the recipe's, so set "
                          f"train.lr = {lr:g} in {ws.recipe_path}", soft_wrap=True)


@contextlib.contextmanager
def _measuring():
    with console.status("the mismatch dial: minirl doctor on the cold start...") as status:
        yield status.update


def _run_and_report(lab_, study, sp, mech, *, report_only: bool, confirmation: dict | None = None,
                    follow_up: dict | None = None, rescore: str | None = None) -> tuple[dict, Path]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from minirl.lab import stages, studies  # deferred: torch and scipy, after _prepare_env set the engines' environment
    from minirl.lab import report as study_report

    if not report_only:
        todo = sp.todo()
        with Progress(TextColumn("{task.description:<58}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console) as prog:
            bar = prog.add_task(study.name, total=len(todo))
            plain = not console.is_terminal  # a log: rich draws no live bars there, so say where the study is in lines

            def on_run(what: str, i: int, n: int) -> None:
                prog.update(bar, description=what, completed=i)
                if plain:
                    where = f"run {i + 1}/{n}: {what}" if i < n else f"{what}: {n} runs"
                    console.print(f"{time.strftime('%H:%M:%S')} {where}", soft_wrap=True)

            studies.run(lab_, study, sp, on_run=on_run, progress=lambda what: prog.update(bar, description=what))
    rescored = (rescore, _rescore(lab_, studies.primary_runs(lab_, sp), rescore)) if rescore else None
    res = studies.arm_results(lab_, sp)
    for cmp, text, _ in studies.decide(study, res.get(sp.level, {})):
        console.print(f"[bold]{cmp.finding}[/] {cmp.claim}: {text}", soft_wrap=True)
    path = study_report.write_report(study, sp, res, mech, lab_.out, confirmation=confirmation, follow_up=follow_up,
                                lr_choice=stages.chosen_lr(lab_.ws_root), rescored=rescored,
                                temperature=recipes.load(lab_.ws_root / "minirl.toml").rollout.temperature)
    console.print(f"report: {path}", soft_wrap=True)
    return res, path


def _rescore(lab_, runs: dict, precision: str) -> dict:
    """The study's runs' last checkpoints scored at `precision` (rescore.py), with a bar; it may run
    beside the study's own process (its own lock and file), e.g. on the pairs finished so far."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from minirl.lab import rescore as rescore_mod  # deferred: torch, after _prepare_env

    with Progress(TextColumn("{task.description:<58}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as prog:
        bar = prog.add_task(f"rescore at {precision}", total=None)

        def on_run(what: str, i: int, n: int) -> None:
            prog.update(bar, description=what, completed=i, total=n)
            if not console.is_terminal:
                console.print(f"{time.strftime('%H:%M:%S')} {what}" + (f" ({i + 1}/{n})" if i < n else ""),
                              soft_wrap=True)

        return rescore_mod.rescore(lab_, runs, precision, on_run=on_run)
