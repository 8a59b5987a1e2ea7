"""What one rank of a run holds, by part, in bytes: its training state (`trainer_state`), what its
forward keeps for the backward (`activation_bytes`, on the trainer's path: `trainer_path`) and one
node's host memory (`host_memory`). The plan (plan.py) adds the engine, the phases and the GPU's
budget around them; preflight checks the host's share before a run starts.
"""

from __future__ import annotations

from minirl.config.precisions import PRECISIONS
from minirl.models import sizing
from minirl.models.shapes import ModelShape, lora_param_count, lora_targets, param_count


# what an engine's process holds of its own, beyond its weights and KV cache: the anonymous memory of
# the tiny default's engine process at k = 1 on the 2-core CPU (docs/results/memory.md); the file-backed
# part (libraries) is shared through the page cache
ENGINE_PROCESS_BYTES = 512 * 2**20


def activation_bytes(shape: ModelShape, tokens: int, *, path: str, ac: str) -> dict[str, float]:
    """What the trainer's forward keeps for its backward over `tokens` tokens on `path` ("one
    process": bf16 autocast; "fsdp2": bf16 parameters gathered by FSDP2), by part: "layers" (every
    layer's, or with ac = "full" each layer's input) and "one layer" (a layer in full: the one being
    recomputed under full AC). The coefficients are bytes per token read from the tensors the
    forward saves (torch.autograd.graph.saved_tensors_hooks) on TorchTitan 0.3's Qwen3-MoE layer:
    the fp32 residual stream and norms (8d each), q/k norms kept in fp32, the routed rows once or
    twice in bf16, the expert outputs scaled in fp32 (TorchTitan's combine), the experts' hidden
    activations in bf16; autocast keeps fp32 copies of what FSDP2 holds in bf16. A token of an MoE
    layer: FSDP2 24d + 12(q + kv widths) + 2E + 12kd + 8kf bytes, one process 32d + 12(q + kv) +
    4E + 16kd + 8kf (d the model width, E experts, k of them a token, f their width); a dense layer
    34·d (Korthikanti et al. 2022; not measured here). Under full AC each layer keeps its input
    (3d a token under FSDP2, 5d in one process); either way the final norm's fp32 input (4d)."""
    d, q, kv = shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    one = path == "one process"
    if shape.is_moe:
        k, f, e = shape.top_k, shape.moe_hidden_dim, shape.num_experts
        per_token = (32 if one else 24) * d + 12 * (q + kv) + (4 if one else 2) * e + (16 if one else 12) * k * d \
            + 8 * k * f
    else:
        per_token = 34 * d
    layer = per_token * tokens
    kept = (layer * shape.n_layers if ac != "full" else (5 if one else 3) * d * tokens * shape.n_layers)
    kept += 4 * d * tokens  # the final norm's fp32 input, kept for the head's backward
    return {"layers": float(kept), "one layer": float(layer) if ac == "full" else 0.0}


def trainer_path(rec) -> str:
    """How the trainer computes in bf16: "one process" (one rank: autocast over fp32 weights) or
    "fsdp2" (under torchrun: FSDP2 gathers bf16 parameters); train/trainer.py."""
    return "one process" if rec.parallel.training_gpus == 1 else "fsdp2"


def trainer_state(rec, shape: ModelShape, *, device: str) -> tuple[dict, dict, dict, int]:
    """One rank's training state in three groups, bytes by part: what it keeps (weights), the
    gradients, Adam's moments; and the LoRA adapters' parameter count (0: every weight trains).
    FSDP2 shards all of it over the world; with LoRA the base is frozen in the compute dtype
    ("auto": bfloat16 on a GPU, float32 on a CPU) and the adapters train in fp32."""
    t, world, P = rec.train, rec.parallel.training_gpus, param_count(shape)
    if not t.lora.rank:
        return ({"fp32 weights (sharded)": 4 * P / world}, {"fp32 gradients (sharded)": 4 * P / world},
                {"Adam moments (sharded)": 8 * P / world}, 0)
    adapters = lora_param_count(shape, t.lora.rank, lora_targets(t.lora.targets, shape))
    base_bytes = 4 if t.param_dtype == "float32" or (t.param_dtype == "auto" and device == "cpu") else 2
    return ({f"base weights ({'fp32' if base_bytes == 4 else 'bf16'}, frozen, sharded)": base_bytes * P / world,
             "fp32 LoRA adapters (sharded)": 4 * adapters / world},
            {"fp32 LoRA gradients (sharded)": 4 * adapters / world},
            {"Adam moments of the adapters (sharded)": 8 * adapters / world}, adapters)


def host_memory(rec, shape: ModelShape, *, device: str, checkpoint_bytes: float | None = None) -> dict[str, float]:
    """What one node's host memory holds for the job on `device` ("cuda", or "cpu": the trainer and
    the engine in host memory), by part, and its peak, in bytes; the layout is the recipe's
    [parallel] section. Two moments: the start, when the trainer reads its checkpoint (rank 0 alone
    reads it whole when sharded over several ranks: train.Trainer.load_hf; TorchTitan's layout
    stacks an MoE's experts while the file's are still held, so they count twice), and between
    updates (offloaded moments, engines asleep at level 1; on a CPU the trainer's state and the
    engines). `checkpoint_bytes`: the safetensors' size, else the bf16 files Qwen3 releases are."""
    p, t, r = rec.parallel, rec.train, rec.rollout
    world, ranks = p.training_gpus, p.gpus_per_node - p.rollout_gpus
    P = param_count(shape)
    file_bytes = 2 * P if checkpoint_bytes is None else checkpoint_bytes
    experts = shape.n_layers * shape.num_experts * 3 * shape.dim * shape.moe_hidden_dim if shape.is_moe else 0
    read = file_bytes * (1 + experts / P)
    w, g, m, _ = trainer_state(rec, shape, device=device)
    weights, moments = sum(w.values()), sum(m.values())
    rest = sum(g.values()) + moments
    parts = {}
    if device == "cpu":  # every rank's trainer, and its engine (TP 1 on a CPU), in host memory
        # a TP the job cannot hold is check_layout's to refuse; rollout "GPUs" on a CPU: engine processes
        engines = max(1, (p.nodes * p.rollout_gpus or world) // r.tensor_parallel)  # the job's
        seqs = sizing.max_num_seqs(rec, engines)
        wbytes = 4 if r.precision == "fp32" else 2  # the CPU engine serves FP8 as rounded bf16
        parts["trainer (weights, gradients, Adam)"] = ranks * (weights + rest)
        parts["vLLM engines (weights, KV cache)"] = (p.rollout_gpus or ranks) * (
            wbytes * P / r.tensor_parallel + sizing.cpu_kv_cache_bytes(shape, seqs, sizing.max_model_len(rec), wbytes))
        # an engine in a process of its own (k ≥ 1, or each rollout "GPU") carries its own Python, torch and
        # vLLM besides its weights and KV cache (#75: counted at about 33 MB, measured at 780 MB resident)
        processes = p.rollout_gpus if p.rollout_gpus else (ranks if r.max_staleness else 0)
        parts["engine processes' own memory (measured)"] = processes * ENGINE_PROCESS_BYTES
        if p.rollout_gpus:  # the fp32 weights as one broadcast buffer, the sender's and each engine's (rollout/broadcast.py)
            parts["weight broadcast buffers"] = (1 + p.rollout_gpus) * 4 * P  # this node's
        else:  # k ≥ 1: the engine's process reads a sync from one of k fp32 snapshots in shared memory (`queue_weights`)
            parts["weight snapshots for the engine's process (k ≥ 1)"] = min(r.max_staleness, t.steps) * 4 * P
    else:
        parts["Adam moments offloaded"] = ranks * moments if t.offload == "optimizer" else 0.0
        parts["vLLM weights asleep"] = ranks * P * PRECISIONS[r.precision].weight_bytes / r.tensor_parallel \
            if r.sleep_level == 1 else 0.0
    start = read + (ranks * weights if device == "cpu" else 0.0)
    parts = {k: v for k, v in parts.items() if v}
    between = sum(parts.values())
    return {"checkpoint read at start (rank 0)": read, **parts, "peak": max(start, between)}
