"""A workspace folder and `minirl init`, which builds the embedded default inside it (setup/embedded.py).

Layout:
    minirl.toml                  the recipe (edit it, or override with --set)
    data/train.jsonl             embedded task, train split
    data/heldout.jsonl           embedded task, held-out split (never trained on)
    model/tokenizer/             char-level HF tokenizer
    model/coldstart/             cold-start policy, HF folder (safetensors + config + tokenizer)
    model/coldstart-dcp/         the same weights as a TorchTitan DCP checkpoint
    runs/<run-id>/               one folder per `minirl run`: metrics.jsonl, checkpoints/, summary.json
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minirl.config import recipes
from minirl.config import recipe as recipe_mod
from minirl.data.gym import RECIPE as GYM_RECIPE, TINY_PARAMS, check_params, check_task, gym_name, is_gym
from minirl.data.task import TASKS
from minirl.disk import atomic
from minirl.errors import RunIOError, UsageError
from minirl.models import hub
from minirl.models.shapes import TINY_ID, ModelShape, active_params, param_count
from minirl.setup.embedded import build_embedded_default, tiny_shape
from minirl.setup.preflight import check_planned

RECIPE_NAME = "minirl.toml"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @property
    def recipe_path(self) -> Path:
        return self.root / RECIPE_NAME

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def path(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.root / p

    def runs_newest_first(self) -> list[Path]:
        """Run folders, newest first (their names are start times)."""
        return sorted((p for p in self.runs.glob("*") if p.is_dir()), reverse=True) if self.runs.is_dir() else []

    @classmethod
    def open(cls, root: Path) -> "Workspace":
        root = Path(root)
        if not (root / RECIPE_NAME).is_file():
            # a folder in a workspace (a run's, the model's) given for the workspace: never `minirl init` in there
            inside = None if not root.is_dir() else next(
                (p for p in root.absolute().parents if (p / RECIPE_NAME).is_file()), None)
            if inside is not None:
                raise UsageError(f"{root} is not a minirl workspace (no {RECIPE_NAME}); it is inside the workspace "
                                 f"{inside}: give that")
            beside = sorted(p.parent.name for p in root.absolute().parent.glob(f"*/{RECIPE_NAME}"))
            hint = f"; workspaces beside it: {', '.join(beside[:5])}{', ...' if len(beside) > 5 else ''}" if beside else ""
            raise UsageError(f"{root} is not a minirl workspace (no {RECIPE_NAME}){hint}; create one with "
                             f"`minirl init {root}`")
        return cls(root.resolve())


def init_workspace(
    root: Path,
    *,
    recipe_name: str | None = None,
    model: str | None = None,
    task: str | None = None,
    force: bool = False,
    overrides: list[str] = (),
    progress: Callable[[str, int, int, dict], None] | None = None,
) -> dict:
    """Create a workspace; for the embedded default also build data, model and cold start.

    model: a Qwen3 / Qwen3-MoE to train instead (short name, Hub repo id or local HF folder): its
    shipped recipe (else recipes/qwen3.toml) suited to its architecture, no cold start. Only its
    config is read (nothing of a known short name), never its weights.
    task: an embedded task of minirl/data/task.py (its shipped recipe unless `recipe_name` is given).
    Returns a report dict. Refuses to touch an existing workspace unless `force`.
    `progress(stage, done, total, info)` is called as work advances.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{root} exists and is not a folder")
    model_report: dict = {}
    if task is not None:
        if model is not None:
            raise UsageError("--task builds an embedded task for the tiny model; it does not go with --model")
        if is_gym(task):
            check_task(task)
        elif task not in TASKS:
            raise UsageError(f"unknown task {task!r}: one of {', '.join(TASKS)}, or rg:NAME (a reasoning-gym task)")
        recipe_name = recipe_name or (GYM_RECIPE if is_gym(task) else TASKS[task].recipe)
        shipped = recipes.load(recipes.shipped(recipe_name)).cold_start
        if shipped.task != task:
            overrides = [f"cold_start.task={task}", *overrides]
            if is_gym(task) and not any(o.startswith("cold_start.task_params") for o in overrides):
                # the tiny model's size of the task where one is known, else reasoning-gym's defaults;
                # written into the workspace's recipe
                params = TINY_PARAMS.get(gym_name(task), {})
                overrides.insert(1, f"cold_start.task_params={json.dumps(params)}")
    if model is not None:
        recipe_name, overrides, model_report = recipe_for_model(model, recipe_name, list(overrides))
    src = recipes.shipped(recipe_name or "tiny")
    rec = recipes.load(src, list(overrides))  # a bad recipe or --set fails before anything is written
    # and what every run of it would refuse (a LoRA target the model lacks, replay on a dense model)
    check_planned(rec, tiny_shape(rec) if rec.model.id == TINY_ID else hub.model_shape(rec.model.id, "", Path.cwd()))
    if rec.model.id == TINY_ID and is_gym(rec.cold_start.task):  # its generator's parameters, by their types
        check_params(rec.cold_start.task, rec.cold_start.task_params)
    if (root / RECIPE_NAME).exists() and not force:
        _refuse_another_request(root, src if recipe_name else None, list(overrides))
        raise FileExistsError(str(root))  # what was asked for is what is there: left as it is
    if force and root.exists():
        for sub in ("data", "model", "runs"):
            shutil.rmtree(root / sub, ignore_errors=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only, no permission, /proc: one line, nothing written
        raise RunIOError(f"cannot create the workspace {root}: {e.strerror or e} ({e.filename or root}); nothing was "
                         "written (choose a folder you can write)") from None
    ws = Workspace(root.resolve())
    report: dict = {"workspace": str(ws.root), "recipe": src.stem, **model_report}

    if rec.model.id == TINY_ID:
        report.update(build_embedded_default(ws, rec, progress=progress))
    # Written last: a workspace counts as created only once everything above succeeded.
    if overrides:  # the resolved recipe, --set values folded in, under the shipped one's notes
        lines = src.read_text().splitlines()
        notes = lines[: next((i for i, x in enumerate(lines) if not x.startswith("#")), len(lines))]
        atomic.write_text(ws.recipe_path, "".join(x + "\n" for x in notes) + "\n" + rec.to_toml())
    else:  # whole or not at all: a recipe torn by a kill would count as a workspace
        atomic.write_text(ws.recipe_path, src.read_text())
    return report


def planned_recipe(workspace: Path, model: str | None, recipe_name: str | None,
                   overrides: list[str]) -> tuple[recipe_mod.Recipe, str, ModelShape]:
    """What `minirl run --dry-run` plans, and the name of the recipe it came from: the workspace's
    recipe if `workspace` is one; else what `minirl init WS --model MODEL` and `minirl run WS` would
    run (the model's shipped recipe, or recipes/qwen3.toml, suited to its architecture); else the
    named shipped recipe, else the defaults. What the run would refuse of it before any engine starts
    is `preflight.check_planned`'s (the dry run calls it once its mesh is fitted to the machine)."""
    if (Path(workspace) / RECIPE_NAME).exists():
        path, base = Path(workspace) / RECIPE_NAME, Path(workspace).resolve()
    elif model is not None and model != TINY_ID:
        recipe_name, overrides, _ = recipe_for_model(model, recipe_name, overrides)
        path, base = recipes.shipped(recipe_name), Path.cwd()
    else:
        path, base = (recipes.shipped(recipe_name) if recipe_name else None), Path.cwd()
    rec = recipes.load(path, overrides)
    shape = hub.model_shape(rec.model.id, rec.model.path, base)
    return rec, str(path or "defaults"), shape


def _refuse_another_request(root: Path, shipped: Path | None, overrides: list[str]) -> None:
    """An existing workspace is left as it is only when it already is what this init asks for:
    every key the request sets (--model, --task, --set; with --recipe, the whole recipe) has that
    value in its recipe. Otherwise one line names the first key that differs."""
    have = recipes.load(root / RECIPE_NAME)
    differ = have.changes(recipes.load(shipped or root / RECIPE_NAME, overrides))
    if differ:
        k, (theirs, ours) = next(iter(differ.items()))
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise UsageError(f"{root} is a workspace already, with {k} = {theirs!r}; this init asks for {ours!r}{more}. "
                         "`--force` rebuilds it (its data, model and runs are deleted), or choose another folder")


def recipe_for_model(model: str, recipe_name: str | None, overrides: list[str]) -> tuple[str, list[str], dict]:
    """The recipe, the overrides and the report lines for `init --model` (and the plan of
    `run --model --dry-run`, which plans what init and run would run): the model's shipped recipe,
    else recipes/qwen3.toml, suited to its architecture, read from its config (one line, exit 2,
    when it cannot be read or is not supported). Nothing depends on the machine that asks."""
    if Path(model).exists():
        model = str(Path(model).resolve())  # the workspace works from any folder
    shape = hub.model_shape(model, "", Path.cwd())
    name = recipe_name or (recipes.for_model(model).stem if recipes.for_model(model) else "qwen3")
    suited = [f"model.id={model}", "model.path="]
    if not shape.is_moe:  # routing replay and expert parallel have nothing to act on
        suited += ["train.replay=off", "parallel.ep=1"]
    report = {"model": model, "moe": shape.is_moe, "params": param_count(shape), "active": active_params(shape)}
    return name, suited + overrides, report
