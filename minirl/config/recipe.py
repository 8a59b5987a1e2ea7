"""Recipes: typed dataclasses that map one-to-one onto TOML sections and `--set a.b=c` overrides.

Each field declares its own range or choices (`number`, `one_of`, `rule`: fields.py), checked by `check_fields`
whenever a Recipe is built or loaded; a rule that spans fields lives in minirl/config/validator.py, and a
rule that needs the machine or the model in minirl/setup/limits.py. Reading TOML files and `--set`
flags is minirl/config/recipes.py's. Nothing here rewrites a field: a bad value fails naming its key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from minirl.config.engines import ENGINES
from minirl.config.fields import check_fields, number, one_of, rule
from minirl.config.precisions import NAMES as PRECISION_NAMES
from minirl.envs.formats import TOOL_FORMATS
from minirl.data.gym import gym_name, is_gym
from minirl.data.task import TASKS
from minirl.models.shapes import LORA_TARGETS
from minirl.models.sizing import max_samples_per_prompt

# The objectives train/objective.py implements (its LOSSES registry; a test keeps the two equal)
LOSS_NAMES = ("minirl", "grpo", "cispo")


def _task_name(key: str, v: str) -> str | None:
    if v in TASKS or (is_gym(v) and gym_name(v)):
        return None
    return f"{key} = {v!r}: an embedded task ({', '.join(TASKS)}) or a reasoning-gym one, rg:NAME"


def _not_greedy(key: str, v: float) -> str | None:
    if v == 0:
        return (f"{key} = 0 (greedy) samples the same response G times, so every group-mean advantage is 0; "
                "use a temperature > 0")
    return None


def _a_group(key: str, v: int) -> str | None:
    if v < 2:
        return (f"{key} = {v}: the advantage is R minus the mean of its group, so with one response per prompt "
                "every advantage is 0 and no update can change the policy; use ≥ 2")
    return None


def _one_problem_field(key: str, v: str) -> str | None:
    try:
        v.format(problem="")
        assert "{problem}" in v
    except (KeyError, IndexError, ValueError, AssertionError):
        return (f"{key} = {v!r} must hold {{problem}} once and no other {{...}} field (write a literal brace as "
                "{{ or }})")
    return None


def _lora_names(key: str, v: str) -> str | None:
    names = [t.strip() for t in v.split(",") if t.strip()]
    if not names or any(t not in (*LORA_TARGETS, "all") for t in names):
        return (f"{key} = {v!r}: name weights among {', '.join(LORA_TARGETS)}, or all "
                "(comma-separated; the router and the embeddings are never adapted)")
    return None


def _not_empty(key: str, v: str) -> str | None:
    return f"{key} is empty" if not v.strip() else None


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    id: str = rule("tiny-qwen3-moe", _not_empty)  # tiny-qwen3-moe | a short name (Qwen3-30B-A3B, ...) | an HF repo id | a local folder
    path: str = "model/coldstart"  # the HF folder to load (relative to the workspace); "" = from id (folder or Hub)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train: str = rule("data/train.jsonl", _not_empty)  # local JSONL/Parquet (relative to the workspace) or an HF dataset id
    heldout: str = rule("data/heldout.jsonl", _not_empty)
    prompt_field: str = rule("prompt", _not_empty)
    answer_field: str = rule("answer", _not_empty)
    max_prompt_tokens: int = number(32, 1)  # longer prompts are skipped and counted
    prompt_template: str = rule("{problem}", _one_problem_field)  # the text sent; "{problem}" stands for the prompt field
    chat_template: bool = False  # send it as one user turn through the tokenizer's chat template
    # keyword arguments that template reads, e.g. Qwen3's {enable_thinking = false} (its default:
    # thinking on); run, held-out and `minirl eval` prompts alike (#81)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    heldout_split: str = "train"  # the split of a Hub dataset in data.heldout (MATH-500: "test")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: str = one_of("vllm", ENGINES)
    # weights and compute of the rollout engine: fp32 | bf16 | fp8 (W8A8: FP8 weights with per-row
    # scales and per-token FP8 activations, vLLM's fp8_per_channel on CUDA; on CPU emulated: weights
    # rounded at every sync, activations at every linear layer). The lab's CPU-only levels:
    # fp8-weights (weights alone), and beyond the paper e5m2 (W8A8 in e5m2) and nvfp4 (W4A4 in
    # NVFP4, FP4 in blocks of 16). Training is fp32 on CPU, so μ ≠ π even on-policy, and the token
    # IS correction has work to do.
    precision: str = one_of("bf16", PRECISION_NAMES)
    temperature: float = rule(1.0, _not_greedy, 0)
    # the sampler's cuts after the temperature (#97): top-p in (0, 1] (1: off), top-k ≥ 0 (0: off), min-p in
    # [0, 1] (0: off). The engine records what each cut kept and the trainer renormalizes π over it
    # (train/cuts.py), so the ratio π/μ carries no kept mass
    top_p: float = number(1.0, 0, 1, above=True)
    top_k: int = number(0, 0)
    min_p: float = number(0.0, 0, 1)
    max_tokens: int = number(8, 1)  # response length limit
    # the share of each GPU the engine takes at its start (vLLM's gpu_memory_utilization: its weights,
    # working memory and KV cache), checked by the plan against what the trainer leaves free then;
    # 0 = the plan's: what the engine needs for the job, within what the trainer leaves
    # (models/sizing.py, docs/cluster.md). A CPU engine's KV cache is sized in bytes, so there vLLM
    # only checks it against the NUMA node's memory
    memory_fraction: float = number(0.1, 0, 1)
    # explicit KV-cache size per GPU; 0 = sized for the job (every sequence of a step at full length,
    # at least 256 on a CPU): on a GPU within memory_fraction or what the trainer leaves
    kv_cache_gib: float = number(0.0, 0)
    # CUDA graphs for decoding (vLLM's default); false: eager, as the CPU engine always runs
    cuda_graphs: bool = True
    tensor_parallel: int = number(1, 1)  # GPUs per vLLM engine; under torchrun every tensor_parallel consecutive ranks share one
    # while the trainer trains (CUDA; CPU has no sleep mode): 0 stay awake, 1 offload weights to host
    # and drop the KV cache, 2 drop both (every sync reloads every weight, so nothing is lost);
    # -1 = the plan's: on a GPU 0 where the trainer's larger phase and the engine with its whole job's
    # KV cache fit together, else 2 (--dry-run says which and why); on a CPU 0
    sleep_level: int = number(-1, -1, 2)
    sync_bucket_mib: int = number(1024, 1)  # weight sync: whole decoder layers gathered and loaded at most this much at a time
    # check vLLM vs trainer log-probs on a fixed batch after the first sync, every k-th and every
    # rollback (0 = never); each check costs about a π_old forward of 16 responses
    parity_every: int = number(10, 0)
    # k: how many updates the weights that sample a step's batch may be behind the weights it
    # trains (rollout/controller.py, docs/async.md). 0: synchronous. k ≥ 1: the engine, in a
    # process of its own, samples up to k steps ahead while the trainer trains (1: the next step's
    # batch while this one trains). One trainer process: on a CPU (2+ cores) the trainer takes half
    # of them, the engine the rest; on one GPU the engine shares it, awake (sleep_level 0)
    max_staleness: int = number(0, 0)
    # k ≥ 1: the engine keeps stepping across calls: an admitted batch joins the requests in flight
    # at once (the batches of several steps sampled together), and a sync is loaded between two
    # forward steps while they go on (each token stamped with the version that sampled it: fresher
    # tokens, a run no longer reproducible); false: one batch at a time, syncs between two batches
    # (every batch sampled by one version, known when it is admitted: a seeded run repeats exactly)
    inflight_updates: bool = False


@dataclass(kw_only=True, slots=True)
class LossConfig:
    name: str = one_of("minirl", LOSS_NAMES)
    eps_low: float = number(0.2, 0, 1, above=True)  # ε_low
    eps_high: float = number(0.27, 0, above=True)  # ε_high
    tis_cap: float = number(5.0, 0, above=True)  # truncated-IS cap
    is_mode: str = one_of("truncate", ("truncate", "mask", "off"))
    # the rollout engine (vLLM, rollout.precision) always differs from the trainer (TorchTitan):
    # is_mode = "off" leaves that gap uncorrected and must be asked for explicitly
    allow_uncorrected: bool = False
    length_norm: bool = False  # 1/|y| per response (ablation, F2)
    adv_std: bool = False  # divide advantages by the group std (GRPO)
    truncated_reward: str = one_of("grade", ("grade", "zero"))  # a response cut at max_tokens: "grade" it as is, or score "zero"
    # DAPO's soft overlong punishment: over the last `overlong_buffer` tokens before rollout.max_tokens
    # (L_cache) the reward falls linearly, by `overlong_penalty` at the limit (objective.overlong_penalty);
    # 0: off. It shapes what trains, never the grade: rollout/acc and held-out scores are the grader's
    overlong_buffer: int = number(0, 0)
    overlong_penalty: float = number(1.0, 0, above=True)
    # what the clip's ratio r_t = π_θ/π_θold is anchored at for a token sampled behind the trained
    # weights (rollout.max_staleness ≥ 1): "sampler", the weights that sampled it (their log μ; the
    # paper's θ_old), or "proximal", π_old recomputed at the trained weights (decoupled PPO; r_t ≡ 1
    # at N = 1). Fresh tokens are anchored at π_old either way (objective.sampler_logp)
    clip_against: str = one_of("sampler", ("sampler", "proximal"))
    # with rollout.top_p / top_k / min_p: π renormalized over what the sampler kept (train/cuts.py); false
    # takes π over the whole vocabulary, whose ratio to μ carries the kept mass (TRL #7269): ablations only
    renormalize_kept: bool = True


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """[train.lora]: low-rank adapters W + (α/r)·B·A on the targeted weights, trained instead of the
    weights themselves (train/lora.py). rank 0: off, every weight trains."""

    rank: int = number(0, 0)  # r
    alpha: float = number(32.0, 0, above=True)  # α: the adapters' update is scaled by α/r
    # which weights get adapters, comma-separated: q, k, v, o (attention), mlp (a dense model's
    # feed-forward), experts (every routed expert's three matrices), or all (every one of those the
    # model has: LoRA matches full RL when it covers the MLP / MoE layers). Never the router or embeddings.
    targets: str = rule("all", _lora_names)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = number(300, 0)
    prompts_per_step: int = number(32, 1)  # B
    group_size: int = rule(8, _a_group, 1, max_samples_per_prompt)  # G (vLLM's n per request bounds it)
    minibatches: int = number(1, 1)  # N: updates per step (N > 1 = off-policy mini-batches)
    # tokens per forward/backward (gradient accumulation, and π_old's chunks); 0 = the plan's: on a GPU
    # the largest with which every phase fits (--dry-run prints it), on a CPU a whole mini-batch
    micro_batch_tokens: int = number(0, 0)
    lr: float = number(3e-4, 0, above=True)
    # the learning rate rises linearly to `lr` over the first warmup_steps RL steps (lr·s/warmup at
    # step s): LoRA's first Adam steps move every adapter entry by about lr at once (docs/lora.md)
    warmup_steps: int = number(0, 0)
    weight_decay: float = number(0.0, 0)
    grad_clip: float = number(1.0, 0, above=True)
    replay: str = one_of("off", ("off", "r2", "r3"))  # routing replay for MoE
    replay_diagnostics: bool = True  # R3: also compute π_old without replay (KL and route-agreement metrics)
    seed: int = number(0, 0, 2**31 - 1)
    time_limit_s: float = number(0.0, 0)  # stop after this many seconds of RL (0 = no limit)
    # compute dtype of the trainer's parameters; the weights, gradients and Adam state stay float32
    # (master weights). "auto": bfloat16 on CUDA (TorchTitan's mixed precision), float32 on CPU.
    param_dtype: str = one_of("auto", ("auto", "float32", "bfloat16"))
    # "full": each decoder layer's activations are recomputed in backward (TorchTitan's FullAC), so
    # only layer inputs are kept; "none" keeps them all. The plan (--dry-run) counts activations by it
    activation_checkpoint: str = one_of("none", ("none", "full"))
    # "optimizer": Adam's moments wait in host memory between updates (train/offload.py), so the
    # rollout engine's KV cache gets their GPU memory; each update brings them back for its step.
    # The plan (--dry-run) counts the host memory and the transfer time it costs
    offload: str = one_of("none", ("none", "optimizer"))
    # forward each prompt once for its G responses, which attend to it through a mask (packing.py);
    # the same log-probs to float rounding. Off: every response row carries a copy of its prompt.
    pack_prompts: bool = True
    # DAPO's dynamic sampling: a group whose G rewards are all equal has zero advantage (A = R − mean)
    # and no gradient, yet costs its share of the batch; such groups are dropped and more prompts are
    # drawn, prompts_per_step at a time, until the batch holds prompts_per_step groups whose rewards
    # differ, or `dynamic_sampling_draws` more draws were made (the rest then as drawn: run/dynamic.py)
    dynamic_sampling: bool = False
    dynamic_sampling_draws: int = number(3, 1)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    grader: str = rule("arith", _not_empty)  # a name from the `minirl.graders` entry-point group
    params: dict[str, Any] = field(default_factory=dict)
    workers: int = number(0, 0, 256)  # grader processes (0 = in the trainer process; cheap graders)
    timeout_s: float = number(5.0, 0, above=True)  # per response; a timeout scores 0 and is counted
    # a step whose share of grader errors (a score outside [0, 1], an exception) passes this stops the run
    # naming the grader (#82): its zeros would be trained on as wrong answers. 1: never
    max_error_frac: float = number(0.5, 0, 1)


def _importable(what: str, form: str, empty: str):
    """The rule of a field that names an importable `module:attr` (or "" for `empty`)."""

    def check(key: str, v: str) -> str | None:
        module, _, name = v.partition(":")
        if v and not (module and name):
            return f"{key} = {v!r}: name {what} as {form} (importable), or \"\" for {empty}"
        return None

    return check


_env_class = _importable("the environment's class", "module:Class", "one turn")
_reward_func = _importable("the reward function", "module:function", "none")


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    # multi-turn episodes (#84, rollout/episodes.py): "" = one prompt, one response; else the environment's
    # class, module:Class, in OpenEnv's shape (minirl/envs/contract.py), one per episode, reset with its row
    name: str = rule("", _env_class)
    params: dict[str, Any] = field(default_factory=dict)  # keyword arguments of its constructor
    tool_format: str = one_of("qwen3", TOOL_FORMATS)  # how a call and a reply are written (qwen3: Hermes tags)
    max_turns: int = number(4, 1)  # engine calls per episode; rollout.max_tokens bounds all of them together
    # calls one turn may make (tool_format "qwen3" with the chat template): 1, the engine stops a turn on its
    # call's close; more, the turn runs to its end and its calls are answered together (envs/templates.py)
    max_calls: int = number(1, 1)
    # "calls": the environment answers tool calls, and a turn without one is the episode's answer; "turns":
    # it answers every turn, a call as the tool, any other turn as the user (a game, a simulated user), until
    # it says done (env.max_turns and the budget cut it short)
    replies_to: str = one_of("calls", ("calls", "turns"))
    # one reply's tokens, its scaffold counted; a longer one is cut, with a marker (envs/formats.py)
    max_reply_tokens: int = number(64, 1)
    # any one call of the environment (constructor and reset together, a step, a close), timed from its
    # own start; past it the episode ends in the environment's fault (envs/hosting.py)
    step_timeout_s: float = number(30.0, 0, above=True)
    # a step whose share of episodes ending in an environment error passes this stops the run naming
    # the environment (errors.EnvFault); below it those episodes are left out of the loss. 1: never
    max_error_frac: float = number(0.5, 0, 1)
    # environments alive at once in a process (0: every episode of its batches at once); a class that
    # says SUPPORTS_CONCURRENT_SESSIONS = False (OpenEnv's flag) runs one at a time whatever this says
    max_concurrency: int = number(0, 0)
    # where each environment lives for its lifetime: a thread of its own, or a process of its own
    # (killed when a call passes step_timeout_s; its crash is its episode's fault alone)
    isolation: str = one_of("thread", ("thread", "process"))
    # R of an episode whose environment gives rewards: "final", the reward of the observation that
    # ended it (else the grader's score); "sum", every step's reward added up
    reward: str = one_of("final", ("final", "sum"))
    # module:function, a TRL reward function that reads the environment (`reward_func(environments, **kwargs)`,
    # as TRL's environment examples score theirs): called on the environment's worker as its episode ends,
    # its value the episode's R (None: the grader scores); "" none (envs/hosting.py)
    reward_func: str = rule("", _reward_func)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    k: int = number(4, 1, max_samples_per_prompt)  # samples per held-out problem
    temperature: float = number(1.0, 0)
    # the sampler's cuts after the temperature, as vLLM applies them (Qwen3's model cards: top-p 0.95, top-k 20
    # in thinking mode): top-p in (0, 1] (1: off), top-k ≥ 0 (0: off), min-p in [0, 1] (0: off)
    top_p: float = number(1.0, 0, 1, above=True)
    top_k: int = number(0, 0)
    min_p: float = number(0.0, 0, 1)
    max_problems: int = number(500, 1)  # held-out problems a run scores (and `minirl eval heldout`); named benchmarks: all
    every: int = number(0, 0)  # also score the held-out set every k steps during `run` (0 = at the start and end only)
    max_tokens: int = number(0, 0)  # response limit for `minirl eval` (0 = rollout.max_tokens)
    prompt_template: str = ""  # benchmark prompt, with {problem}; "" = the benchmark's own (boxed-answer)
    grader_workers: int = number(2, 0, 256)  # grader processes for `minirl eval`
    data_dir: str = ""  # folder of <benchmark>.jsonl files used instead of the Hub


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = number(50, 1)  # steps
    keep: int = number(2, 0)  # newest step checkpoints kept (0 = all; the final one and the rollback target always stay)


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """Where each step's metrics go besides runs/<id>/metrics.jsonl (minirl/run/sinks.py)."""

    tensorboard: bool = False  # event files in runs/<id>/tensorboard
    wandb: bool = False  # Weights & Biases; WANDB_MODE=offline writes runs/<id>/wandb with no network
    wandb_project: str = "minirl"
    wandb_entity: str = ""  # default: the logged-in user's
    wandb_name: str = ""  # default: the run folder's name
    wandb_tags: str = ""  # comma-separated
    # what the model wrote (runs/<id>/samples.jsonl, `minirl samples`): this many of each step's groups
    # (0: none), each text kept to its first and last samples_max_chars / 2 characters (minirl/run/samples.py)
    samples_groups: int = number(2, 0)
    samples_max_chars: int = number(4000, 100)
    # the record of every trained token (runs/<id>/tokens.jsonl, checked by `minirl check`): the first
    # record_tokens steps whole (0: none), then every record_tokens_every-th step's (0: none)
    record_tokens: int = number(0, 0)
    record_tokens_every: int = number(0, 0)


@dataclass(kw_only=True, slots=True)
class GuardConfig:
    """Collapse detection and rollback (minirl/run/guard.py)."""

    enabled: bool = True
    max_kl: float = number(0.05)  # KL(μ_old‖π_old) above this is a bad step (below 0: every step is)
    # sampling k updates ahead (rollout.max_staleness) puts the policy's own move over those updates
    # into KL(μ‖π_old): the threshold grows by this much per update of the batch's mean lag, so the
    # guard acts on a mismatch beyond what the lag explains (healthy runs of the default at k = 1–4,
    # lr 3e-4: at most 0.133 per update, docs/async.md)
    max_kl_per_update_behind: float = number(0.15, 0)
    # the lag allowance covers the policy's own move; the training–inference mismatch has signals of
    # its own that no lag explains (guard.py): KL(μ‖π_old) over the tokens the trained weights sampled
    # themselves (in-flight updates; judged against max_kl, with no allowance), and the parity check,
    # mean |log μ − log π| on fixed responses with both engines at the same weights, a bad step when
    # above max_parity or above parity_growth × the median of the run's parities so far (once 3 are
    # in, and above parity_floor): calibrated on healthy seeded runs (docs/runs.md). A bad parity is
    # checked again at every step until it is good
    max_parity: float = number(0.5, 0, above=True)
    parity_growth: float = number(6.0, 1, above=True)
    parity_floor: float = number(1e-3, 0)
    min_entropy_frac: float = number(0.05, 0, 1)  # entropy below this share of the first step's ...
    max_entropy_factor: float = number(1.25, 1, above=True)  # ... or above this multiple of it ...
    # ... with the reward this far below the run's level (its best `slide_window`-step mean since the
    # start or the last rollback) ...
    reward_drop: float = number(0.2, 0)
    reward_drop_frac: float = number(0.5, 0, 1)  # ... or below (1 − this) × it ...
    down_z: float = number(2.0, 0, above=True)  # ... and more than this many standard errors below it
    # a crash the entropy has not shown yet: a step's reward below (1 − this) × the level, and down_z
    # standard errors below it, is bad on its own (a lasting one is rolled back after `patience` steps);
    # real runs' dips to half their level came back, none went below a quarter (docs/runs.md). 1: never
    crash_frac: float = number(0.75, 0, 1)
    # a slide the entropy need not show: the mean reward of the last `slide_window` steps below the
    # best such window so far by more than `slide_z` standard errors of the difference (its sampling
    # noise) and by more than `slide_drop_frac` of it (the policy's own wobble) (guard.py, docs/runs.md)
    slide_window: int = number(30, 0)  # 0: no slide rule
    slide_z: float = number(4.0, 0, above=True)
    slide_drop_frac: float = number(0.25, 0, 1)
    # the share of a step's response tokens whose log μ from the engine may be non-finite (dropped
    # from the loss) before the run stops: more is a broken engine, not a bad policy, and no rollback
    # mends it (errors.EngineFault); 0: none may be
    max_nonfinite_logp: float = number(0.001, 0, 1)
    patience: int = number(3, 1)  # consecutive bad steps before a rollback
    max_rollbacks: int = number(3, 0)  # then the run stops as "collapsed"
    lr_factor: float = number(0.5, 0, 1, above=True)  # learning rate multiplier applied at each rollback


@dataclass(kw_only=True, slots=True)
class ColdStartConfig:
    """SFT of the freshly built tiny model, run by `minirl init` (embedded default only)."""

    # the task init builds: an embedded one (minirl/data/task.py) or reasoning-gym's "rg:NAME"
    # (minirl/data/gym.py), generated with `task_params` (its config; embedded tasks take none)
    task: str = rule("addition", _task_name)
    task_params: dict[str, Any] = field(default_factory=dict)
    # the tiny model's shape (minirl/models/shapes.py TINY): more layers and experts, and more of them
    # chosen per token, put more routes near a top-k boundary for precision to flip
    layers: int = number(4, 1, 64)
    experts: int = number(8, 2, 256)
    top_k: int = number(2, 1, 256)

    max_steps: int = number(1000, 1)
    target_acc: float = number(0.3, 0, 1)  # stop once sampled (T=1) accuracy on the dev split reaches this
    dev_size: int = number(256, 1)  # carved from the train split for the stopping rule; never the held-out split
    check_every: int = number(25, 1)  # SFT steps between dev-accuracy checks (accuracy can jump within a few dozen)
    batch_size: int = number(128, 1)
    lr: float = number(3e-3, 0, above=True)
    seed: int = number(0, 0, 2**31 - 1)
    train_size: int = number(20000, 2)
    heldout_size: int = number(500, 1)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Cluster layout; single process on the embedded default."""

    nodes: int = number(1, 1)
    gpus_per_node: int = number(1, 1)
    dp_shard: int = number(-1, -1)  # FSDP2 degree (-1: all ranks)
    ep: int = number(1, 1)  # expert-parallel degree
    # GPUs of each node that only sample (rollout engines apart from the trainer, whose ranks are
    # the node's other GPUs; weights broadcast to them at each sync: rollout/remote.py); 0: every GPU
    # trains, and samples with an engine beside the trainer. `--rollout-gpus R` sets it; on a CPU
    # each "GPU" is an engine process
    rollout_gpus: int = number(0, 0)

    @property
    def training_gpus(self) -> int:
        """The GPUs of the whole job that train (the trainer's world size)."""
        return self.nodes * (self.gpus_per_node - self.rollout_gpus)


@dataclass(kw_only=True, slots=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        check_fields(self)

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


