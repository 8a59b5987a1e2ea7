"""What the machine and the model allow a recipe (`check`): the rules that need them, run by
preflight where a run, a dry run or `init` knows the machine it is on and the model it runs.
Refused with the key to change, never quietly changed.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minirl.config.precisions import PRECISIONS
from minirl.errors import UsageError
from minirl.models.shapes import ModelShape, lora_targets, lora_widths
from minirl.models import sizing
from minirl.models.sizing import cpu_kv_cache_bytes

if TYPE_CHECKING:
    from minirl.config.recipe import Recipe, RolloutConfig


# Python 3.11's multiprocessing makes its sockets at <TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX, and a
# Unix socket's path holds at most 107 bytes: longer, the run would stop at its first sync with a traceback
SOCKET_FOLDER_MAX = 107 - len("/pymp-XXXXXXXX/listener-XXXXXXXX")


@dataclass(frozen=True, slots=True)
class Platform:
    """Where a recipe is about to run: what the rules that depend on the machine check."""

    device: str  # "cpu" or "cuda"
    world_size: int = 1  # ranks of the job
    cores: int = 2  # CPU cores this process may use
    memory_gib: float = math.inf  # what one engine can allocate at most: the machine's RAM, or one GPU's memory
    local_ranks: int = 1  # the job's ranks on this node (torchrun's LOCAL_WORLD_SIZE)
    gpus: int = 0  # the GPUs this node shows the job
    tmpdir: str = "/tmp"  # the temporary folder (TMPDIR), where Python's multiprocessing makes its sockets

    @classmethod
    def here(cls, world_size: int = 1) -> "Platform":
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if torch.cuda.is_available():
            return cls("cuda", world_size, len(os.sched_getaffinity(0)),
                       torch.cuda.get_device_properties(0).total_memory / 2**30, local, torch.cuda.device_count(),
                       tmpdir=tempfile.gettempdir())
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return cls("cpu", world_size, len(os.sched_getaffinity(0)), ram, local, tmpdir=tempfile.gettempdir())


def check(r: Recipe, platform: Platform | None = None, model: ModelShape | None = None) -> None:
    """With `platform` the rules of the machine the recipe runs on; with `model` what the engines can
    hold of it and what LoRA can adapt in it."""
    if platform is not None:
        _check_platform(r.rollout, platform, r.parallel.rollout_gpus)
        if r.env.name and platform.world_size > 1 and r.rollout.tensor_parallel > 1:
            # each rank of a tensor-parallel group asks its engine for the same requests: each would step
            # an environment of its own for the same episode, whose replies need not agree
            raise UsageError(f"env.name = {r.env.name!r} with rollout.tensor_parallel = {r.rollout.tensor_parallel}: "
                             "the ranks of a tensor-parallel engine would each step environments of their own for "
                             "the same episodes (#84); set rollout.tensor_parallel = 1 (each rank its own engine)")
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
    if r.env.name and sizing.max_model_len(r) > ctx:  # an episode: its replies too
        raise UsageError(f"env.max_turns = {r.env.max_turns} with env.max_reply_tokens = {r.env.max_reply_tokens}: an "
                         f"episode may take {sizing.max_model_len(r)} positions (data.max_prompt_tokens + rollout.max_tokens "
                         f"+ 1 + (env.max_turns - 1) × env.max_reply_tokens), and the model's context is {ctx} tokens")
    tp = r.rollout.tensor_parallel
    if model.n_heads % tp:  # vLLM splits the attention heads over the engine's GPUs (and refuses at its start)
        raise UsageError(f"rollout.tensor_parallel = {tp} must divide the model's {model.n_heads} attention heads "
                         "(vLLM splits them over the engine's GPUs)")
    if platform is None or platform.device != "cpu":
        return  # a GPU engine's KV cache is the plan's; it schedules what does not fit in waves
    sequences = r.train.prompts_per_step * r.train.group_size
    dtype_bytes = 4 if r.rollout.precision == "fp32" else 2
    length = sizing.max_model_len(r)  # prompt + new + 1, and a multi-turn episode's replies
    need = cpu_kv_cache_bytes(model, sequences, length, dtype_bytes)
    have = r.rollout.kv_cache_gib * 2**30 if r.rollout.kv_cache_gib > 0 else platform.memory_gib * 2**30
    if need > have:
        given = (f"rollout.kv_cache_gib = {r.rollout.kv_cache_gib}" if r.rollout.kv_cache_gib > 0
                 else f"this machine has {platform.memory_gib:.1f} GiB of RAM")
        per_sequence = (cpu_kv_cache_bytes(model, 1, length, dtype_bytes)
                        - cpu_kv_cache_bytes(model, 0, length, dtype_bytes))
        raise UsageError(f"train.prompts_per_step × train.group_size = {sequences:,} sequences of up to "
                         f"{length} tokens are sampled at once on a CPU and need {need / 2**30:,.2f} GiB of KV "
                         f"cache; {given}, room for {int(have // per_sequence):,} of them")


def check_engine(ro: RolloutConfig, p: Platform) -> None:
    """What the machine cannot give one engine ([rollout]'s precision and KV cache), for a run and
    for an engine outside one (`minirl eval`): refused before any engine work."""
    if p.device != "cpu" and PRECISIONS[ro.precision].cpu_only:
        raise UsageError(f"rollout.precision = {ro.precision!r} is a CPU emulation level of the lab; on GPUs vLLM "
                         "serves FP8 as W8A8: set rollout.precision = \"fp8\"")
    if ro.kv_cache_gib > p.memory_gib:
        raise UsageError(f"rollout.kv_cache_gib = {ro.kv_cache_gib} is more than this machine can give one engine "
                         f"({p.memory_gib:.1f} GiB of {'RAM' if p.device == 'cpu' else 'GPU memory'})")


def _check_platform(ro: RolloutConfig, p: Platform, rollout_gpus: int) -> None:
    """What the machine cannot do: refused, never quietly changed."""
    check_engine(ro, p)
    k = ro.max_staleness
    if rollout_gpus:
        _check_rollout_gpus(rollout_gpus, p, ro.tensor_parallel)
    elif k and p.world_size > 1:
        raise UsageError(f"rollout.max_staleness = {k} runs one trainer process and one engine process; under "
                         "torchrun every rank would need an engine process of its own, not built yet: set "
                         "rollout.max_staleness = 0 under torchrun")
    if p.device != "cpu" and (ro.top_p < 1 or ro.top_k or ro.min_p):
        # CUDA's processed log-probs follow the cut, but what it kept is recorded by the CPU capture only
        raise UsageError("rollout.top_p / top_k / min_p: the trainer renormalizes π over what the sampler kept, which "
                         "the CPU engine records and vLLM's CUDA path does not return yet (#97); sample uncut on a GPU "
                         "(eval.top_p, eval.top_k and eval.min_p evaluate with them anywhere)")
    if k and p.device != "cpu" and ro.sleep_level > 0:
        raise UsageError(f"rollout.max_staleness = {k}: the engine samples on the trainer's GPU while it trains, so it "
                         f"cannot sleep (rollout.sleep_level = {ro.sleep_level}): set rollout.sleep_level = 0")
    if k and p.cores < 2:
        raise UsageError(f"rollout.max_staleness = {k} needs at least 2 cores for a trainer and an engine; this "
                         f"process has {p.cores}: set rollout.max_staleness = 0")
    if (k or rollout_gpus) and len(p.tmpdir) > SOCKET_FOLDER_MAX:
        uses = f"rollout.max_staleness = {k}" if k else f"parallel.rollout_gpus = {rollout_gpus}"
        raise UsageError(f"{uses} hands tensors to engine processes over sockets that Python makes in the temporary "
                         f"folder, {p.tmpdir} ({len(p.tmpdir)} characters), and a socket's path must fit in 107 "
                         f"bytes: set TMPDIR to a folder of at most {SOCKET_FOLDER_MAX} characters (e.g. /tmp)")
    if rollout_gpus and p.cores < 2:
        raise UsageError(f"parallel.rollout_gpus = {rollout_gpus} needs at least 2 cores for rank 0 and the engines "
                         f"it starts; this process has {p.cores}: set parallel.rollout_gpus = 0")
    if p.device == "cpu" and ro.sleep_level > 0:
        raise UsageError(f"rollout.sleep_level = {ro.sleep_level}: vLLM's CPU backend has no sleep mode; set "
                         "rollout.sleep_level = 0 on a machine without a GPU")


def _check_rollout_gpus(rollout_gpus: int, p: Platform, tp: int) -> None:
    """Rollout GPUs of their own (rollout/remote.py): each node's, after its training ranks' GPUs,
    one GPU an engine (the dry run plans more; a run does not start them yet)."""
    if tp > 1:  # vLLM's TP workers are processes of the engine's: each would have to join the broadcast
        raise UsageError(f"rollout.tensor_parallel = {tp} on rollout GPUs: an engine there is one process on one GPU "
                         "(its tensor-parallel workers would each need the weights' broadcast, not built yet): set "
                         "rollout.tensor_parallel = 1")
    if p.device == "cuda" and p.local_ranks + rollout_gpus > p.gpus:
        raise UsageError(f"parallel.rollout_gpus = {rollout_gpus}: this node shows {p.gpus} GPU(s) and its "
                         f"{p.local_ranks} training rank(s) take {p.local_ranks}; launch at most "
                         f"{max(0, p.gpus - rollout_gpus)} rank(s) (torchrun --nproc-per-node), or fewer rollout GPUs")


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
