"""`minirl run --dry-run`: the plan of a run, computed from the recipe and the model's shape alone
(no GPU, no weights, no workspace): the device mesh, memory per GPU by component, tokens and
FLOPs per step. A plan that cannot fit is refused naming what overflows (the launch lines: dryrun.py).

The memory model, per GPU (P = parameters, W = world size = nodes × GPUs per node):

    training state   FSDP2 shards every parameter over all W ranks (experts over EP × the rest):
                     fp32 master weights 4 B + fp32 gradients 4 B + Adam's two moments 8 B = 16 B × P / W
                     with LoRA ([train.lora]): the base frozen in the compute dtype, 2 B × P / W in
                     bf16, and 16 B per adapter parameter / W (fp32 adapters, gradients, Adam);
                     one process (W = 1) holds its bf16 base whole and gathers nothing
    gathered layer   bf16 weights of the layers being computed, unsharded: 2 B × 2 layers (one prefetched);
                     of an MoE layer's experts only this rank's EP share
    activations      per micro-batch of T tokens on this GPU: what the forward keeps for the backward
                     on the path the run takes, one process (autocast) or FSDP2, read from the tensors
                     it saves (footprint.activation_bytes; tests/test_memory_model.py holds it within
                     20%); with activation checkpointing (train.activation_checkpoint = "full"; the
                     row that counts follows it) each layer's input, plus one layer in full
    logits           the output head a chunk of 1,024 positions at a time where a micro-batch's bf16
                     logits pass 1 GiB (train/head.py): that chunk's bf16 logits and three fp32
                     [chunk, vocab] tensors; else T × vocab in bf16 and their gradient, plus one fp32
                     chunk of 4,096 positions and its softmax (minirl.train.head.target_logprobs)
    vLLM weights     colocated, one engine per tensor-parallel group: P × 2 B (bf16) or 1 B (fp8) / TP
    vLLM working     its activations, workspaces, CUDA graphs and sampler (sizing.working_bytes:
                     an estimate until a GPU measures it)
    KV cache         at 2 (K, V) × layers × KV heads × head dim × 2 B per token: with
                     rollout.memory_fraction = 0 sized for the job (every sequence of a step at full
                     length) within what the trainer leaves; else what the recipe's fraction leaves
                     after weights and working memory (vLLM's own sizing), or rollout.kv_cache_gib.
                     It sets how many full-length sequences an engine holds at once
    the engine's     weights + working memory + KV cache as a fraction of the GPU: vLLM's gpu_memory_
    start            utilization, taken at its start beside the trainer's state between updates; the plan
                     derives it (fraction 0) or refuses the recipe's where it is more than is free then

With rollout GPUs (parallel.rollout_gpus = R per node) the trainer's W is nodes × (GPUs per node − R),
its GPUs hold no engine, and each engine holds its R-share alone: weights, working memory, a KV cache
sized for the job within its GPU, and the bucket the weights are broadcast in.

Colocated (R = 0), rollouts and training alternate: vLLM sleeps (frees its KV cache) while the trainer runs, and the
trainer's activations are gone while vLLM samples, so the peak is the largest of the phases:

    training         weights + gradients + the activations, gathered layers and logits of a micro-batch
                     + Adam's moments; offloaded (train.offload = "optimizer", train/offload.py) the
                     moments come back only for the step, after the backward freed the activations
    weight sync      what the trainer keeps between updates (weights, and the moments unless offloaded;
                     the gradients are freed after each step and the allocator's blocks handed back
                     before the engine wakes) + vLLM's weights + one bucket + one gathered parameter
    rollout          what the trainer keeps between updates + the engine (weights, working memory, KV cache)

The engine's KV cache, its share of the GPU at its start and the refusals of an engine without room are
setup/engine_share.py's. A plan that does not fit names every phase that overflows (the most that fits rounded
down, the largest part and what shrinks it: setup/overflow.py), and setup/advice.py finds the cheapest change
that makes all fit: the engine's share, micro-batch, offload, rollout TP, FP8, LoRA, more GPUs, in that order.
Host memory per node (`host_memory`) and the moments' transfer time per step (at HOST_LINK_BYTES_S, an
assumption) are reported beside the GPU's figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minirl.config.precisions import PRECISIONS
from minirl.config.recipes import with_sets
from minirl.models import sizing
from minirl.models.shapes import ModelShape, active_params, param_count
from minirl.setup.footprint import activation_bytes, host_memory, trainer_path, trainer_state
from minirl.setup.engine_share import beside_trainer, on_rollout_gpus
from minirl.setup.overflow import GiB, HEADROOM, largest_part  # the plan's units, read by its callers too

LOGIT_CHUNK = 4096
# pinned host <-> GPU copies, each GPU on its own PCIe Gen5 x16 link (64 GB/s a direction on paper):
# an assumption for the transfer-time estimate, not a measurement
HOST_LINK_BYTES_S = 25e9


@dataclass
class Plan:
    model: str
    shape: ModelShape
    nodes: int
    gpus_per_node: int
    gpu_gib: float
    mesh: dict[str, int]
    params: int
    active: int
    adapters: int  # LoRA adapter parameters (0: every weight trains)
    tokens_per_step: int
    micro_batch_tokens: int
    train_flops_per_step: float
    rollout_flops_per_step: float
    memory_gib: dict[str, float]  # per GPU, by component
    phases_gib: dict[str, float]  # per GPU, peak of each phase
    in_flight: int  # full-length sequences one vLLM engine holds at once
    engine_fraction: float  # vLLM's gpu_memory_utilization: its share of each GPU, taken at its start
    engine_start_free_gib: float  # what the plan leaves free on each GPU when the engine starts
    kv_sizing: str  # what decided the KV cache: sized for the job, what the trainer leaves, or the recipe's setting
    sequences_per_engine: int
    host_gib_per_node: float  # the most of one node's host memory the job holds at once (host_memory's peak)
    host_gib: dict[str, float]  # that, by part (`host_memory`)
    offload_s_per_step: float  # the offloaded moments' trips over the host link (an estimate: HOST_LINK_BYTES_S)
    problems: list[str] = field(default_factory=list)
    rollout_gpus: int = 0  # per node, GPUs that only sample (parallel.rollout_gpus); 0: the engines beside the trainer
    micro_batch_chosen: bool = False  # the plan chose micro_batch_tokens (the recipe's 0), and the run trains with it
    sleep_level: int = 0  # the engine's while the trainer trains: the recipe's, or the plan's (`_with_sleep`)
    sleep_chosen: bool = False  # the plan chose it (the recipe's -1), and the run sleeps so
    sleep_why: str = ""  # what decided the plan's choice
    trainer_path: str = "one process"  # how the trainer computes: "one process" (autocast) or "fsdp2" (trainer_path)
    rollout_draws_max: int = 1  # batches sampled a step at most (dynamic sampling's draws: one at a time)

    @property
    def fits(self) -> bool:
        return not self.problems


def fit_mesh(rec, shape: ModelShape, keep=frozenset()) -> dict[str, int]:
    """The recipe's expert parallelism and rollout tensor parallelism, each lowered to the largest
    degree the machine in its [parallel] section has room for (a recipe written for two nodes of 8
    planned on one GPU), as `--set` keys and values; empty when the recipe's mesh fits as it is.
    Keys in `keep` (what the user set with --set) are never lowered: a run would refuse them."""
    p, world = rec.parallel, rec.parallel.training_gpus
    out = {}
    if shape.is_moe and (world % p.ep or shape.num_experts % p.ep):
        out["parallel.ep"] = max(d for d in range(1, p.ep + 1) if world % d == 0 and shape.num_experts % d == 0)
    tp = rec.rollout.tensor_parallel
    # an engine spans GPUs of one node: the training ranks' (colocated), or the rollout GPUs'
    ranks, per_node = (p.nodes * p.rollout_gpus, p.rollout_gpus) if p.rollout_gpus else (world, p.gpus_per_node)
    if ranks % tp or tp > per_node:
        out["rollout.tensor_parallel"] = max(d for d in range(1, tp + 1) if ranks % d == 0 and d <= per_node)
    return {k: v for k, v in out.items() if k not in keep}


def make_plan(rec, shape: ModelShape, *, model: str, gpu_gib: float = 80.0) -> Plan:
    """The plan of `rec` for GPUs of `gpu_gib`, with the choices the recipe leaves to it made: the
    engine's sleep (`rollout.sleep_level = -1`: `_with_sleep`) and the micro-batch (`_with_micro`)."""
    if rec.rollout.sleep_level < 0:
        return _with_sleep(rec, shape, model=model, gpu_gib=gpu_gib)
    return _with_micro(rec, shape, model=model, gpu_gib=gpu_gib)


def _with_sleep(rec, shape: ModelShape, *, model: str, gpu_gib: float) -> Plan:
    """rollout.sleep_level = -1: the engine stays awake (0) where the trainer's larger phase and the
    engine with its whole job's KV cache fit together within the headroom, or where it must (its
    own GPUs, or sampling ahead beside the trainer); else it sleeps at level 2 while the trainer
    trains, dropping its KV cache and weights (each sync reloads them). Sleeping costs every step an
    unmap, a map and a reload of every weight; on the H200 the tiny default slept through updates
    that needed 0.08 GiB (#73)."""
    r = rec.rollout
    awake = _with_micro(with_sets(rec, {"rollout.sleep_level": 0}), shape, model=model, gpu_gib=gpu_gib)
    if rec.parallel.rollout_gpus or r.max_staleness:
        why = "its own GPUs: nothing to free" if rec.parallel.rollout_gpus else \
            "it samples ahead on the trainer's GPU while the trainer trains (rollout.max_staleness ≥ 1)"
        plan, level = awake, 0
    elif awake.fits and awake.in_flight >= awake.sequences_per_engine:
        plan, level = awake, 0
        why = (f"the trainer's larger phase and the engine with its whole job's KV cache fit together "
               f"({max(awake.phases_gib.values()):.1f} GiB of {HEADROOM:.0%} of {gpu_gib:g})")
    else:
        refused = r.precision == "fp8" and r.cuda_graphs  # validator.py's #72 rule, where the plan made the choice
        asleep = {"rollout.sleep_level": 2, **({"rollout.cuda_graphs": False} if refused else {})}  # the same memory
        plan = _with_micro(with_sets(rec, asleep), shape, model=model, gpu_gib=gpu_gib)
        level = 2
        why = ("awake beside the trainer it would leave " + ("no room" if not awake.fits else "too small a KV cache")
               + " for the job; asleep its KV cache and weights are freed while the trainer trains")
        if refused:
            plan.problems.append("the engine must sleep at level 2 here, and FP8 decode through CUDA graphs after a "
                                 "level-2 sleep is refused (#72, docs/precision.md): set rollout.cuda_graphs = false, "
                                 "or rollout.precision = \"bf16\"")
    plan.sleep_level, plan.sleep_chosen, plan.sleep_why = level, True, why
    return plan


def _with_micro(rec, shape: ModelShape, *, model: str, gpu_gib: float) -> Plan:
    """The plan of `rec` for GPUs of `gpu_gib`. With train.micro_batch_tokens = 0 the plan chooses
    the micro-batch: the whole mini-batch of a GPU where it fits, else the largest power of two
    tokens (at least one full-length sequence) with which every phase fits, else the whole
    mini-batch (the plan then says what does not fit). `minirl run` on a GPU trains with the plan's."""
    if rec.train.micro_batch_tokens:
        return _make_plan(rec, shape, model=model, gpu_gib=gpu_gib)
    seq = sizing.max_model_len(rec) - 1  # prompt and response; a multi-turn episode's replies too
    t = rec.train
    whole = math.ceil(t.prompts_per_step * t.group_size * seq / t.minibatches / rec.parallel.training_gpus)
    sizes = [whole] + [2**e for e in range(int(math.log2(max(whole - 1, 1))), -1, -1) if seq <= 2**e < whole]
    plans = (_make_plan(with_sets(rec, {"train.micro_batch_tokens": m}), shape, model=model, gpu_gib=gpu_gib)
             for m in sizes)
    # none fits: the whole mini-batch's plan says what overflows (the advice then tries smaller ones)
    plan = next((p for p in plans if p.fits), None) or _make_plan(rec, shape, model=model, gpu_gib=gpu_gib)
    plan.micro_batch_chosen = True
    return plan


def _mesh_problems(rec, shape: ModelShape, *, world: int, dp_shard: int, ep: int) -> list[str]:
    """What the recipe's mesh asks that the plan cannot lay out on its `world` training ranks."""
    p, tp_vllm = rec.parallel, rec.rollout.tensor_parallel
    problems = []
    if dp_shard != world:
        problems.append(f"parallel.dp_shard = {dp_shard} must be -1 or the world size {world} (no other "
                        "parallelism is planned yet)")
    if ep > 1 and (world % ep or shape.num_experts % ep):
        problems.append(f"parallel.ep = {ep} must divide the world size {world} and the {shape.num_experts} experts")
    if p.rollout_gpus and p.rollout_gpus % tp_vllm:
        problems.append(f"rollout.tensor_parallel = {tp_vllm} must divide each node's {p.rollout_gpus} rollout GPU(s)")
    elif not p.rollout_gpus and (world % tp_vllm or tp_vllm > p.gpus_per_node):
        problems.append(f"rollout.tensor_parallel = {tp_vllm} must divide the world size and fit in one node "
                        f"({p.gpus_per_node} GPUs)")
    return problems


def _flops(rec, shape: ModelShape, *, tokens: int, seq: int) -> tuple[float, float]:
    """(training, rollout) FLOPs a step: 2·active a token forward, 4·active backward; attention
    2·2·L·(seq/2)·heads·head_dim a token forward."""
    attn_fwd = 4 * shape.n_layers * (seq // 2) * shape.n_heads * shape.head_dim
    fwd = tokens * (2 * active_params(shape) + attn_fwd)
    t = rec.train
    passes = 1 + (1 if t.replay == "r3" and t.replay_diagnostics else 0)  # π_old (+ own routes for R3 metrics)
    return float(fwd * passes + 3 * fwd), float(fwd)  # + forward and backward of the update; one forward to sample


def _make_plan(rec, shape: ModelShape, *, model: str, gpu_gib: float) -> Plan:
    p, t, r = rec.parallel, rec.train, rec.rollout
    world = p.training_gpus  # the trainer's ranks (every GPU, unless parallel.rollout_gpus keeps some to sample)
    split = p.rollout_gpus > 0
    dp_shard = world if p.dp_shard == -1 else p.dp_shard
    ep = p.ep if shape.is_moe else 1
    tp_vllm = r.tensor_parallel
    problems = _mesh_problems(rec, shape, world=world, dp_shard=dp_shard, ep=ep)

    P, A = param_count(shape), active_params(shape)
    seq = sizing.max_model_len(rec) - 1  # prompt and response; a multi-turn episode's replies too
    sequences = t.prompts_per_step * t.group_size
    tokens = sequences * seq  # an upper bound: responses stop at EOS
    mb_tokens_gpu = math.ceil(tokens / t.minibatches / world)
    micro = min(t.micro_batch_tokens or mb_tokens_gpu, mb_tokens_gpu)

    d, L = shape.dim, shape.n_layers
    layer_params = (P - shape.vocab_size * d * (1 if shape.tie_embeddings else 2)) // L
    if shape.is_moe:
        experts = shape.num_experts * 3 * d * shape.moe_hidden_dim
        layer_params += experts // ep - experts  # FSDP gathers only this rank's EP share of the experts
    path = trainer_path(rec)
    acts = {f"activations ({name})": sum(activation_bytes(shape, micro, path=path, ac=ac).values())
            for name, ac in (("no AC", "none"), ("full AC", "full"))}
    from minirl.train.head import head_chunk  # deferred: torch, which the commands that plan nothing start without
    chunk = head_chunk(micro, shape.vocab_size)
    # chunked head: a chunk's bf16 logits and three float32 [chunk, vocab] at most (head.py); else the
    # micro-batch's bf16 logits and their gradient, and one float32 chunk and its softmax
    logits = (chunk * shape.vocab_size * (2 + 3 * 4) if chunk else
              micro * shape.vocab_size * 2 * 2 + min(micro, LOGIT_CHUNK) * shape.vocab_size * 4 * 2)
    weight_bytes = PRECISIONS[r.precision].weight_bytes
    engines = max(1, (p.nodes * p.rollout_gpus if split else world) // tp_vllm)
    kv_per_token = shape.kv_bytes_per_token(2)
    weights, grads, moments, adapters = trainer_state(rec, shape, device="cuda")
    state = {**weights, **grads, **moments}
    # one process holds its (bf16) LoRA base whole: nothing is gathered
    gathered = 0 if t.lora.rank and world == 1 else 2 * 2 * layer_params
    mem = {
        **state,
        "gathered bf16 layers": gathered,
        **acts,
        "logits": logits,
        f"vLLM weights ({r.precision}, TP {tp_vllm})": P * weight_bytes / tp_vllm,
    }
    # between updates the trainer keeps its weights, and Adam's moments unless train.offload sends them
    # to host memory; the gradients live from the first backward to the step (set to None after it,
    # and the allocator's cached blocks go back before the engine wakes: rollout/vllm.py)
    offloaded = t.offload == "optimizer"
    kept = weights if offloaded else {**weights, **moments}
    resident = sum(kept.values())
    if offloaded:
        mem["host memory: Adam moments offloaded"] = sum(moments.values())
    vllm_w = next(v for k, v in mem.items() if k.startswith("vLLM weights"))
    budget = HEADROOM * gpu_gib * GiB
    ac = "full AC" if t.activation_checkpoint == "full" else "no AC"  # what the trainer will keep
    train_only = mem["gathered bf16 layers"] + acts[f"activations ({ac})"] + logits
    # offloaded, the moments come back for the step, after the backward freed the activations
    in_update = max(train_only, sum(moments.values())) if offloaded else train_only
    training_state = resident + sum(grads.values()) + in_update
    # weight sync (rollout/sync.py): vLLM's weights awake, its KV cache not yet; one bucket of whole
    # layers in the engine's dtype (at most the cap, never more than the model, at least one layer)
    # and the largest parameter gathered in fp32
    full_layer = (P - shape.vocab_size * d * (1 if shape.tie_embeddings else 2)) // L
    largest = max(shape.vocab_size * d, shape.num_experts * d * shape.moe_hidden_dim if shape.is_moe else 0,
                  d * (shape.hidden_dim if not shape.is_moe else 0))
    layer_bytes = full_layer * min(weight_bytes * 2, 4)
    bucket = max(min(r.sync_bucket_mib * 2**20, P * weight_bytes), layer_bytes)
    in_sync = resident + bucket + 4 * largest
    # k ≥ 1 beside the trainer (one process, the engine awake on its GPU): a sync queued behind the
    # engine's batch is a copy of the weights in its dtype, alive until the engine loads it (CUDA
    # IPC, rollout/sync.py `queue`), through the training step and the next sync: up to k of them
    queued = r.max_staleness * P * (4 if r.precision == "fp32" else 2) if r.max_staleness and not split else 0.0
    copies = {"weight copies queued for the engine (k ≥ 1)": queued} if queued else {}
    mem.update(copies)
    training_state, in_sync = training_state + queued, in_sync + queued
    # rollout.sleep_level: at 1 and 2 the engine frees its weights (1: to host memory) and its KV cache
    # while the trainer works; at 0 both stay, and the engine gets what the trainer's larger phase
    # (training, or the sync) leaves (engine_share.py)
    awake = r.sleep_level == 0
    trainer_peak = max(training_state, in_sync) if awake else resident
    working = sizing.working_bytes(shape, sizing.max_num_seqs(rec, engines))
    seqs_engine = math.ceil(sequences / engines)
    job_kv = sizing.kv_cache_bytes(shape, seqs_engine, seq, 2, block=sizing.CUDA_KV_BLOCK, tensor_parallel=tp_vllm)
    if split:  # the engines on GPUs of their own: nothing of them on the trainer's, nothing else on theirs
        del mem[next(k for k in mem if k.startswith("vLLM weights"))]
        mem["weight sync bucket"] = bucket
        engine = on_rollout_gpus(r, vllm_w=vllm_w, working=working, job_kv=job_kv, bucket=bucket, budget=budget,
                                 gpu_gib=gpu_gib, seq=seq, kv_per_token=kv_per_token)
        mem.update({f"rollout GPU: {k}": v for k, v in engine["parts"].items()})
        start_free = budget  # the engine starts alone on its GPU(s)
        phases = {f"training ({ac})": training_state, "weight sync": in_sync,
                  "sampling (rollout GPUs)": sum(engine["parts"].values())}
        parts = {f"training ({ac})": {**state, "gathered bf16 layers": mem["gathered bf16 layers"],
                                      f"activations ({ac})": acts[f"activations ({ac})"], "logits": logits},
                 "weight sync": {**kept, "weight sync bucket": bucket,
                                 "largest parameter gathered in fp32": 4 * largest}}
    else:
        engine = beside_trainer(r, vllm_w=vllm_w, working=working, job_kv=job_kv, gpu_gib=gpu_gib, kept=kept,
                                trainer_peak=trainer_peak, seq=seq, kv_per_token=kv_per_token)
        kv = engine["kv"]
        mem["vLLM working memory (estimate)"] = working
        mem["vLLM KV cache"] = kv
        start_free = engine["start_free"]
        training = training_state + (engine["engine_bytes"] if awake else 0.0)
        if r.sleep_level == 1:
            mem["host memory: vLLM weights asleep"] = vllm_w
        mem["weight sync bucket"] = bucket
        # an engine that never sleeps keeps its KV cache through the sync too
        sync = in_sync + vllm_w + working + (kv if awake else 0.0)
        phases = {f"training ({ac})": training, "weight sync": sync, "rollout": resident + engine["engine_bytes"]}
        # each phase's parts, so a refusal names the largest part of the phase that overflows, and the
        # setting that shrinks it (overflow.py `REMEDY`)
        vllm_parts = {next(k for k in mem if k.startswith("vLLM weights")): vllm_w,
                      "vLLM working memory (estimate)": working}
        awake_kv = {"vLLM KV cache": kv} if awake else {}
        parts = {
            f"training ({ac})": {**state, "gathered bf16 layers": mem["gathered bf16 layers"],
                                 f"activations ({ac})": acts[f"activations ({ac})"], "logits": logits, **copies,
                                 **({**vllm_parts, **awake_kv} if awake else {})},
            "weight sync": {**kept, **vllm_parts, "weight sync bucket": bucket, **copies,
                            "largest parameter gathered in fp32": 4 * largest, **awake_kv},
        }
    # every phase that overflows, at once (a fix for one must not reveal the next only on the next try)
    overflows = [f"{phase.split(' (')[0]} needs {phases[phase] / GiB:.1f} GiB per GPU, over {HEADROOM:.0%} of "
                 f"{gpu_gib:g} GiB; {largest_part(parts[phase], r, offloaded=moments if offloaded else None)}"
                 for phase in (f"training ({ac})", "weight sync") if phases[phase] > budget]
    problems = overflows + engine["problems"] + problems
    # Adam's moments cross the host link twice an update (to the GPU for the step, back after it)
    n_updates = t.minibatches
    offload_s = 2 * n_updates * sum(moments.values()) / HOST_LINK_BYTES_S if offloaded else 0.0
    host = host_memory(rec, shape, device="cuda")
    host_per_node = host["peak"]

    train_flops, rollout_flops = _flops(rec, shape, tokens=tokens, seq=seq)

    return Plan(
        model=model, shape=shape, nodes=p.nodes, gpus_per_node=p.gpus_per_node, gpu_gib=gpu_gib,
        mesh={"world": world, "dp_shard (FSDP2)": dp_shard, "ep": ep, "vLLM tp": tp_vllm, "vLLM engines": engines,
              **({"rollout GPUs": p.nodes * p.rollout_gpus} if split else {})},
        params=P, active=A, adapters=adapters, tokens_per_step=tokens, micro_batch_tokens=micro,
        train_flops_per_step=train_flops, rollout_flops_per_step=rollout_flops,
        memory_gib={k: v / GiB for k, v in mem.items()}, phases_gib={k: v / GiB for k, v in phases.items()},
        in_flight=engine["in_flight"], engine_fraction=engine["fraction"], engine_start_free_gib=start_free / GiB,
        kv_sizing=engine["kv_sizing"], sequences_per_engine=seqs_engine,
        host_gib_per_node=host_per_node / GiB, host_gib={k: v / GiB for k, v in host.items()},
        offload_s_per_step=offload_s, problems=problems, rollout_gpus=p.rollout_gpus, trainer_path=path,
        sleep_level=r.sleep_level, rollout_draws_max=1 + (t.dynamic_sampling_draws if t.dynamic_sampling else 0),
    )


def plan_for(rec, shape: ModelShape, *, model: str, gpu_gib: float, fit: bool, keep=frozenset()) -> Plan:
    """The plan of `rec` on the machine in its [parallel] section; with `fit` (the machine was named:
    --nodes / --gpus-per-node) the recipe's expert and rollout tensor parallelism first lowered to
    what that machine has room for (`fit_mesh`, never the keys in `keep`), as the dry run and its
    launch line do."""
    fitted = fit_mesh(rec, shape, keep) if fit else {}
    return make_plan(with_sets(rec, fitted) if fitted else rec, shape, model=model, gpu_gib=gpu_gib)
