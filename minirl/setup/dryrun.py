"""`minirl run --dry-run` as a report: the recipe it resolves, the mesh fitted to the machine asked
about, the plan (setup/plan.py), the launch lines, the cheapest changes that fit and, where it does
not fit, the one line it is refused with. Nothing here prints: the CLI prints the report.

Needs no GPU, no weights and no workspace: the recipe is the workspace's, else the model's shipped
one, else the named shipped recipe, else the defaults (`workspace.planned_recipe`). What `run`
would refuse before any engine starts is refused here with the same line (`preflight.check_planned`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minirl.config import recipes
from minirl.config.recipe import Recipe
from minirl.config.recipes import with_sets
from minirl.models.hub import resolution
from minirl.models.shapes import TINY_ID
from minirl.setup.advice import advise, describe, refusal
from minirl.setup.plan import Plan, fit_mesh, make_plan
from minirl.setup.preflight import check_planned
from minirl.setup.workspace import RECIPE_NAME, planned_recipe


MAX_RESTARTS = 3  # a job that loses ranks more often than this needs a person


def launch_commands(nodes: int, gpus_per_node: int, args: str) -> list[str]:
    """How to start `minirl <args>` on the plan's layout: one process, or torchrun on every node
    (each rank then runs the same loop on its share; launch.py). A torchrun job restarts itself
    after a lost rank (`--max-restarts`) and continues from the newest checkpoint (`--resume auto`)."""
    if nodes * gpus_per_node == 1:
        return [f"minirl {args}"]
    restart = f"--max-restarts {MAX_RESTARTS}"
    if nodes == 1:
        return [f"torchrun --nproc-per-node {gpus_per_node} {restart} -m cli.main {args} --resume auto"]
    # a fresh rendezvous store per attempt, or a restart meets the dead attempt's addresses (launch.py)
    return [f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} "
            f"{restart} --rdzv-backend c10d "
            f"--rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $JOB_ID -m cli.main {args} --resume auto"
            f"   # on each of the {nodes} nodes"]


@dataclass
class DryRun:
    recipe: Recipe  # resolved, the mesh fitted to the machine asked about
    recipe_label: str  # the file it came from, or "defaults"
    plan: Plan
    fitted: dict  # what the fitting lowered: `--set` keys and values, also in the launch line
    launch: list[str]  # commands, in order
    advice: list[str] = field(default_factory=list)  # the cheapest change that fits; where that is LoRA, every weight's
    notes: list[str] = field(default_factory=list)  # lines for the user before the plan
    refused: str = ""  # the one line a plan that does not fit is refused with

    @property
    def fits(self) -> bool:
        return self.plan.fits


def dry_run(workspace: Path, *, model_id: str | None, recipe_name: str | None, sets: list[str], user_sets: list[str],
            launch_flags: list[tuple[str, object]], nodes: int | None, gpus_per_node: int | None,
            gpu_gib: float) -> DryRun:
    """The dry run of `minirl run` with these arguments: `sets` are every `--set` the flags make
    (the user's `user_sets` among them); `launch_flags` the (flag, value) pairs the launch line
    repeats. A machine named by --nodes / --gpus-per-node (alone: one node of it) fits the recipe's
    expert and rollout tensor parallelism to it, never a value the user set."""
    sets = list(sets)
    if gpus_per_node is not None and nodes is None:  # one machine named: one node of it
        sets.append("parallel.nodes=1")
    machine = nodes is not None or gpus_per_node is not None
    given = frozenset(x.split("=", 1)[0].strip() for x in user_sets)  # what the user set: never lowered
    base, label, shape = planned_recipe(workspace, model_id, recipe_name, sets)
    fitted = fit_mesh(base, shape, given) if machine else {}
    rec = with_sets(base, fitted) if fitted else base
    check_planned(rec, shape)  # what `run` refuses before any engine starts, with its line
    notes = []
    if fitted:  # the machine asked about has fewer GPUs than the recipe's mesh: the plan, and its launch line, say so
        notes.append(f"for {rec.parallel.nodes} × {rec.parallel.gpus_per_node} GPU(s): "
                     + ", ".join(f"{k} = {v}" for k, v in fitted.items())
                     + " (the recipe's mesh needs more GPUs; the launch line below sets them)")
    if resolution(rec.model.id):
        notes.append(resolution(rec.model.id))
    tp = rec.rollout.tensor_parallel
    if rec.parallel.rollout_gpus and tp > 1:  # planned, not yet run: said before the plan
        notes.append(f"parallel.rollout_gpus = {rec.parallel.rollout_gpus} with rollout.tensor_parallel = {tp}: planned "
                     "below; `minirl run` starts engines of one GPU each on rollout GPUs and refuses TP > 1 in one line")
    plan = make_plan(rec, shape, model=rec.model.id, gpu_gib=gpu_gib)  # rec: fitted above, as plan_for would
    ro = rec.rollout
    if ro.precision == "fp8" and plan.sleep_level == 2 and not ro.cuda_graphs:  # the validator's #72 rule, said
        notes.append("FP8 rollouts decode eagerly (rollout.cuda_graphs = false; slower than through CUDA graphs): "
                     "with graphs, vLLM's FP8 MoE decode returned non-finite log-probs after a level-2 sleep on an "
                     "H200 (#72), refused until a GPU visit confirms a fix (docs/precision.md)")
    if ro.max_staleness and not ro.inflight_updates:  # what k buys depends on it (docs/results/async.md)
        notes.append(f"rollout.max_staleness = {ro.max_staleness}, one batch at a time: each sync waits until the "
                     "engines have finished the batches sent before it, so the next batch cannot fill the slots a "
                     "batch's longest responses leave empty; rollout.inflight_updates = true lets it (fresher "
                     "tokens, the run no longer repeats exactly; simulated in docs/results/async.md)")
    if rec.data.chat_template:  # what the model is asked to write (#81: Qwen3 thinks unless told not to)
        kw = rec.data.chat_template_kwargs
        notes.append("prompts go through the model's chat template as one user turn"
                     + (f", with {', '.join(f'{k} = {v}' for k, v in kw.items())} (data.chat_template_kwargs)" if kw else
                        ", with the template's defaults (Qwen3's: thinking on; data.chat_template_kwargs sets them)"))
    has_ws = (Path(workspace) / RECIPE_NAME).exists()
    args = " ".join(["run", str(workspace) if has_ws else "WORKSPACE", *(f"{k} {v}" for k, v in launch_flags if v),
                     *(f"--set {x}" for x in [*user_sets, *(f"{k}={v}" for k, v in fitted.items())])])
    init = " ".join(["minirl init WORKSPACE", f"--model {model_id or rec.model.id}",
                     *([f"--recipe {recipe_name}"] if recipe_name else [])])
    first = [] if has_ws or not (model_id or recipe_name) else [init]
    # the trainer's ranks: every GPU but each node's rollout GPUs, which the job's engines take
    ranks = rec.parallel.gpus_per_node - rec.parallel.rollout_gpus
    report = DryRun(rec, label, plan, fitted, first + launch_commands(rec.parallel.nodes, ranks, args), notes=notes)
    if not plan.fits:
        for lora in (True, False):
            found = advise(base, shape, model=rec.model.id, gpu_gib=gpu_gib, lora=lora, fit=machine, keep=given)
            if found and describe(*found) not in report.advice:
                report.advice.append(describe(*found))
        shipped = recipes.for_model(model_id) if model_id else None
        own = recipes.load(Path(label)).model.id if label != "defaults" else TINY_ID
        hint = (f"; this recipe is {own}'s: {model_id}'s own is recipes/{shipped.name} (`minirl init WS --model "
                f"{model_id}`)" if shipped and own != model_id else "")
        report.refused = refusal(plan, report.advice, hint)
    return report
