"""A workspace folder and `minirl init`, which builds the embedded default inside it.

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

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minirl.config import recipes
from minirl.config import recipe as recipe_mod
from minirl.data.gym import (RECIPE as GYM_RECIPE, TINY_PARAMS, check_params, check_task, gym_name, is_gym,
                             make_gym_splits)
from minirl.data.prompts import prompts_ids, response_text
from minirl.data.task import TASKS, make_splits, write_jsonl
from minirl.disk import atomic
from minirl.envs.formats import TINY as TINY_FORMAT
from minirl.envs.hosting import check_start
from minirl.envs.templates import format_for
from minirl.errors import RunIOError, UsageError
from minirl.models import hub, sizing
from minirl.models.shapes import TINY, TINY_ID, ModelShape, active_params, param_count
from minirl.setup.preflight import check_planned
from minirl.setup.tokenizer import CHAT_VOCAB, WIDE_VOCAB, build_tokenizer
from rewards import load_grader

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


def tiny_shape(rec) -> ModelShape:
    """The tiny model `init` builds for a recipe: its [cold_start] layers, experts and top-k, with a
    context that fits the recipe's prompts and responses (a multiple of 32)."""
    cs, need = rec.cold_start, sizing.max_model_len(rec)  # a multi-turn task's replies included
    return dataclasses.replace(TINY, max_seq_len=max(TINY.max_seq_len, -(-need // 32) * 32), n_layers=cs.layers,
                               num_experts=cs.experts, top_k=cs.top_k,
                               # English text; with the chat template, Qwen3's chat tokens too
                               vocab_size=CHAT_VOCAB if rec.data.chat_template else
                               WIDE_VOCAB if is_gym(cs.task) else TINY.vocab_size)


def build_embedded_default(ws: Workspace, rec, *, progress=None) -> dict:
    """Tokenizer, tiny Qwen3-MoE, task splits and the cold-start SFT, all through the real engines."""
    import torch  # deferred, with the three below: the CLI imports this module at start

    from minirl.train.hf_io import save_hf_folder  # deferred: torch
    from minirl.train.sft import cold_start, sampled_accuracy
    from minirl.train.trainer import Trainer

    def tell(stage: str, done: int, total: int, **info) -> None:
        if progress is not None:
            progress(stage, done, total, info)

    cs = rec.cold_start
    shape = tiny_shape(rec)
    t0 = time.time()
    chat = rec.data.chat_template  # the tiny model speaks Qwen3's chat format (setup/tokenizer.py)
    tok_dir = build_tokenizer(ws.root / "model" / "tokenizer", shape.vocab_size, shape.max_seq_len, chat=chat)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    eos = tok.eos_token_id
    tell("data", 0, 1)
    # the model is told its tools, and its calls and replies are written, as a run of this recipe does
    tools = check_start(rec.env, {}, seed=0) if chat and rec.env.name else []
    fmt = (format_for(rec.env.tool_format, tok, chat=chat, chat_kwargs=rec.data.chat_template_kwargs, tools=tools)
           if rec.env.name else TINY_FORMAT)
    if is_gym(cs.task):
        train, heldout = make_gym_splits(cs.task, cs.task_params, cs.train_size, cs.heldout_size, seed=cs.seed)
        _check_prompts_fit(cs.task, train + heldout, rec.data.max_prompt_tokens)
    else:
        train, heldout = make_splits(cs.train_size, cs.heldout_size, seed=cs.seed, task=cs.task, fmt=fmt)
    write_jsonl(ws.path(rec.data.train), train)
    write_jsonl(ws.path(rec.data.heldout), heldout)
    tell("data", 1, 1)

    tell("model", 0, 1)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    prompts = prompts_ids(tok, [r["prompt"] for r in train], template=rec.data.prompt_template, chat=chat,
                          chat_kwargs=rec.data.chat_template_kwargs, tools=tools or None)
    # the SFT target: the whole written-out response where the task has one, else the answer; a multi-turn
    # task's parts, its environment's reply masked out (the model reads it, never learns to write it)
    examples = [(p, ids(r.get("target", r["answer"])) + [eos]) if "parts" not in r else
                (p, [t for x, _ in r["parts"] for t in ids(x)] + [eos],
                 [int(m) for x, m in r["parts"] for _ in ids(x)] + [1])
                for p, r in zip(prompts, train)]
    trainer = Trainer(shape, lr=cs.lr, seed=cs.seed)
    tell("model", 1, 1)

    dev, sft_examples = examples[: cs.dev_size], examples[cs.dev_size :]
    grader = load_grader(rec.reward.grader, rec.reward.params)  # dev accuracy as RL will count it

    def is_correct(i: int, ids: list[int]) -> bool:
        text = response_text(ids, tok.decode, eos)
        # a multi-turn task sampled without its environment: its first call written right counts (the
        # environment would answer it; copying the answer is learnt alongside)
        parts = train[i].get("parts") or []
        reply_at = next((j for j, (_, trained) in enumerate(parts) if not trained), None)
        if reply_at is not None and text.startswith("".join(x for x, _ in parts[:reply_at])):
            return True
        return grader(train[i], text).score >= 1.0

    losses: list[float] = []
    dev_acc: list[float] = []

    def on_step(step: int, loss: float) -> None:
        losses.append(loss)
        if step % 10 == 0:
            tell("cold-start", step + 1, cs.max_steps, loss=sum(losses[-10:]) / len(losses[-10:]),
                 dev_acc=dev_acc[-1] if dev_acc else 0.0)

    def reached_target(step: int) -> bool:
        dev_acc.append(sampled_accuracy(trainer, dev, eos_id=eos, max_tokens=rec.rollout.max_tokens, seed=step,
                                        is_correct=is_correct))
        return dev_acc[-1] >= cs.target_acc

    t_sft = time.time()
    steps_run, final_loss = cold_start(
        trainer, sft_examples, max_steps=cs.max_steps, batch_size=cs.batch_size, lr=cs.lr,
        pad_id=tok.pad_token_id, seed=cs.seed, stop_when=reached_target, on_step=on_step, check_every=cs.check_every,
    )
    # the bar ends where SFT stopped (the dev target can end it long before max_steps)
    tell("cold-start", steps_run, steps_run, loss=final_loss, dev_acc=dev_acc[-1] if dev_acc else 0.0)
    sft_s = time.time() - t_sft
    tell("save", 0, 1)
    out = ws.path(rec.model.path)
    save_hf_folder(out, shape, trainer.model.state_dict(), tokenizer_dir=tok_dir, dtype=torch.float32)
    trainer.save(ws.root / "model" / "coldstart-dcp", {"step": 0, "kind": "cold-start"})
    info = {
        "model": "tiny-qwen3-moe",
        "shape": {"layers": shape.n_layers, "experts": shape.num_experts, "top_k": shape.top_k,
                  "max_seq_len": shape.max_seq_len},
        "task": cs.task,
        "params": param_count(shape),
        "train_rows": len(train),
        "heldout_rows": len(heldout),
        "cold_start_steps": steps_run,
        "cold_start_final_loss": final_loss,
        "cold_start_dev_acc": dev_acc[-1] if dev_acc else None,
        "cold_start_target_acc": cs.target_acc,
        "cold_start_s": round(sft_s, 1),
        "response_tokens": _length_stats([len(ex[1]) for ex in examples]),  # of the SFT targets, EOS included
        "build_s": round(time.time() - t0, 1),
    }
    (out / "minirl_coldstart.json").write_text(json.dumps(info, indent=2))
    tell("save", 1, 1)
    return info


def _check_prompts_fit(task: str, rows: list[dict], max_prompt_tokens: int) -> None:
    """The character tokenizer makes a prompt one token a character: one that is longer than
    data.max_prompt_tokens would be skipped by every run, so init says so before the cold start."""
    longest = max(len(r["prompt"]) for r in rows)
    if longest > max_prompt_tokens:
        over = sum(len(r["prompt"]) > max_prompt_tokens for r in rows)
        raise UsageError(f"--task {task}: {over} of {len(rows)} questions are longer than data.max_prompt_tokens = "
                         f"{max_prompt_tokens} (the longest {longest} characters, a token each): "
                         f"--set data.max_prompt_tokens={longest}, or cold_start.task_params for shorter ones")


def _length_stats(lengths: list[int]) -> dict:
    ordered = sorted(lengths)
    q = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return {"min": ordered[0], "p10": q(0.1), "median": q(0.5), "p90": q(0.9), "max": ordered[-1],
            "mean": round(sum(ordered) / len(ordered), 2)}
