"""The rollout engine in a process of its own (`rollout.max_staleness` ≥ 1): the batches ahead are
sampled on its cores while the trainer's process trains on this step's batch.

`EngineProcess` has the engine's interface (`generate`, `score`, `settle`, `sleep`, `wake`); each call is
a message to the engine's process (its loop: serve.py), answered in order. `submit` sends one without
waiting: they run one at a time, in order, so a batch sent before a sync is sampled by the weights before.

A sync is queued and returns at once (`queue_weights`): the trainer's process copies its weights into a
snapshot slot in shared memory, and the engine's process loads that slot when it gets to the call,
copying and prepacking from it (bound once per slot: rollout/cpu/weights.py). The trainer's parameters
may change right after; a slot is written again only once the engine has read it. Engines that do not
write their own tensors are streamed the sync's buckets, one at a time as they take them (`stream_weights`).

With `rollout.inflight_updates` the engine keeps stepping across calls (stream.py): the batches of
several steps are sampled together, each `generate` joining those in flight, and a sync is loaded
between two forward steps as soon as it comes.

Cores are split: the trainer keeps the first half of this process's cores (its own again once the engine's
process is closed), the engine the rest, one intra-op thread per core (two OpenMP pools spinning on the
same cores cost more than either gains).

Beside one trainer process (under torchrun every rank would need an engine of its own, not built), on a
GPU the engine's process shares the trainer's GPU, awake, with the plan's share; the weights reach it a
bucket at a time by CUDA IPC (sync.py `queue`); not yet run on a GPU. On rollout GPUs of their own
(remote.py) engine processes, started by each node's first rank, take them by broadcast.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the pickling that passes shared tensors by reference

from minirl.errors import EngineFault, UsageError
from minirl.rollout.coverage import Coverage, expected_weights
from minirl.rollout.serve import WEIGHTS, serve


def split_cores(cores: set[int]) -> tuple[list[int], list[int]]:
    """(the trainer's cores, the engine's cores): the first half and the rest, in core order.

    >>> split_cores({0, 1})
    ([0], [1])
    >>> split_cores({4, 5, 6, 7, 8})
    ([4, 5], [6, 7, 8])
    """
    if len(cores) < 2:
        raise UsageError(f"rollout.max_staleness ≥ 1 needs at least 2 cores for a trainer and an engine; this "
                         f"process has {len(cores)}: set rollout.max_staleness = 0")
    ordered = sorted(cores)
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]


def start_engine_process(model_dir: Path, rollout, **kw: Any) -> "EngineProcess":
    """The engine on the second half of this process's cores; this process (the trainer) keeps
    the first half, one intra-op thread each."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())  # its `close` gives them back (a run in a session)
    mine, theirs = split_cores(before[0])
    engine = EngineProcess(model_dir, rollout, cores=theirs, **kw)
    os.sched_setaffinity(0, mine), torch.set_num_threads(len(mine))
    engine.gives_back = before
    return engine


# what torchrun tells its ranks: an engine's process is none of them (vLLM would take it for one)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


class EngineProcess:
    """The recipe's engine (engine.py's `build`) built and run in a child process on `cores`, one
    intra-op thread per core, set before the child starts (OpenMP reads its settings once, when it
    loads). The child is no rank of a torchrun job: torchrun's variables are not passed on."""

    def __init__(self, model_dir: Path, rollout, *, cores: list[int], gpus: list[str] | None = None, wait: bool = True,
                 **kw: Any):
        """`gpus`: the devices it sees (CUDA_VISIBLE_DEVICES; rollout GPUs of its own, remote.py);
        `wait`: return once it is built (else `ready()` waits, so several build side by side)."""
        ctx = mp.get_context("spawn")
        self.gives_back: tuple[set[int], int] | None = None  # (cores, threads) `close` restores to this process
        self._model_dir = Path(model_dir)
        self._conn, child = ctx.Pipe()
        env = {"OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cores)))}
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        saved = {k: os.environ.get(k) for k in (*env, *TORCHRUN_ENV)}
        os.environ.update(env)  # the spawned interpreter inherits the environment as it is at start()
        for k in TORCHRUN_ENV:
            os.environ.pop(k, None)
        try:
            self._proc = ctx.Process(target=serve, args=(child, str(model_dir), rollout, kw, cores), daemon=True,
                                     name="minirl-engine")
            self._proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        # every answer is read as it comes, by a thread of its own: the engine's process never waits
        # to send one, so a trainer sending many calls ahead (rollout.max_staleness = 1000) cannot meet
        # an engine blocked on a full pipe, each waiting on the other (#75)
        self._answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True, name="minirl-engine-answers")
        self._reader.start()
        self.busy_s = 0.0  # the engine's seconds in calls answered so far (its idle time is the rest)
        # seconds this process spent blocked on the engine, whatever it waited for: a batch's answer,
        # a snapshot slot still being read, a sync to settle before a parity check, a rollback's drain
        # (every wait goes through `_answer`: the trainer's idle time, #74)
        self.waited_s = 0.0
        self._sent = 0  # calls sent; each answer names its call's number
        self._pending: dict[int, list] = {0: []}  # handles of calls not yet answered, by number (0: the build)
        self._built = self._pending[0]
        self._taken: dict[int, int] = {}  # a streamed sync's call → buckets the engine has asked for
        # syncs sent and not yet answered: one that fails is raised by every later answer waited for
        # (a queued sync returns at once; the batch sampled after it must not stand)
        self._syncs: set[int] = set()
        self._broken: tuple[list, str, str] | None = None  # (its handle, status, what it said)
        self._slots: list[dict] = []  # snapshots of the trainer's weights in shared memory (`queue_weights`)
        self._checked: dict | None = None  # the views last checked against what the engine holds
        self._slot_reads: list[list | None] = []  # the sync that last read each slot, until answered
        self._next_slot = 0
        if wait:
            self.ready()

    @functools.cached_property
    def _expected(self) -> dict[str, tuple[int, ...]]:  # what the engine loaded at its start (coverage.py)
        return expected_weights(self._model_dir)

    def ready(self) -> None:
        """Wait until the engine is built (its build's error raised here)."""
        info = self.result(self._built)
        self.torch_dtype, self.emulate_fp8 = info["torch_dtype"], info["emulate_fp8"]
        self.weight_format, self.direct_sync = info["weight_format"], info["direct_sync"]

    # ----- calls --------------------------------------------------------------------------------
    def submit(self, method: str, *args, **kwargs) -> list:
        """Send a call and return at once; `result(handle)` waits for its answer."""
        self._sent += 1
        handle: list = []
        self._send((self._sent, method, args, kwargs))  # never EPIPE up to click, which exits 1 in silence
        self._pending[self._sent] = handle
        if method in WEIGHTS:
            self._syncs.add(self._sent)
        return handle

    def result(self, handle: list):
        """The answer of a submitted call (answers that come before it are kept for their callers);
        an error in the engine's process is raised here, by the call it answers."""
        while not handle:
            self._answer()
        status, out = handle[0]
        if self._broken is not None and self._broken[0] is handle:
            self._broken = None  # raised to the sync's own caller, here
        elif status == "ok" and self._broken is not None:  # a sync queued before failed: nothing after it stands
            status, out = self._broken[1:]
        if status == "fault":
            raise EngineFault(out)
        if status == "error":
            raise RuntimeError(f"in the rollout engine's process: {out}")
        return out

    def call(self, method: str, *args, **kwargs):
        return self.result(self.submit(method, *args, **kwargs))

    def _idle(self) -> None:
        """Wait until every call sent has been answered (answers kept for their callers)."""
        while self._pending:
            self._answer()

    def drain(self, timeout_s: float) -> None:
        """Take the answers that have come (waiting up to `timeout_s` for one), kept for their callers."""
        while self._pending:
            try:
                self._answer(timeout_s)
            except queue.Empty:
                return
            timeout_s = 0.0

    def _read(self) -> None:
        """The reader thread: every answer off the pipe as it comes; None once the process is gone."""
        try:
            while True:
                self._answers.put(self._conn.recv())
        except (EOFError, ConnectionError, OSError):
            self._answers.put(None)

    def _answer(self, timeout_s: float | None = None) -> None:
        """The next answer, kept for its caller (queue.Empty after `timeout_s` without one)."""
        t0 = time.perf_counter()
        try:
            got = self._answers.get(timeout=timeout_s) if timeout_s is not None else self._answers.get()
        finally:
            self.waited_s += time.perf_counter() - t0
        if got is None:
            self._answers.put(None)  # every later wait learns it too
            raise self._died()
        call_id, status, out, seconds = got
        if status == "taken":  # a streamed sync's engine is ready for its next bucket (`stream_weights`)
            self._taken[call_id] = self._taken.get(call_id, 0) + 1
            return
        self.busy_s += seconds
        handle = self._pending.pop(call_id)
        if status in ("fault", "error") and call_id in self._syncs:
            self._broken = (handle, status, out)
        self._syncs.discard(call_id)
        handle.append((status, out))

    def _died(self) -> EngineFault:
        """The engine's process is gone (killed, out of memory, crashed): named, with how it ended."""
        self._proc.join(timeout=5)
        code = self._proc.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and -code in
               signal.valid_signals() else f"exit code {code}")
        return EngineFault(f"the rollout engine's process died ({how}; pid {self._proc.pid})")

    # ----- the engine's contract (engine.py) ----------------------------------------------------
    FORWARDED = ("generate", "score", "set_version")  # answered by the engine as they are; the rest are below

    def __getattr__(self, name: str):
        if name in EngineProcess.FORWARDED:
            return lambda *args, **kwargs: self.call(name, *args, **kwargs)
        raise AttributeError(name)

    def sleep(self) -> None:  # CPU engines have no sleep mode
        pass

    def wake(self) -> None:
        pass

    def queue_weights(self, views: dict[str, torch.Tensor], slots: int, version: int) -> bool:
        """The weights in `views` (the trainer's, HF-named, fp32: policy `version`) copied into one of
        `slots` snapshot slots in shared memory, and the engine told to load that slot after the
        calls sent before (with `rollout.inflight_updates`, between two forward steps of the batch
        under way): this returns at once, and the trainer may change its parameters right after.
        A slot is written again only once the engine has read it (the sync `slots` syncs before;
        waited for here where it has not). False where the engine has no direct path (then the
        caller streams the buckets: `stream_weights`)."""
        if not self.direct_sync or self.emulate_fp8:
            return False
        i = self._next_slot % slots
        self._next_slot += 1
        if views is not self._checked:  # here, before anything is queued (coverage.py); once a dict of views
            Coverage(self._expected).whole(views.items())
            self._checked = views
        if i == len(self._slots):
            self._slots.append({n: torch.empty_like(t, memory_format=torch.contiguous_format).share_memory_()
                                for n, t in views.items()})
            self._slot_reads.append(None)
            self.submit("bind_slot", i, self._slots[i])
        elif self._slot_reads[i] is not None:
            self.result(self._slot_reads[i])  # its last sync: read before it is written again
        with torch.no_grad():
            for n, t in self._slots[i].items():
                t.copy_(views[n])
        self._slot_reads[i] = self.submit("sync_slot", i, version)
        return True

    def stream_weights(self, buckets, *, version: int) -> None:
        """A sync to an engine that does not write its own tensors (CUDA; FP8 emulated on a CPU):
        one call, `load_stream(version)`, behind the calls sent before, whose buckets follow it on
        the pipe one at a time, each sent when the engine has taken the one before (`_taken_buckets`),
        each made only then (`buckets` is lazy). So the weights and their version are one call, the
        engine never steps with part of them, and this process holds one bucket beyond the engine's
        own weights: never a copy of the model. Returns once the engine has loaded them, so the
        trainer waits until the engine has come to the sync (with in-flight updates: the next
        forward step; else after the batches sent before)."""
        handle = self.submit("load_stream", version)
        call_id, buckets, sent = self._sent, iter(buckets), 0
        try:
            while True:
                self._wait_taken(call_id, sent + 1, handle)  # every bucket sent is taken: only now make the next
                bucket = next(buckets, None)
                self._send(bucket)
                if bucket is None:
                    break
                sent += 1
                del bucket
        except BaseException:
            # cut short here (the buckets' maker failed, Ctrl-C) while the engine waits for a bucket: end
            # its sync, which its coverage check then refuses, so that it reads calls again
            if not handle and self._taken.get(call_id, 0) > sent:
                with contextlib.suppress(Exception):
                    self._send(None)
            raise
        finally:
            self._taken.pop(call_id, None)
        self.result(handle)

    def _wait_taken(self, call_id: int, n: int, handle: list) -> None:
        """Until the engine has asked for its n-th bucket (or answered the call: an error, a fault)."""
        while self._taken.get(call_id, 0) < n and not handle:
            self._answer()
        if handle:
            self.result(handle)  # raises what stopped it
            raise RuntimeError("the rollout engine answered a streamed sync before it took every bucket")

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionError, EOFError):
            raise self._died() from None

    def settle(self) -> None:
        """Return once every call sent has been answered (the syncs queued included)."""
        self._idle()

    def cancel(self, handles: list[list]) -> int:
        """Drop these `generate` calls, queued or under way (a rollback): the engine answers them
        "cancelled" and goes on to what was sent after. Returns how many were not yet answered."""
        self.drain(0.0)  # answers already here are no longer to cancel
        ids = [i for i, h in self._pending.items() if not h and any(h is x for x in handles)]
        if ids:
            self.submit("cancel", ids)
        return len(ids)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("stop")
            except (RuntimeError, EngineFault):  # a failed sync is raised by every answer; it stops all the same
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()
        self._reader.join(timeout=5)
        if self.gives_back is not None:
            (cores, threads), self.gives_back = self.gives_back, None
            os.sched_setaffinity(0, cores), torch.set_num_threads(threads)
