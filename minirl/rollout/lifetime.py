"""In-process vLLM engines share the process's parallel groups; the last one alive tears them down.

vLLM's in-process engine core (`InprocClient`) shuts down when its client is collected and then
calls `cleanup_dist_env_and_memory`, which destroys the process-global model-parallel groups every
engine of the process computes with: any other engine still alive fails at its next forward
("pipeline model parallel group is not initialized"). minirl builds engines one after another in
one process (the doctor's precisions, a run's engine beside an evaluation's, the test suite's
session engines beside a test's own), so each engine built here counts itself in, and only the
last one alive releases the groups; the others shut down their core alone.

The groups meet through a file in the temporary folder (vLLM's choice), which torch deletes when
they are torn down. A process that ends without the teardown (`process_ends`, proc/quick_exit.py)
deletes it in its exit handlers instead: otherwise every run, evaluation and engine process would
leave one behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref

from minirl.rollout import vllm_internals

_lock = threading.Lock()
_alive = 0  # in-process engines built and not yet shut down
_ending = False  # the process is leaving: nothing after it uses the groups or the memory
_rendezvous: set[str] = set()  # the files the groups of this process's engines met through


def share_process_groups(llm) -> None:
    """Take over the shutdown of `llm`'s in-process engine core (nothing to do for an engine whose
    core runs in processes of its own: those tear down their own groups)."""
    global _alive
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    core = getattr(client, "engine_core", None)
    if finalizer is None or core is None or not finalizer.detach():
        return
    path = vllm_internals.rendezvous_file(llm)
    with _lock:
        _alive += 1
        if path is not None:
            if not _rendezvous:
                atexit.register(_remove_rendezvous_files)
            _rendezvous.add(path)
    client._finalizer = weakref.finalize(client, _shutdown, core)


def _remove_rendezvous_files() -> None:
    for path in _rendezvous:
        with contextlib.suppress(OSError):  # already deleted by torch, at a teardown
            os.remove(path)


def process_ends() -> None:
    """The process exits next (quick_exit): an engine still alive is left as it is. Its core's shutdown
    frees memory for the process to reuse: vLLM's worker unfreezes the heap and collects all of it, and
    the last engine tears down the process's groups. At exit the process's end frees both."""
    global _ending
    _ending = True


def _shutdown(core) -> None:
    global _alive
    with _lock:
        _alive -= 1
        last, ending = _alive == 0, _ending
    if ending:
        return
    if last:
        core.shutdown()
        return
    with vllm_internals.keep_process_groups():
        core.shutdown()
