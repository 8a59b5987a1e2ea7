"""Around vLLM's engine steps, on CPU and CUDA alike: which requests the scheduler preempts (their
KV cache dropped when it ran short, then recomputed), how many tokens each request has sampled so
far, and vLLM's request ids. Both read vLLM's engine core in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as vllm.py sets it).
"""

from __future__ import annotations

import contextlib
import re

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
    return {split_request_id(rid): req.num_output_tokens for rid, req in _scheduler(llm_engine).requests.items()}


@contextlib.contextmanager
def preemptions(llm_engine):
    """{(request id, completion index): times preempted} of the requests the scheduler preempts
    while the block runs (read from each step's scheduler output)."""
    scheduler, seen = _scheduler(llm_engine), {}
    schedule = scheduler.schedule

    def watching(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for rid in out.preempted_req_ids or ():
            key = split_request_id(rid)
            seen[key] = seen.get(key, 0) + 1
        return out

    with _replaced(scheduler, "schedule", watching):
        yield seen


def _scheduler(llm_engine):
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
