"""What `minirl run` reads before any engine starts (`RunInputs`), each input checked in turn (setup/preflight.py)
as it is read: the recipe a run or a resumed run starts with, the machine, the model folder, the checkpoint to
resume, the tokenizer, the environment, both data splits and the grader. A failure is one `UsageError` line, and
nothing is written in the workspace."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minirl.config import recipes
from minirl.data import loader
from minirl.data.loader import Loading, Rows
from minirl.data.prompts import load_problems, prompts_ids
from minirl.disk import store
from minirl.envs.contract import environment_class, episode_seed, scores_itself
from minirl.envs.formats import check_format
from minirl.envs.hosting import check_start
from minirl.envs.templates import format_for
from minirl.errors import UsageError
from minirl.models.hub import model_dir as resolve_model_dir
from minirl.models.shapes import ModelShape, read_shape
from minirl.setup import limits
from minirl.setup.limits import Platform
from minirl.setup.preflight import (check_fits, check_gpu_plan, check_layout, check_model_folder, check_replay,
                                    check_resume, check_sinks_ready, engine_kv_gib, gradable_problems,
                                    pick_resume_checkpoint)
from rewards.pool import GradingPool


@dataclass
class RunInputs:
    """What `minirl run` reads before any engine starts, all of it checked."""

    model_dir: Path  # the HF folder the run starts from
    shape: ModelShape  # from its config.json
    tokenizer: Any
    train: list  # [Problem]
    skipped: dict[str, int]  # train rows left out, by reason
    heldout: list  # [Problem], at most eval.max_problems
    grading: Any  # rewards.pool.GradingPool
    resume_from: Path | None  # the checkpoint to continue from (--resume)
    engine_fraction: float | None = None  # on a GPU: the engine's share of it, from the run's plan (check_gpu_plan)
    # tokens a forward/backward takes at once: the recipe's train.micro_batch_tokens, or where it is
    # 0, on a GPU the plan's (the largest with which every phase fits), on a CPU 0 (a whole mini-batch)
    micro_batch_tokens: int = 0
    # on a GPU: the engine's KV cache per GPU, the plan's, given to vLLM so it need not profile to size it
    kv_cache_gib: float | None = None
    # while the trainer trains: the recipe's rollout.sleep_level, or where it is -1 the plan's on a GPU (0 on a CPU)
    sleep_level: int = 0
    # the environment's tools, as its prompts render them (a chat template's `tools=`); () without an
    # environment that lists any, or without the chat template
    tools: tuple = ()


def _problems(rec, ws, tok, rows: list[Rows], *, tools: list | None = None) -> tuple[list, dict, list]:
    """The run's training problems (and what was skipped, by reason) and held-out problems, their prompts
    rendered as the recipe says (with the environment's `tools`, where given)."""
    enc = functools.partial(prompts_ids, tok, template=rec.data.prompt_template, chat=rec.data.chat_template,
                            chat_kwargs=rec.data.chat_template_kwargs, tools=tools)
    answers = not scores_itself(rec.env)  # rows of a prompt alone, where the environment gives every R
    kw = dict(encode=enc, prompt_field=rec.data.prompt_field, answer_field=rec.data.answer_field,
              max_prompt_tokens=rec.data.max_prompt_tokens, base=ws.root, answers=answers)
    train, skipped = load_problems(rec.data.train, **kw, rows=rows[0])
    heldout, _ = load_problems(rec.data.heldout, **kw, split=rec.data.heldout_split, rows=rows[1])
    skipped["ungradable"] = 0
    if answers:
        train, skipped["ungradable"] = gradable_problems(train, rec.data.train, rec.reward.grader, rec.reward.params)
        heldout, _ = gradable_problems(heldout, rec.data.heldout, rec.reward.grader, rec.reward.params)
    return train, skipped, heldout


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - any loader failure: one line
        raise UsageError(f"cannot load the tokenizer in {folder}: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]}") from None
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise UsageError(f"the tokenizer in {folder} has no EOS or pad token")
    return tok


def prepare_run(ws, rec, *, resume: str | None, world_size: int = 1) -> RunInputs:
    """Model folder, tokenizer, both data splits, the grader and (with `resume`) the checkpoint,
    each checked; raises one UsageError line and writes nothing in the workspace."""
    typed = (rec.data.prompt_field, rec.data.answer_field)
    # both sources are read by one process of their own (loader.py) while this one checks the model and the rest
    loading = loader.start([dict(spec=rec.data.train, base=ws.root, typed=typed),
                            dict(spec=rec.data.heldout, base=ws.root, split=rec.data.heldout_split, typed=typed)])
    try:
        return _checked_inputs(ws, rec, resume, world_size, loading)
    finally:
        for load in loading:
            load.cancel()


def _checked_inputs(ws, rec, resume: str | None, world_size: int, loading: list[Loading]) -> RunInputs:
    if ws.runs.exists() and not ws.runs.is_dir():  # where every run's folder goes
        raise UsageError(f"{ws.runs} is a file, where the workspace keeps its runs' folders: move it away")
    if ws.runs.is_symlink() and not ws.runs.exists():  # links are followed: to a folder that is there (#82)
        raise UsageError(f"{ws.runs} is a link to {os.readlink(ws.runs)}, which does not exist: create that folder, "
                         "or remove the link")
    platform = Platform.here(world_size)
    limits.check(rec, platform)  # what this machine cannot do, before anything is read
    check_sinks_ready(rec.metrics)  # a sink that would fail after the engines started

    model_dir = resolve_model_dir(rec.model.id, rec.model.path, ws.root,
                                  before_weights=lambda d: check_fits(rec, read_shape(d), platform))
    shape = check_model_folder(model_dir)
    limits.check(rec, platform, shape)  # lengths and counts against the model's context and the engine's cache
    check_replay(rec.train.replay, shape, rec.model.id)  # in check_planned's order: the dry run's lines
    check_layout(rec, shape, world_size)
    check_fits(rec, shape, platform, model_dir)
    plan = check_gpu_plan(rec, shape, platform)
    resume_from = None
    if resume in ("latest", "auto"):
        resume_from = pick_resume_checkpoint(ws, shape, rec.model.id, auto=resume == "auto")
    elif resume:
        resume_from = pick_resume_checkpoint(ws, shape, rec.model.id, run=store.run_folder(ws, resume))
    if resume_from is not None:
        check_resume(resume_from, rec, shape, model_dir)
    tok = load_tokenizer(model_dir)
    if rec.data.chat_template and not getattr(tok, "chat_template", None):
        raise UsageError(f"data.chat_template = true, and the tokenizer of {rec.model.id} has no chat template; "
                         "set data.chat_template = false to send the prompt as plain text")
    if rec.env.name:  # an environment that cannot run: before anything is built
        environment_class(rec.env.name)
        check_format(rec.env.tool_format, lambda text: tok.encode(text, add_special_tokens=False),
                     lambda text: tok.encode(text, add_special_tokens=False, split_special_tokens=True),
                     rec.env.max_reply_tokens)
    rows = [load.result() for load in loading]
    train, skipped, heldout = _problems(rec, ws, tok, rows)
    tools: list = []
    if rec.env.name and train:  # an environment that cannot start an episode: before any engine starts
        tools = check_start(rec.env, dict(train[0].record), seed=episode_seed(rec.train.seed, 0, 0))
        if tools and rec.data.chat_template:  # the model is told its tools: every prompt renders them
            told = len(prompts_ids(tok, [""], chat=True, chat_kwargs=rec.data.chat_template_kwargs, tools=tools)[0])
            if told >= rec.data.max_prompt_tokens:
                raise UsageError(f"the tools of env.name = {rec.env.name!r} take {told} tokens of a prompt as the chat "
                                 f"template renders them, and data.max_prompt_tokens = {rec.data.max_prompt_tokens}: "
                                 "raise it (the run's context is planned with it)")
            train, skipped, heldout = _problems(rec, ws, tok, rows, tools=tools)
    if rec.env.name:  # replies as the model's chat template renders them: a template minirl cannot follow refused
        check_format(rec.env.tool_format, lambda text: tok.encode(text, add_special_tokens=False),
                     lambda text: tok.encode(text, add_special_tokens=False, split_special_tokens=True),
                     rec.env.max_reply_tokens, format_for(rec.env.tool_format, tok, chat=rec.data.chat_template,
                                                          chat_kwargs=rec.data.chat_template_kwargs,
                                                          tools=tools if rec.data.chat_template else (),
                                                          max_calls=rec.env.max_calls,
                                                          user_turns=rec.env.replies_to == "turns"))
    if len(train) < rec.train.prompts_per_step:
        raise UsageError(f"data.train has {len(train)} usable prompts, fewer than train.prompts_per_step "
                         f"({rec.train.prompts_per_step})")
    grading = GradingPool(rec.reward.grader, rec.reward.params, workers=rec.reward.workers,
                          timeout_s=rec.reward.timeout_s)
    return RunInputs(model_dir, shape, tok, train, skipped, heldout[: rec.eval.max_problems], grading, resume_from,
                     tools=tuple(tools) if rec.data.chat_template else (),
                     engine_fraction=plan.engine_fraction if plan else None,
                     micro_batch_tokens=plan.micro_batch_tokens if plan else rec.train.micro_batch_tokens,
                     kv_cache_gib=engine_kv_gib(plan),
                     sleep_level=plan.sleep_level if plan else max(0, rec.rollout.sleep_level))


def run_recipe(ws, resume: str | None, overrides: list[str]):
    """The recipe a run starts with: the workspace's, with the flags, for a new run; for `--resume`,
    the resumed run's own (runs/<id>/recipe.toml) with the flags on top, never the workspace's
    values (what the flags change is said and recorded as the run starts: lifecycle.py). A run
    that finished is not resumed unless the flags ask for more steps than it trained."""
    run = store.resume_run(ws, resume)
    if run is None or not (run / "recipe.toml").is_file():
        return recipes.load(ws.recipe_path, overrides)
    rec = recipes.load(run / "recipe.toml", overrides)
    summary = store.read_summary(run)
    if summary.get("status") == "finished" and rec.train.steps <= summary.get("steps", 0):
        raise UsageError(f"run {run.name} has finished ({summary.get('steps')} of {rec.train.steps} steps): nothing "
                         f"to resume; --steps N (above {summary.get('steps')}) trains it further, and `minirl run "
                         f"{ws.root}` starts a new run")
    return rec
