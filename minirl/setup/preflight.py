"""Checks that run before any engine starts and before anything is written: the model folder, the
data and the checkpoint that `minirl run` or `minirl eval` is about to use (a run's inputs are read and
checked in order by setup/run_inputs.py).

Each failure is one `UsageError` line that names the file and what would be valid. The checks read
headers and metadata, never whole weight files, so they cost the same on a 30B checkpoint as on
the tiny one: a safetensors header lists every tensor's name, shape and byte range; a DCP
checkpoint's `.metadata` lists every tensor's shape and the file and byte range that hold it.
"""

from __future__ import annotations

import configparser
import functools
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from minirl.config import recipes
from minirl.disk import store
from minirl.errors import UsageError
from minirl.models.hub import check_base
from minirl.models.shapes import ModelShape, lora_targets, param_count, read_shape
from minirl.models.titan import titan_config
from minirl.setup import limits
from minirl.setup.limits import Platform
from rewards.base import describe, gradable, load_grader


OFFLINE_MODES = ("offline", "dryrun", "disabled")


def check_sinks_ready(cfg) -> None:
    """What the enabled sinks need, before any engine starts: W&B online needs a login (an API key
    in WANDB_API_KEY, an identity token file, `wandb login`'s ~/.netrc entry or its settings file);
    without one, wandb.init would fail after the engines started and the held-out evaluation ran."""
    if not cfg.wandb or os.environ.get("WANDB_MODE", "").strip().lower() in OFFLINE_MODES:
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC") or None).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    settings = configparser.ConfigParser()
    settings.read(Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings")
    if settings.get("default", "api_key", fallback=""):
        return
    raise UsageError(f"metrics.wandb = true, and there is no W&B login here (no WANDB_API_KEY, no {host} entry from "
                     "`wandb login`): log in first, or set WANDB_MODE=offline to write the run into its folder and "
                     "`wandb sync` it later")


@functools.cache
def _meta_state_dict(shape: ModelShape) -> dict:
    """The TorchTitan model's state dict on the meta device: every name and shape, no memory."""
    import torch

    with torch.device("meta"):
        return dict(titan_config(shape).build().state_dict())


def expected_titan_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _meta_state_dict(shape).items()}


def expected_hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, through the same state-dict adapter the real load uses."""
    from minirl.train.hf_io import titan_to_hf  # deferred: torch (the CLI imports this module at start)

    sd = {k: v for k, v in _meta_state_dict(shape).items() if "expert_bias" not in k and "tokens_per_expert" not in k}
    return {k: tuple(v.shape) for k, v in titan_to_hf(shape, sd).items()}


def check_model_folder(folder: Path) -> ModelShape:
    """An HF folder the trainer and vLLM can load: config.json of a supported architecture, a
    tokenizer, and safetensors whose tensors are exactly that config's names and shapes. Opening a
    file checks its header and that the file holds every byte the header promises. Returns the shape."""
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"model folder {folder} not found (recipe model.path, or --model)")
    shape = read_shape(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise UsageError(f"model folder {folder} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"model folder {folder} has no *.safetensors weights")
    seen: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    seen[name] = tuple(sf.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - a damaged header of any kind: one line
            raise UsageError(f"model weights {f} are damaged or truncated ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    want = expected_hf_shapes(shape)
    if shape.tie_embeddings:  # a tied head may be left out of the files
        seen.setdefault("lm_head.weight", want.get("lm_head.weight"))
    missing = sorted(set(want) - set(seen))
    if missing:
        raise UsageError(f"model weights in {folder} lack {len(missing)} tensors of {len(want)}, e.g. {missing[0]}")
    for name, s in want.items():
        if seen[name] != s:
            raise UsageError(f"model weights in {folder}: {name} has shape {list(seen[name])}, its config.json "
                             f"needs {list(s)}")
    return shape


def on_this_job(rec, platform: Platform):
    """The recipe with the [parallel] layout of the job that runs it: this node's ranks
    (LOCAL_WORLD_SIZE, set by torchrun) with its rollout GPUs, and the nodes the world size makes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", platform.world_size))
    return recipes.with_sets(rec, {"parallel.nodes": max(1, platform.world_size // local),
                                      "parallel.gpus_per_node": local + rec.parallel.rollout_gpus})


def check_fits(rec, shape: ModelShape, platform: Platform, folder: Path | None = None) -> None:
    """This node's host memory against what the job holds in it at its peak (the plan's
    `host_memory`, the figure the dry run prints): on a CPU the trainer and the engines, on GPUs
    offloaded moments and sleeping engines; at the start, the checkpoint read (rank 0 alone when
    the trainer is sharded; `folder`'s safetensors, once known). Refused in one line before any
    weight is downloaded or engine started."""
    from minirl.setup.footprint import host_memory  # deferred: only a run that starts needs it

    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    files = sorted(Path(folder).glob("*.safetensors")) if folder is not None else []
    here = on_this_job(rec, platform)
    need = host_memory(here, shape, device=platform.device,
                       checkpoint_bytes=sum(f.stat().st_size for f in files) if files else None)
    if need["peak"] > 0.8 * have:
        parts = ", ".join(f"{k} {v / 2**30:,.1f}" for k, v in need.items() if k != "peak")
        raise UsageError(f"model {rec.model.id} ({param_count(shape) / 1e9:.2f}B parameters): this job needs "
                         f"~{need['peak'] / 2**30:,.0f} GiB of this node's host memory at its peak ({parts} GiB; "
                         f"{here.parallel.gpus_per_node} rank(s) on {platform.device}), more than 80% of its {have / 2**30:.0f} GiB; "
                         "`minirl run --dry-run` plans it for GPUs and other layouts")


def check_gpu_plan(rec, shape: ModelShape, platform: Platform):
    """On a GPU, the run's plan (what `--dry-run` prints) for the device it is on and the job's
    layout (this node's ranks, and nodes from the world size): refused in the dry run's line when
    any phase would not fit, the engine's start included. Returns the plan: the run gives vLLM its
    share of each GPU (`engine_fraction`, vLLM's gpu_memory_utilization) and trains with its
    micro-batch where the recipe left it to the plan; None on a CPU, whose engine is sized for the
    job and whose trainer takes a whole mini-batch at once."""
    if platform.device != "cuda":
        return None
    from minirl.setup.advice import advise, describe, refusal  # deferred, with the plan: only a GPU run plans
    from minirl.setup.plan import make_plan

    here = on_this_job(rec, platform)
    plan = make_plan(here, shape, model=rec.model.id, gpu_gib=platform.memory_gib)
    if not plan.fits:
        found = advise(here, shape, model=rec.model.id, gpu_gib=platform.memory_gib)
        raise UsageError(refusal(plan, [describe(*found)] if found else [])
                         + f" (planned for this job: {plan.nodes} × {plan.gpus_per_node} GPU(s) of "
                           f"{platform.memory_gib:.1f} GiB)")
    return plan


def engine_kv_gib(plan) -> float | None:
    """The KV cache per GPU an engine beside the trainer is built with: the plan's (None on a CPU,
    and for engines on rollout GPUs of their own, which size theirs within their GPU)."""
    if plan is None or plan.rollout_gpus:
        return None
    return round(plan.memory_gib["vLLM KV cache"], 3)


def check_planned(rec, shape: ModelShape) -> None:
    """What `run` refuses before any engine starts that the recipe, the model's shape and the job's
    layout decide alone (no machine, no weights): the model's rules (lengths, LoRA targets and
    rank, tensor parallel against its heads), replay on a dense model, the mesh against the
    [parallel] section's ranks. `--dry-run` and `init --model` call it; `prepare_run` makes the same
    checks in the same order, so both refuse with the same line."""
    limits.check(rec, None, shape)
    check_replay(rec.train.replay, shape, rec.model.id)
    check_layout(rec, shape, rec.parallel.training_gpus)


def check_replay(replay: str, shape: ModelShape, model_id: str) -> None:
    if replay != "off" and not shape.is_moe:
        raise UsageError(f"train.replay = {replay!r} replays MoE routes, and {model_id} is a dense model; use off")


def check_checkpoint(path: Path, shape: ModelShape, model_id: str) -> dict:
    """A DCP step checkpoint written by `Trainer.save`: readable minirl.json with a step, DCP
    metadata whose model tensors have this model's shapes, every shard file present and as long as
    the metadata says. Returns minirl.json's contents. A damaged one is refused in one line that
    also names the newest checkpoint of its run that passes these checks, if there is one."""
    try:
        return _check_checkpoint(path, shape, model_id)
    except UsageError as e:
        raise UsageError(f"{e}; {instead(path, shape, model_id)}") from None


def instead(path: Path, shape: ModelShape, model_id: str) -> str:
    """What to use rather than the damaged run checkpoint `path`: the newest other complete
    checkpoint of its run that passes `check_checkpoint`, named, or that there is none."""
    for other in reversed(store.complete_checkpoints(Path(path).parent.parent)):
        if other.resolve() == Path(path).resolve():
            continue
        try:
            _check_checkpoint(other, shape, model_id)
            return f"its run's newest intact checkpoint is {other.name} ({other})"
        except UsageError:
            continue
    return "its run has no other intact checkpoint"


def _check_checkpoint(path: Path, shape: ModelShape, model_id: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    extra = store.read_record(path)
    if not isinstance(extra.get("step"), int):
        raise UsageError(f"checkpoint {path}: {store.RECORD} has no integer 'step'")
    ckpt_model = (extra.get("recipe") or {}).get("model", {}).get("id")
    if ckpt_model is not None and ckpt_model != model_id:
        raise UsageError(f"checkpoint {path} is of model {ckpt_model!r}; the recipe's model.id is {model_id!r}")
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"checkpoint {path}: DCP metadata missing or unreadable ({type(e).__name__})") from None
    have = {k.removeprefix("model."): tuple(v.size) for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and hasattr(v, "size")}
    want = expected_titan_shapes(shape)
    if extra.get("lora"):  # LoRA adapters alone: their base is the model folder (`check_resume`)
        want = {}
        if not any(".lora_" in f".{k}" for k in have):
            raise UsageError(f"checkpoint {path}: {store.RECORD} says LoRA and it holds no adapters")
    for name, s in want.items():
        if have.get(name) != s:
            got = list(have[name]) if name in have else "nothing"
            raise UsageError(f"checkpoint {path} does not hold this model: {name} is {got}, the model needs {list(s)}")
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        f = path / rel
        size = f.stat().st_size if f.is_file() else -1
        if size < end:
            state = "missing" if size < 0 else f"{size} bytes, {end} needed"
            raise UsageError(f"checkpoint {path}: shard {rel} is {state}")
    return extra


def check_resume(path: Path, rec, shape: ModelShape, model_dir: Path) -> None:
    """A checkpoint continues only the training it was saved from: LoRA's settings (rank, α,
    targets) as this run's [train.lora], and a LoRA checkpoint's adapters on the base they were
    trained on (its fingerprint). One line before any engine starts."""
    extra = store.read_record(path)
    theirs, lora = extra.get("lora"), rec.train.lora
    mine = ({"rank": lora.rank, "alpha": float(lora.alpha), "targets": list(lora_targets(lora.targets, shape))}
            if lora.rank else None)
    if theirs != mine:
        if mine is None:
            raise UsageError(f"checkpoint {path} is of a LoRA run ({_lora_words(theirs)}) and this run trains every "
                             "weight (train.lora.rank = 0): resume it with the [train.lora] it was saved with")
        if theirs is None:
            raise UsageError(f"checkpoint {path} trained every weight and this run asks for LoRA ({_lora_words(mine)}): "
                             "resume it with train.lora.rank = 0, or start LoRA from its export (minirl export)")
        raise UsageError(f"checkpoint {path} holds LoRA adapters of {_lora_words(theirs)} and this run's [train.lora] "
                         f"asks for {_lora_words(mine)}: resume it with the settings it was saved with")
    if theirs and extra.get("base"):
        check_base(path, extra["base"], model_dir)


def _lora_words(lora: dict) -> str:
    return f"rank {lora['rank']}, α {lora['alpha']:g}, on {','.join(lora['targets'])}"


def gradable_problems(problems: list, spec: str, grader_name: str, params: dict) -> tuple[list, int]:
    """A run's problems that its grader can grade (a grader states the fields a record must hold:
    rewards/base.py) and how many were left out. Data whose records lack those fields is refused in
    one line rather than trained on rewards that are 0 whatever the model writes."""
    fields = _fields_present(grader_name, params, [p.record for p in problems], spec)
    usable = [p for p in problems if gradable(p.record, fields)]
    if not usable:
        raise UsageError(f"grader {grader_name!r} needs {describe(fields)} in each record; every one of the "
                         f"{len(problems)} rows of dataset {spec!r} lacks them (missing or empty)")
    return usable, len(problems) - len(usable)


def check_gradable(records: list[dict], spec: str, grader_name: str, params: dict) -> None:
    """An evaluation's records, every one gradable: a benchmark is scored whole or not at all."""
    fields = _fields_present(grader_name, params, records, spec)
    bad = next((i for i, r in enumerate(records) if not gradable(r, fields)), None)
    if bad is not None:
        raise UsageError(f"grader {grader_name!r} needs {describe(fields)} in each record; row {bad + 1} of {spec} lacks "
                         "them (missing or empty)")


def _fields_present(grader_name: str, params: dict, records: list[dict], spec: str) -> tuple[tuple[str, ...], ...]:
    """The grader's `fields`, once the data is known to have a column for one of their groups."""
    fields = tuple(getattr(load_grader(grader_name, params), "fields", ()))
    columns = sorted(records[0]) if records else []
    if fields and records and not any(set(group) <= set(columns) for group in fields):
        raise UsageError(f"grader {grader_name!r} needs {describe(fields)} in each record; dataset {spec!r} has no such "
                         f"field (fields: {', '.join(columns)})")
    return fields


def check_layout(rec, shape: ModelShape, world_size: int) -> None:
    """The recipe's [parallel] section and batch against the ranks this job has."""
    p, t = rec.parallel, rec.train
    if p.dp_shard not in (-1, world_size):
        raise UsageError(f"parallel.dp_shard = {p.dp_shard}: FSDP2 shards over all {world_size} rank(s) of this job "
                         f"(-1); other degrees are not supported yet")
    if p.ep > 1 and not shape.is_moe:
        raise UsageError(f"parallel.ep = {p.ep}: expert parallel needs a MoE model; this one is dense")
    if p.ep > 1 and (world_size % p.ep or shape.num_experts % p.ep):
        raise UsageError(f"parallel.ep = {p.ep} must divide the job's {world_size} rank(s) and the model's "
                         f"{shape.num_experts} experts (launch with torchrun --nproc-per-node N, or --set "
                         f"parallel.ep=1; a checkpoint resumes on any number of ranks)")
    tp = rec.rollout.tensor_parallel
    if not p.rollout_gpus and (world_size % tp or (world_size == 1 and tp > 1)):  # rollout GPUs: the validator's
        where = ("one process runs a single-GPU engine; launch with torchrun --nproc-per-node "
                 f"{tp} (or more)" if world_size == 1 else f"it must divide the job's {world_size} ranks")
        raise UsageError(f"rollout.tensor_parallel = {tp}: each vLLM engine spans {tp} ranks of the job; {where}")
    if t.prompts_per_step % (world_size * t.minibatches):
        raise UsageError(f"train.prompts_per_step = {t.prompts_per_step} must split evenly into "
                         f"{t.minibatches} mini-batch(es) on each of {world_size} rank(s)")
    if t.dynamic_sampling and world_size > 1:
        # each rank keeps its share of a batch: which groups survive differs by rank, and the extra
        # draws would have to be agreed and the survivors dealt out again (not built yet)
        raise UsageError(f"train.dynamic_sampling on {world_size} training ranks: not supported yet; it runs in one "
                         "training process (rollout GPUs and k ≥ 1 included): drop it or launch one rank")


def pick_resume_checkpoint(ws, shape: ModelShape, model_id: str, *, auto: bool = False,
                           run: Path | None = None) -> Path | None:
    """The checkpoint a `--resume` continues (the store's choice, minirl/disk/store.py), its shards
    checked against this model."""
    return store.resume_checkpoint(ws, check=lambda c: check_checkpoint(c, shape, model_id), auto=auto, run=run)
