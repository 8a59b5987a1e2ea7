"""Recipes: typed dataclasses that map one-to-one onto TOML sections and `--set a.b=c` overrides.

Precedence: dataclass defaults < recipe TOML < `--set` flags. An unknown section or key fails and
names it; a value of the wrong type fails and names the key. Every field's range and the rules
that span sections live in minirl/validator.py, which `load` runs; it raises and never rewrites a field.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minirl.errors import UsageError
from minirl.validator import validate


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    id: str = "tiny-qwen3-moe"  # tiny-qwen3-moe | a short name (Qwen3-30B-A3B, ...) | an HF repo id | a local folder
    path: str = "model/coldstart"  # the HF folder to load (relative to the workspace); "" = from id (folder or Hub)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train: str = "data/train.jsonl"  # local JSONL/Parquet (relative to the workspace) or an HF dataset id
    heldout: str = "data/heldout.jsonl"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    max_prompt_tokens: int = 32  # longer prompts are skipped and counted
    prompt_template: str = "{problem}"  # the text sent; "{problem}" stands for the prompt field
    chat_template: bool = False  # send it as one user turn through the tokenizer's chat template
    heldout_split: str = "train"  # the split of a Hub dataset in data.heldout (MATH-500: "test")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: str = "vllm"
    # weights and compute of the rollout engine: fp32 | bf16 | fp8 (W8A8: FP8 weights with per-row
    # scales and per-token FP8 activations, vLLM's fp8_per_channel on CUDA; on CPU emulated: weights
    # rounded at every sync, activations at every linear layer). The lab's CPU-only levels:
    # fp8-weights (weights alone), and beyond the paper e5m2 (W8A8 in e5m2) and nvfp4 (W4A4 in
    # NVFP4, FP4 in blocks of 16). Training is fp32 on CPU, so μ ≠ π even on-policy, and the token
    # IS correction has work to do.
    precision: str = "bf16"
    temperature: float = 1.0
    max_tokens: int = 8  # response length limit
    # the share of each GPU the engine takes at its start (vLLM's gpu_memory_utilization: its weights,
    # working memory and KV cache), checked by the plan against what the trainer leaves free then;
    # 0 = the plan's: what the engine needs for the job, within what the trainer leaves
    # (engine_sizing.py, docs/cluster.md). A CPU engine's KV cache is sized in bytes, so there vLLM
    # only checks it against the NUMA node's memory
    memory_fraction: float = 0.1
    # explicit KV-cache size per GPU; 0 = sized for the job (every sequence of a step at full length,
    # at least 256 on a CPU): on a GPU within memory_fraction or what the trainer leaves
    kv_cache_gib: float = 0.0
    # CUDA graphs for decoding (vLLM's default); false: eager, as the CPU engine always runs
    cuda_graphs: bool = True
    tensor_parallel: int = 1  # GPUs per vLLM engine; under torchrun every tensor_parallel consecutive ranks share one
    # between rollouts (CUDA; CPU has no sleep mode): 0 stay awake, 1 offload weights to host and drop
    # the KV cache, 2 drop both (every sync reloads every weight, so nothing is lost)
    sleep_level: int = 0
    sync_bucket_mib: int = 1024  # weight sync: whole decoder layers gathered and loaded at most this much at a time
    # check vLLM vs trainer log-probs on a fixed batch after the first sync, every k-th and every
    # rollback (0 = never); each check costs about a π_old forward of 16 responses
    parity_every: int = 10
    # sample the next step's batch in the engine's own process while this step trains (one step
    # off-policy: each batch comes from the weights before the last update; rollout/process.py).
    # One process on CPU, 2+ cores: the trainer takes half of them, the engine the rest
    overlap: bool = False


@dataclass(kw_only=True, slots=True)
class LossConfig:
    name: str = "minirl"  # minirl | grpo | cispo
    eps_low: float = 0.2  # ε_low
    eps_high: float = 0.27  # ε_high
    tis_cap: float = 5.0  # truncated-IS cap
    is_mode: str = "truncate"  # truncate | mask | off
    # the rollout engine (vLLM, rollout.precision) always differs from the trainer (TorchTitan):
    # is_mode = "off" leaves that gap uncorrected and must be asked for explicitly
    allow_uncorrected: bool = False
    length_norm: bool = False  # 1/|y| per response (ablation, F2)
    adv_std: bool = False  # divide advantages by the group std (GRPO)
    truncated_reward: str = "grade"  # a response cut at max_tokens: "grade" it as is, or score "zero"


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """[train.lora]: low-rank adapters W + (α/r)·B·A on the targeted weights, trained instead of the
    weights themselves (train/lora.py). rank 0: off, every weight trains."""

    rank: int = 0  # r
    alpha: float = 32.0  # α: the adapters' update is scaled by α/r
    # which weights get adapters, comma-separated: q, k, v, o (attention), mlp (a dense model's
    # feed-forward), experts (every routed expert's three matrices), or all (every one of those the
    # model has: LoRA matches full RL when it covers the MLP / MoE layers). Never the router or embeddings.
    targets: str = "all"


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 300
    prompts_per_step: int = 32  # B
    group_size: int = 8  # G
    minibatches: int = 1  # N: updates per step (N > 1 = off-policy mini-batches)
    micro_batch_tokens: int = 0  # tokens per forward/backward (gradient accumulation); 0 = a whole mini-batch
    lr: float = 3e-4
    # the learning rate rises linearly to `lr` over the first warmup_steps RL steps (lr·s/warmup at
    # step s): LoRA's first Adam steps move every adapter entry by about lr at once (docs/lora.md)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    replay: str = "off"  # off | r2 | r3 (routing replay for MoE)
    replay_diagnostics: bool = True  # R3: also compute π_old without replay (KL and route-agreement metrics)
    seed: int = 0
    time_limit_s: float = 0.0  # stop after this many seconds of RL (0 = no limit)
    # compute dtype of the trainer's parameters; the weights, gradients and Adam state stay float32
    # (master weights). "auto": bfloat16 on CUDA (TorchTitan's mixed precision), float32 on CPU.
    param_dtype: str = "auto"
    # "full": each decoder layer's activations are recomputed in backward (TorchTitan's FullAC), so
    # only layer inputs are kept; "none" keeps them all. The plan (--dry-run) counts activations by it
    activation_checkpoint: str = "none"
    # "optimizer": Adam's moments wait in host memory between updates (train/offload.py), so the
    # rollout engine's KV cache gets their GPU memory; each update brings them back for its step.
    # The plan (--dry-run) counts the host memory and the transfer time it costs
    offload: str = "none"
    # forward each prompt once for its G responses, which attend to it through a mask (packing.py);
    # the same log-probs to float rounding. Off: every response row carries a copy of its prompt.
    pack_prompts: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    grader: str = "arith"  # a name from the `minirl.graders` entry-point group
    params: dict[str, Any] = field(default_factory=dict)
    workers: int = 0  # grader processes (0 = in the trainer process; cheap graders)
    timeout_s: float = 5.0  # per response; a timeout scores 0 and is counted


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    k: int = 4  # samples per held-out problem
    temperature: float = 1.0
    max_problems: int = 500  # held-out problems a run scores (and `minirl eval heldout`); named benchmarks: all
    every: int = 0  # also score the held-out set every k steps during `run` (0 = at the start and end only)
    max_tokens: int = 0  # response limit for `minirl eval` (0 = rollout.max_tokens)
    prompt_template: str = ""  # benchmark prompt, with {problem}; "" = the benchmark's own (boxed-answer)
    grader_workers: int = 2  # grader processes for `minirl eval`
    data_dir: str = ""  # folder of <benchmark>.jsonl files used instead of the Hub


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 50  # steps
    keep: int = 2  # newest step checkpoints kept (0 = all; the final one and the rollback target always stay)


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """Where each step's metrics go besides runs/<id>/metrics.jsonl (minirl/run/sinks.py)."""

    tensorboard: bool = False  # event files in runs/<id>/tensorboard
    wandb: bool = False  # Weights & Biases; WANDB_MODE=offline writes runs/<id>/wandb with no network
    wandb_project: str = "minirl"
    wandb_entity: str = ""  # default: the logged-in user's
    wandb_name: str = ""  # default: the run folder's name
    wandb_tags: str = ""  # comma-separated


@dataclass(kw_only=True, slots=True)
class GuardConfig:
    """Collapse detection and rollback (minirl/run/guard.py)."""

    enabled: bool = True
    max_kl: float = 0.05  # KL(μ_old‖π_old) above this is a bad step
    min_entropy_frac: float = 0.05  # entropy below this share of the first step's ...
    max_entropy_factor: float = 1.25  # ... or above this multiple of it ...
    reward_drop: float = 0.2  # ... with reward this far below its best ...
    reward_drop_frac: float = 0.5  # ... or below (1 − this) × its best, is a bad step
    # a slide the entropy need not show: the mean reward of the last `slide_window` steps below the
    # best such window so far by more than `slide_z` standard errors of the difference (its sampling
    # noise) and by more than `slide_drop_frac` of it (the policy's own wobble) (guard.py, docs/runs.md)
    slide_window: int = 30
    slide_z: float = 4.0
    slide_drop_frac: float = 0.25
    patience: int = 3  # consecutive bad steps before a rollback
    max_rollbacks: int = 3  # then the run stops as "collapsed"
    lr_factor: float = 0.5  # learning rate multiplier applied at each rollback


@dataclass(kw_only=True, slots=True)
class ColdStartConfig:
    """SFT of the freshly built tiny model, run by `minirl init` (embedded default only)."""

    task: str = "addition"  # the embedded task init builds (minirl/task.py): addition | scratchpad | scratchpad-long
    # the tiny model's shape (minirl/models.py TINY): more layers and experts, and more of them
    # chosen per token, put more routes near a top-k boundary for precision to flip
    layers: int = 4
    experts: int = 8
    top_k: int = 2

    max_steps: int = 1000
    target_acc: float = 0.3  # stop once sampled (T=1) accuracy on the dev split reaches this
    dev_size: int = 256  # carved from the train split for the stopping rule; never the held-out split
    check_every: int = 25  # SFT steps between dev-accuracy checks (accuracy can jump within a few dozen)
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    train_size: int = 20000
    heldout_size: int = 500


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Cluster layout; single process on the embedded default."""

    nodes: int = 1
    gpus_per_node: int = 1
    dp_shard: int = -1  # FSDP2 degree (-1: all ranks)
    ep: int = 1  # expert-parallel degree


@dataclass(kw_only=True, slots=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """{"section.key": value} for every field, "section.sub.key" in a subsection: what `--set` names."""
        def fields(obj, prefix: str):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    yield from fields(value, f"{prefix}{f.name}.")
                else:
                    yield f"{prefix}{f.name}", value

        return dict(fields(self, ""))

    def changes(self, other: "Recipe") -> dict[str, tuple[Any, Any]]:
        """{"section.key": (this value, other's)} where `other` differs."""
        mine, theirs = self.flat(), other.flat()
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}

    def to_toml(self) -> str:
        lines = []

        def table(name: str, obj) -> None:
            lines.append(f"[{name}]")
            subs = []
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                if dataclasses.is_dataclass(v):
                    subs.append((f"{name}.{f.name}", v))  # a [section.sub] table follows its section's keys
                    continue
                if isinstance(v, dict):
                    v_s = "{ " + ", ".join(f"{kk} = {json.dumps(vv)}" for kk, vv in v.items()) + " }"
                elif isinstance(v, bool):
                    v_s = "true" if v else "false"
                else:
                    v_s = json.dumps(v)
                lines.append(f"{f.name} = {v_s}")
            lines.append("")
            for sub_name, sub in subs:
                table(sub_name, sub)

        for f in dataclasses.fields(self):
            table(f.name, getattr(self, f.name))
        return "\n".join(lines)


def _coerce(key: str, typ: Any, value: Any) -> Any:
    """Check (TOML) or parse (`--set` strings) one value against its declared type."""
    typ = typing.get_origin(typ) or typ
    from_flag = isinstance(value, str) and typ is not str
    try:
        if typ is bool:
            if from_flag:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError
            return value
        if typ is int:
            if isinstance(value, bool) or (not from_flag and not isinstance(value, int)):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is dict:
            v = json.loads(value) if from_flag else value
            if not isinstance(v, dict):
                raise ValueError
            return v
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except ValueError:
        pass
    else:
        return value
    raise UsageError(f"{key}: expected {getattr(typ, '__name__', typ)}, got {value!r}")


def _apply(recipe: Recipe, section: str, key: str, value: Any) -> None:
    sections = {f.name: f for f in dataclasses.fields(Recipe)}
    if section not in sections:
        raise UsageError(f"unknown recipe section [{section}]; known: {', '.join(sections)}")
    obj = getattr(recipe, section)
    hints = typing.get_type_hints(type(obj))
    if section == "rollout" and key in ("dtype", "fp8"):
        raise UsageError(f"rollout.{key} was replaced by rollout.precision = \"fp32\" | \"bf16\" | \"fp8\" "
                         "(dtype \"bfloat16\" → \"bf16\", \"float32\" → \"fp32\", fp8 = true → \"fp8\")")
    head, dot, rest = key.partition(".")
    if dot and head in hints and dataclasses.is_dataclass(getattr(obj, head)):  # `--set train.lora.rank=16`
        _apply_fields(getattr(obj, head), f"{section}.{head}", {rest: value})
        return
    if key not in hints:
        raise UsageError(f"unknown recipe key {section}.{key}; known in [{section}]: {', '.join(hints)}")
    if dataclasses.is_dataclass(getattr(obj, key)):  # a [section.sub] table
        if not isinstance(value, dict):
            raise UsageError(f"{section}.{key} is a table: [{section}.{key}] in a recipe, or --set {section}.{key}.KEY=VALUE")
        _apply_fields(getattr(obj, key), f"{section}.{key}", value)
        return
    setattr(obj, key, _coerce(f"{section}.{key}", hints[key], value))


def _apply_fields(obj, where: str, values: dict[str, Any]) -> None:
    """Keys of a subsection ([train.lora]) onto its dataclass."""
    hints = typing.get_type_hints(type(obj))
    for key, value in values.items():
        if key not in hints:
            raise UsageError(f"unknown recipe key {where}.{key}; known in [{where}]: {', '.join(hints)}")
        setattr(obj, key, _coerce(f"{where}.{key}", hints[key], value))


def load(path: Path | None, overrides: list[str] = ()) -> Recipe:
    """defaults < TOML file < `section.key=value` overrides."""
    recipe = Recipe()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"recipe not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"malformed recipe {path}: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise UsageError(f"{path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _apply(recipe, section, key, value)
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot or not key:
            raise UsageError(f"--set expects section.key=value, got {item!r}")
        _apply(recipe, section, key.strip(), value.strip())
    validate(recipe)
    return recipe


def with_sets(recipe: Recipe, sets: dict[str, Any]) -> Recipe:
    """A validated copy of `recipe` with `{"section.key": value}` changes (as `--set` gives them)."""
    out = copy.deepcopy(recipe)
    for dotted, value in sets.items():
        section, _, key = dotted.partition(".")
        _apply(out, section, key, value)
    validate(out)
    return out


RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def for_model(model_id: str | None) -> Path | None:
    """The shipped recipe written for a model (recipes/<id, lower case>.toml), if there is one."""
    if not model_id:
        return None
    p = RECIPES_DIR / f"{model_id.lower()}.toml"
    return p if p.is_file() else None


def shipped(name: str) -> Path:
    """A recipe from `recipes/` by file stem, e.g. "tiny"."""
    p = RECIPES_DIR / f"{name}.toml"
    if not p.is_file():
        names = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.toml")))
        raise UsageError(f"no shipped recipe {name!r}; available: {names}")
    return p
