"""The rollout engine in a process of its own (`rollout.overlap`): the next step's rollout runs
on its cores while the trainer's process trains on this step's batch.

`EngineProcess` has the engine's interface (`generate`, `score`, `load_live_weights`,
`load_weights`, `settle`, `sleep`, `wake`); each call is a message to the engine's process,
answered in order. `submit` sends a call without waiting; later calls return only after it has
(the engine runs one call at a time, in the order sent), so a weight sync sent after a submitted
rollout waits for that rollout and never writes weights it is reading.

Weights pass by reference, and no tensor is sent at a sync: the engine's weights move into
shared memory once (`VLLMEngine.share_weights`). At each sync, once the engine runs no other
call, both processes write them in place, casting and prepacking from the trainer's parameters
(also shared): the engine's process most of the expert layers, while the trainer writes the rest
and ends its step; the next step starts by waiting for it (`settle`), before anything changes the
parameters it reads (cpu_weights.Writer.share). Where an engine's weights cannot be shared,
its process copies them all from the trainer's shared parameters (`Trainer.share_memory`).

Cores are split: the trainer keeps the first half of this process's cores, the engine takes the
rest, each with one intra-op thread per core (two OpenMP pools spinning on the same cores cost
more than either gains).

One process, CPU only: under torchrun every rank would need an engine of its own on cores of
its own, and on CUDA the two processes would share one GPU; neither is built.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the pickling that passes shared tensors by reference

from minirl.errors import UsageError
from minirl.rollout.engine import build


def split_cores(cores: set[int]) -> tuple[list[int], list[int]]:
    """(the trainer's cores, the engine's cores): the first half and the rest, in core order.

    >>> split_cores({0, 1})
    ([0], [1])
    >>> split_cores({4, 5, 6, 7, 8})
    ([4, 5], [6, 7, 8])
    """
    if len(cores) < 2:
        raise UsageError(f"rollout.overlap needs at least 2 cores for a trainer and an engine; this process has "
                         f"{len(cores)}: set rollout.overlap = false")
    ordered = sorted(cores)
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]


def start_overlapped(model_dir: Path, rollout, **kw: Any) -> "EngineProcess":
    """The engine on the second half of this process's cores; this process (the trainer) keeps
    the first half, one intra-op thread each."""
    mine, theirs = split_cores(os.sched_getaffinity(0))
    engine = EngineProcess(model_dir, rollout, cores=theirs, **kw)
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return engine


def _serve(conn, model_dir: str, rollout, kw: dict, cores: list[int]) -> None:
    """The engine's process: build the engine, then answer calls in order until told to stop."""
    os.sched_setaffinity(0, cores)
    try:
        engine = build(Path(model_dir), rollout, **kw)
        conn.send(("ok", {"torch_dtype": engine.torch_dtype, "emulate_fp8": engine.emulate_fp8,
                          "weight_format": engine.weight_format}))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    views = None  # the trainer's shared parameters under HF names, once sent
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:  # the trainer's process is gone
            return
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            if method == "bind_views":
                views, out = args[0], None
            elif method == "sync_views":
                out = engine.load_live_weights(views)
            else:
                out = getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - the parent raises it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class EngineProcess:
    """The recipe's engine (engine.py's `build`) built and run in a child process on `cores`. One intra-op thread per core, set before the child starts (OpenMP reads its
    settings once, when it loads)."""

    def __init__(self, model_dir: Path, rollout, *, cores: list[int], **kw: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        env = {"OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cores)))}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the spawned interpreter inherits the environment as it is at start()
        try:
            self._proc = ctx.Process(target=_serve, args=(child, str(model_dir), rollout, kw, cores), daemon=True,
                                     name="minirl-engine")
            self._proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self._pending: collections.deque[list] = collections.deque()  # answers not yet read, oldest first
        self._views = None  # the trainer's HF-named views last synced from
        self._shared = None  # this process's share of the engine's weights, in shared memory
        info = self._answer()
        self.torch_dtype, self.emulate_fp8 = info["torch_dtype"], info["emulate_fp8"]
        self.weight_format = info["weight_format"]

    # ----- calls --------------------------------------------------------------------------------
    def submit(self, method: str, *args, **kwargs) -> list:
        """Send a call and return at once; `result(handle)` waits for its answer."""
        handle: list = []
        self._conn.send((method, args, kwargs))
        self._pending.append(handle)
        return handle

    def result(self, handle: list):
        """The answer of a submitted call (answers before it are read and kept for their callers)."""
        while not handle:
            self._pending.popleft().append(self._answer())
        return handle[0]

    def call(self, method: str, *args, **kwargs):
        return self.result(self.submit(method, *args, **kwargs))

    def _idle(self) -> None:
        """Wait until every call sent has been answered (answers kept for their callers)."""
        while self._pending:
            self._pending.popleft().append(self._answer())

    def _answer(self):
        try:
            status, out = self._conn.recv()
        except (EOFError, ConnectionError):
            raise RuntimeError(f"the rollout engine's process died (exit code {self._proc.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"in the rollout engine's process: {out}")
        return out

    # ----- the engine's contract (engine.py) ----------------------------------------------------
    FORWARDED = ("generate", "score")  # answered by the engine as they are; the rest are below

    def __getattr__(self, name: str):
        if name in EngineProcess.FORWARDED:
            return lambda *args, **kwargs: self.call(name, *args, **kwargs)
        raise AttributeError(name)

    def sleep(self) -> None:  # CPU engines have no sleep mode
        pass

    def wake(self) -> None:
        pass

    def load_live_weights(self, views: dict) -> bool:
        """Write the trainer's weights into the engine's, which live in shared memory
        (`VLLMEngine.share_weights`), once the engine is idle: this process writes its share and
        returns while the engine's process writes the rest (`settle` waits for it); where the
        engine cannot share its weights, its process copies them all from `views` (shared
        parameters). False when `views` are not shared (the caller then sends the weights:
        `load_weights`). The trainer's parameters must not change until `settle`."""
        if views is not self._views:
            if not all(t.is_shared() for t in views.values()):
                return False
            self._shared = self.call("share_weights", views)  # answered after every call sent before it
            if self._shared is None:
                self.call("bind_views", views)
            self._views = views
        self._idle()  # the engine computes with the tensors written next: no call of its may be running
        if self._shared is None:
            self.submit("sync_views")
            return True
        self.submit("write_own_share")  # under way while this process writes its share and goes on
        self._shared.write(views)
        return True

    def settle(self) -> None:
        """Return once the last sync is written whole (the engine's share finishes after
        `load_live_weights` returns; its next call would wait for it anyway)."""
        self._idle()

    def load_weights(self, hf_named_tensors) -> None:
        self.call("load_weights", list(hf_named_tensors))

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("stop")
            except RuntimeError:
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()
