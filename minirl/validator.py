"""The validator: every field's range and the rules that span a recipe's fields, the machine it
runs on and the model it runs (`validate`). It fails with the key to change and never rewrites a
field; `recipe.load` runs it on every recipe, preflight again with the machine and the model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minirl.engine_sizing import cpu_kv_cache_bytes, max_samples_per_prompt
from minirl.engines import ENGINES
from minirl.precisions import NAMES, PRECISIONS
from minirl.errors import UsageError
from minirl.hub import repo_id
from minirl.models import ModelShape
from minirl.task import TASKS

if TYPE_CHECKING:
    from minirl.recipe import Recipe, RolloutConfig



# Range of every numeric field: key -> (lowest, highest, lowest allowed itself?). Every number
# must also be finite; nan and inf (which TOML and float() both accept) are refused by name.
_RANGES: dict[str, tuple[float, float, bool]] = {
    "train.lora.rank": (0, math.inf, True),
    "train.lora.alpha": (0, math.inf, False),
    "data.max_prompt_tokens": (1, math.inf, True),
    "rollout.temperature": (0, math.inf, False),
    "rollout.max_tokens": (1, math.inf, True),
    "rollout.memory_fraction": (0, 1, True),
    "rollout.kv_cache_gib": (0, math.inf, True),
    "rollout.tensor_parallel": (1, math.inf, True),
    "rollout.parity_every": (0, math.inf, True),
    "rollout.sleep_level": (0, 2, True),
    "rollout.sync_bucket_mib": (1, math.inf, True),
    "loss.eps_low": (0, 1, False),
    "loss.eps_high": (0, math.inf, False),
    "loss.tis_cap": (0, math.inf, False),
    "train.steps": (0, math.inf, True),
    "train.prompts_per_step": (1, math.inf, True),
    "train.group_size": (1, max_samples_per_prompt(), True),  # vLLM's n per request
    "train.minibatches": (1, math.inf, True),
    "train.micro_batch_tokens": (0, math.inf, True),
    "train.lr": (0, math.inf, False),
    "train.warmup_steps": (0, math.inf, True),
    "train.weight_decay": (0, math.inf, True),
    "train.grad_clip": (0, math.inf, False),
    "train.seed": (0, 2**31 - 1, True),
    "train.time_limit_s": (0, math.inf, True),
    "reward.workers": (0, 256, True),
    "reward.timeout_s": (0, math.inf, False),
    "eval.k": (1, max_samples_per_prompt(), True),
    "eval.every": (0, math.inf, True),
    "eval.temperature": (0, math.inf, True),
    "eval.max_problems": (1, math.inf, True),
    "eval.max_tokens": (0, math.inf, True),
    "eval.grader_workers": (0, 256, True),
    "checkpoint.every": (1, math.inf, True),
    "checkpoint.keep": (0, math.inf, True),
    "guard.min_entropy_frac": (0, 1, True),
    "guard.max_entropy_factor": (1, math.inf, False),
    "guard.reward_drop": (0, math.inf, True),
    "guard.reward_drop_frac": (0, 1, True),
    "guard.patience": (1, math.inf, True),
    "guard.slide_window": (0, math.inf, True),  # 0: no slide rule
    "guard.slide_z": (0, math.inf, False),
    "guard.slide_drop_frac": (0, 1, True),
    "guard.max_rollbacks": (0, math.inf, True),
    "guard.lr_factor": (0, 1, False),
    "cold_start.max_steps": (1, math.inf, True),
    "cold_start.check_every": (1, math.inf, True),
    "cold_start.target_acc": (0, 1, True),
    "cold_start.dev_size": (1, math.inf, True),
    "cold_start.batch_size": (1, math.inf, True),
    "cold_start.lr": (0, math.inf, False),
    "cold_start.seed": (0, 2**31 - 1, True),
    "cold_start.train_size": (2, math.inf, True),
    "cold_start.heldout_size": (1, math.inf, True),
    "cold_start.layers": (1, 64, True),
    "cold_start.experts": (2, 256, True),
    "cold_start.top_k": (1, 256, True),
    "parallel.nodes": (1, math.inf, True),
    "parallel.gpus_per_node": (1, math.inf, True),
    "parallel.dp_shard": (-1, math.inf, True),
    "parallel.ep": (1, math.inf, True),
}


def _check_numbers(r: Recipe) -> None:
    for key, value in r.flat().items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise UsageError(f"{key} = {value}; it must be a finite number")
        if key not in _RANGES:
            continue
        lo, hi, lo_ok = _RANGES[key]
        if value < lo or (value == lo and not lo_ok) or value > hi:
            lower = f"≥ {lo}" if lo_ok else f"> {lo}"
            upper = f" and ≤ {hi}" if math.isfinite(hi) else ""
            raise UsageError(f"{key} = {value}; it must be {lower}{upper}")


@dataclass(frozen=True, slots=True)
class Platform:
    """Where a recipe is about to run: what the rules that depend on the machine check."""

    device: str  # "cpu" or "cuda"
    world_size: int = 1  # ranks of the job
    cores: int = 2  # CPU cores this process may use
    memory_gib: float = math.inf  # what one engine can allocate at most: the machine's RAM, or one GPU's memory

    @classmethod
    def here(cls, world_size: int = 1) -> "Platform":
        import torch

        if torch.cuda.is_available():
            return cls("cuda", world_size, len(os.sched_getaffinity(0)),
                       torch.cuda.get_device_properties(0).total_memory / 2**30)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return cls("cpu", world_size, len(os.sched_getaffinity(0)), ram)


def validate(r: Recipe, platform: Platform | None = None, model: ModelShape | None = None) -> None:
    """Every field's range and the rules that span fields; with `platform` the rules of the machine
    it runs on, with `model` what the engines can hold of it. Fails with the key to change; never
    rewrites. Runs before anything is built, so a bad recipe costs no engine start."""
    choices = {
        "loss.name": (r.loss.name, ("minirl", "grpo", "cispo")),
        "loss.is_mode": (r.loss.is_mode, ("truncate", "mask", "off")),
        "loss.truncated_reward": (r.loss.truncated_reward, ("grade", "zero")),
        "train.replay": (r.train.replay, ("off", "r2", "r3")),
        "train.param_dtype": (r.train.param_dtype, ("auto", "float32", "bfloat16")),
        "train.activation_checkpoint": (r.train.activation_checkpoint, ("none", "full")),
        "train.offload": (r.train.offload, ("none", "optimizer")),
        "rollout.engine": (r.rollout.engine, tuple(ENGINES)),
        "rollout.precision": (r.rollout.precision, NAMES),
        "cold_start.task": (r.cold_start.task, tuple(TASKS)),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise UsageError(f"{key} = {value!r}; choose one of {', '.join(allowed)}")
    try:
        r.data.prompt_template.format(problem="")
        assert "{problem}" in r.data.prompt_template
    except (KeyError, IndexError, ValueError, AssertionError):
        raise UsageError(f"data.prompt_template = {r.data.prompt_template!r} must hold {{problem}} once and no other "
                         "{...} field (write a literal brace as {{ or }})") from None
    if r.loss.is_mode == "off" and not r.loss.allow_uncorrected:
        raise UsageError(f"loss.is_mode = 'off' leaves the gap between the rollout engine (vLLM, "
                         f"{r.rollout.precision}) and the trainer uncorrected; the token IS correction keeps it in "
                         "check (paper F1). Set loss.allow_uncorrected = true to run without it")
    if r.rollout.temperature == 0:
        raise UsageError("rollout.temperature = 0 (greedy) samples the same response G times, so every group-mean "
                         "advantage is 0; use a temperature > 0")
    _check_numbers(r)

    repo_id(r.model.id)  # a short name, a repo id or a folder; anything else fails naming the forms
    for key, value in (("model.id", r.model.id), ("data.train", r.data.train), ("data.heldout", r.data.heldout),
                       ("data.prompt_field", r.data.prompt_field), ("data.answer_field", r.data.answer_field),
                       ("reward.grader", r.reward.grader)):
        if not value.strip():
            raise UsageError(f"{key} is empty")
    if r.train.group_size < 2:
        raise UsageError(
            f"train.group_size = {r.train.group_size}: the advantage is R minus the mean of its group, so with one "
            "response per prompt every advantage is 0 and no update can change the policy; use ≥ 2"
        )
    if r.train.prompts_per_step % r.train.minibatches:
        raise UsageError(
            f"train.prompts_per_step ({r.train.prompts_per_step}) must divide into "
            f"train.minibatches ({r.train.minibatches}) equal mini-batches of whole groups"
        )
    if r.eval.k > 1 and r.eval.temperature == 0:
        raise UsageError(f"eval.temperature = 0 (greedy) gives eval.k = {r.eval.k} identical samples; "
                         "use eval.k = 1 or a temperature > 0")
    if r.cold_start.top_k >= r.cold_start.experts:
        raise UsageError(f"cold_start.top_k ({r.cold_start.top_k}) must be below cold_start.experts "
                         f"({r.cold_start.experts}): a router that picks every expert has no routes to replay")
    if r.cold_start.dev_size >= r.cold_start.train_size:
        raise UsageError(f"cold_start.dev_size ({r.cold_start.dev_size}) must be smaller than cold_start.train_size "
                         f"({r.cold_start.train_size}): the dev split is carved from the train split")
    if r.train.lora.rank:
        _check_lora_targets(r.train.lora.targets)
        _check_lora_settings(r)
    if r.train.replay == "r3" and r.rollout.engine != "vllm":
        raise UsageError("train.replay = 'r3' needs a rollout engine that returns routes (rollout.engine = vllm)")
    if platform is not None:
        _check_platform(r.rollout, platform)
    if model is not None:
        _check_engine_sizes(r, model, platform)
        if r.train.lora.rank:
            _check_lora_model(r.train.lora, model)


def _check_engine_sizes(r: Recipe, model: ModelShape, platform: Platform | None) -> None:
    """Every length and count the rollout engine receives, against the model's context and (on a
    CPU, whose KV cache is sized by rollout.kv_cache_gib) the cache that must hold them."""
    ctx, prompt, new = model.max_seq_len, r.data.max_prompt_tokens, r.rollout.max_tokens
    if prompt + 2 > ctx:
        raise UsageError(f"data.max_prompt_tokens = {prompt}: the model's context is {ctx} tokens (max_position_embeddings "
                         f"in its config.json), so a prompt may take at most {ctx - 2}")
    if prompt + new + 1 > ctx:
        raise UsageError(f"rollout.max_tokens = {new}: with data.max_prompt_tokens = {prompt} a sequence would need "
                         f"{prompt + new + 1} positions, and the model's context is {ctx} tokens (max_position_embeddings "
                         f"in its config.json); at most {ctx - prompt - 1}")
    tp = r.rollout.tensor_parallel
    if model.n_heads % tp:  # vLLM splits the attention heads over the engine's GPUs (and refuses at its start)
        raise UsageError(f"rollout.tensor_parallel = {tp} must divide the model's {model.n_heads} attention heads "
                         "(vLLM splits them over the engine's GPUs)")
    if platform is None or platform.device != "cpu":
        return  # a GPU engine's KV cache is the plan's; it schedules what does not fit in waves
    sequences = r.train.prompts_per_step * r.train.group_size
    dtype_bytes = 4 if r.rollout.precision == "fp32" else 2
    need = cpu_kv_cache_bytes(model, sequences, prompt + new + 1, dtype_bytes)
    have = r.rollout.kv_cache_gib * 2**30 if r.rollout.kv_cache_gib > 0 else platform.memory_gib * 2**30
    if need > have:
        given = (f"rollout.kv_cache_gib = {r.rollout.kv_cache_gib}" if r.rollout.kv_cache_gib > 0
                 else f"this machine has {platform.memory_gib:.1f} GiB of RAM")
        per_sequence = cpu_kv_cache_bytes(model, 1, prompt + new + 1, dtype_bytes) - cpu_kv_cache_bytes(model, 0, 1, dtype_bytes)
        raise UsageError(f"train.prompts_per_step × train.group_size = {sequences:,} sequences of up to "
                         f"{prompt + new + 1} tokens are sampled at once on a CPU and need {need / 2**30:,.2f} GiB of KV "
                         f"cache; {given}, room for {int(have // per_sequence):,} of them")


def _check_platform(ro: RolloutConfig, p: Platform) -> None:
    """What the machine cannot do: refused, never quietly changed."""
    if p.device != "cpu" and PRECISIONS[ro.precision].cpu_only:
        raise UsageError(f"rollout.precision = {ro.precision!r} is a CPU emulation level of the lab; on GPUs vLLM "
                         "serves FP8 as W8A8: set rollout.precision = \"fp8\"")
    if ro.overlap and (p.world_size > 1 or p.device != "cpu"):
        raise UsageError("rollout.overlap = true runs one process on CPU (an engine process beside the trainer); "
                         "set rollout.overlap = false under torchrun or on GPUs")
    if ro.overlap and p.cores < 2:
        raise UsageError(f"rollout.overlap = true needs at least 2 cores for a trainer and an engine; this process "
                         f"has {p.cores}: set rollout.overlap = false")
    if p.device == "cpu" and ro.sleep_level:
        raise UsageError(f"rollout.sleep_level = {ro.sleep_level}: vLLM's CPU backend has no sleep mode; set "
                         "rollout.sleep_level = 0 on a machine without a GPU")
    if ro.kv_cache_gib > p.memory_gib:
        raise UsageError(f"rollout.kv_cache_gib = {ro.kv_cache_gib} is more than this machine can give one engine "
                         f"({p.memory_gib:.1f} GiB of {'RAM' if p.device == 'cpu' else 'GPU memory'})")


LORA_TARGETS = ("q", "k", "v", "o", "mlp", "experts")


def lora_targets(targets: str, model: ModelShape | None = None) -> tuple[str, ...]:
    """train.lora.targets as names, in LORA_TARGETS' order; "all": every target `model` has."""
    names = {t.strip() for t in targets.split(",") if t.strip()}
    if "all" in names:
        names = set(lora_widths(model)) if model is not None else set(LORA_TARGETS)
    return tuple(t for t in LORA_TARGETS if t in names)


def _check_lora_targets(targets: str) -> None:
    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in (*LORA_TARGETS, "all")]
    if unknown or not names:
        raise UsageError(f"train.lora.targets = {targets!r}: name weights among {', '.join(LORA_TARGETS)}, or all "
                         "(comma-separated; the router and the embeddings are never adapted)")


def _check_lora_settings(r: Recipe) -> None:
    """What LoRA does not combine with, on any machine: refused, never quietly changed."""
    if r.rollout.overlap:
        raise UsageError("train.lora with rollout.overlap = true: the overlapped engine copies the trainer's own "
                         "parameters, not the merged W + (α/r)·B·A; set rollout.overlap = false")


def lora_widths(model: ModelShape) -> dict[str, int]:
    """Each target's smallest matrix side in this model (what bounds the rank), for the targets it has."""
    attn = {"q": min(model.dim, model.n_heads * model.head_dim), "k": min(model.dim, model.n_kv_heads * model.head_dim),
            "v": min(model.dim, model.n_kv_heads * model.head_dim), "o": min(model.dim, model.n_heads * model.head_dim)}
    if model.is_moe:
        return {**attn, "experts": min(model.dim, model.moe_hidden_dim)}
    return {**attn, "mlp": min(model.dim, model.hidden_dim)}


def _check_lora_model(lora, model: ModelShape) -> None:
    widths = lora_widths(model)
    asked = lora_targets(lora.targets, model)
    absent = [t for t in asked if t not in widths]
    if absent:
        has = "routed experts and no dense feed-forward" if model.is_moe else "a dense feed-forward and no experts"
        raise UsageError(f"train.lora.targets names {', '.join(absent)}, which this model does not have (it has {has}); "
                         f"targets here: {', '.join(widths)}")
    narrow = min(asked, key=widths.__getitem__)
    if lora.rank > widths[narrow]:
        raise UsageError(f"train.lora.rank = {lora.rank} is above the width of the '{narrow}' weights ({widths[narrow]}): "
                         f"a rank that large adapts nothing a full update would not; at most {widths[narrow]}")
