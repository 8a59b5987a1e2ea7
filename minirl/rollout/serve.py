"""The engine's process (rollout/process.py starts it): the engine built, then calls answered until the
trainer's process says stop, each answer naming its call.

Calls run one at a time, in the order sent, but for a rollback's cancel (at once) and, with
`rollout.inflight_updates`, weights and batches (loaded and joined between two forward steps: stream.py). A
streamed sync's buckets come on the pipe inside the call that loads them (`_taken_buckets`).
"""

from __future__ import annotations

import collections
import os
import signal
import time
import traceback
from pathlib import Path

import torch

from minirl.errors import EngineFault
from minirl.proc.collector import collect_as_usual, collect_less_often
from minirl.proc.quick_exit import quick_exit
from minirl.rollout.broadcast import WeightChannel
from minirl.rollout.engine import build

# calls that bring weights and their version: loaded as they come, between two forward steps (sync.py `queue`)
WEIGHTS = ("bind_slot", "sync_slot", "load_stream", "set_version", "receive_weights")


def serve(conn, model_dir: str, rollout, kw: dict, cores: list[int]) -> None:
    """The engine's process: build the engine, then answer calls until told to stop, each answer naming
    its call. Calls run one at a time, in order, but for the weights, loaded as they come. With
    `rollout.inflight_updates` the engine keeps stepping across calls (stream.py): a `generate` joins
    the requests in flight, a sync is loaded between two forward steps, other calls wait for none."""
    # Ctrl-C and a closed terminal's SIGHUP go to the whole process group: the trainer's process stops
    # after its step and then stops this one; a KeyboardInterrupt here would only print a traceback (#75)
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    collect_less_often()  # before vLLM's import (minirl/proc/collector.py)
    os.sched_setaffinity(0, cores)
    # rollout GPUs (remote.py): which engine this is, and where it joins the weights' broadcast
    stream_no, joins = kw.pop("stream", 0), kw.pop("channel", None)
    try:
        engine = build(Path(model_dir), rollout, **kw)
        collect_as_usual()
        engine.stream = stream_no  # its own stream of call seeds, apart from the other engines'
        conn.send((0, "ok", {"torch_dtype": engine.torch_dtype, "emulate_fp8": engine.emulate_fp8,
                             "weight_format": engine.weight_format,
                             "direct_sync": getattr(engine, "direct_sync", False)}, 0.0))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        conn.send((0, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 0.0))
        return
    _Server(conn, engine, rollout, joins).loop()


class _Server:
    """The engine process's loop after the build: every `generate` steps here, between which calls are read,
    so a rollback's cancel aborts a batch under way. With rollout.inflight_updates calls join the requests in
    flight and syncs load between two forward steps; without, one call runs at a time, in the order sent."""

    def __init__(self, conn, engine, rollout, joins) -> None:
        from minirl.rollout.stream import Stream  # deferred: it imports vLLM's CPU captures
        from minirl.rollout.vllm import MAX_REDRAWS

        self.conn, self.engine, self.joins = conn, engine, joins
        self.inflight = rollout.inflight_updates
        self.stream = Stream(engine, max_redraws=MAX_REDRAWS, overlap_envs=self.inflight)
        self.channel = None  # the broadcast of the trainer's weights (rollout GPUs), joined at its first receive
        self.slots: dict[int, dict] = {}  # snapshot slots of the trainer's weights (`queue_weights`), once sent each
        self.deferred: collections.deque = collections.deque()  # calls that wait for the requests in flight
        self.hold_after: int | None = None  # a test's pause: wait for the next call after this many forward steps
        self.stepped, self.stepping = 0, 0.0  # forward steps since the stream began; seconds since its last answer

    def run(self, call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        conn, engine = self.conn, self.engine
        t0 = time.perf_counter()
        try:
            if method == "bind_slot":
                self.slots[args[0]], out = args[1], None
            elif method == "sync_slot":  # (slot, the policy version it holds)
                out = engine.load_live_weights(self.slots[args[0]], key=args[0], version=args[1])
            elif method == "load_stream":  # (the policy version): its buckets follow on the pipe, one at a time
                out = engine.load_weights(_taken_buckets(conn, call_id, self.deferred.appendleft), version=args[0])
            elif method == "receive_weights":  # (the policy version, one flat buffer or buckets): remote.py
                if self.channel is None:
                    host, port, rank, size, backend = self.joins
                    self.channel = WeightChannel.join(host, port, rank, size, backend,  # its first GPU: the buffers'
                                                      device="cuda:0" if torch.cuda.is_available() else "cpu")
                if args[1]:
                    out = engine.load_live_weights(self.channel.receive(), key=-1, version=args[0])
                else:
                    out = engine.load_weights((x for bucket in self.channel.receive_buckets() for x in bucket),
                                              version=args[0])
            elif method == "hold_after":
                self.hold_after, out = args[0], None
            elif method == "generate":
                self.stream.add(call_id, *args, **kwargs)  # answered when its requests have finished
                return
            else:
                out = getattr(engine, method)(*args, **kwargs)
            conn.send((call_id, "ok", out, time.perf_counter() - t0))
        except EngineFault as e:  # a named stop (coverage.py): the parent raises it as such, in one line
            conn.send((call_id, "fault", str(e), 0.0))
        except Exception as e:  # noqa: BLE001 - the parent raises it
            conn.send((call_id, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 0.0))

    def arrived(self, message) -> None:
        """A call read while requests are in flight, or before the next call runs: a cancel at once;
        with in-flight updates weights now and a generate now unless calls wait before it; anything
        else after them, in order."""
        method = message[1]
        if method == "cancel":
            self.cancel(message[0], set(message[2][0]))
        elif method == "hold_after" or (self.inflight and (method in WEIGHTS or
                                                           (method == "generate" and not self.deferred))):
            self.run(*message)
        else:
            self.deferred.append(message)

    def cancel(self, call_id: int, tags: set[int]) -> None:
        """A rollback's: the `generate` calls `tags`, queued or under way, answered "cancelled" and
        never sampled further, so the restored weights' batch comes next (#74)."""
        kept = [m for m in self.deferred if not (m[1] == "generate" and m[0] in tags)]
        dropped = [m[0] for m in self.deferred if m[1] == "generate" and m[0] in tags]
        self.deferred.clear()
        self.deferred.extend(kept)
        for tag in dropped + self.stream.cancel(tags):
            self.conn.send((tag, "cancelled", None, 0.0))
        self.conn.send((call_id, "ok", None, 0.0))

    def step(self) -> None:
        """Between two forward steps: the calls that came in read (a test's pause: none before it, then one),
        then one forward step of the requests in flight, the batches it finished answered."""
        conn = self.conn
        if self.hold_after is None:
            while conn.poll():
                self.arrived(conn.recv())
        elif self.stepped >= self.hold_after:
            self.hold_after = None
            self.arrived(conn.recv())
        t0 = time.perf_counter()
        try:
            done = self.stream.step()
        except Exception as e:  # noqa: BLE001 - every call in flight gets it
            for tag in self.stream.fail():
                conn.send((tag, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 0.0))
            return
        self.stepped, self.stepping = self.stepped + 1, self.stepping + time.perf_counter() - t0
        for tag, groups in done:
            conn.send((tag, "ok", groups, self.stepping))
            self.stepping = 0.0

    def loop(self) -> None:
        """Until `stop`, or the trainer's process is gone (its end of the pipe closed)."""
        conn = self.conn
        while True:
            try:
                if self.stream.busy:
                    self.step()
                    continue
                self.stepped = 0
                while conn.poll() and not self.stream.busy:  # what came before the next call runs: a cancel among it
                    self.arrived(conn.recv())
                if self.stream.busy:  # a generate that came in started (in-flight updates)
                    continue
                if not self.deferred:
                    self.arrived(conn.recv())
                    continue
                call_id, method, args, kwargs = self.deferred.popleft()
            except EOFError:  # the trainer's process is gone
                return
            if method == "stop":
                conn.send((call_id, "ok", None, 0.0))
                quick_exit(0)  # the trainer joins this process: its engine left to the process's end
            self.run(call_id, method, args, kwargs)


def _taken_buckets(conn, call_id: int, put_back):
    """The buckets of a streamed sync (`EngineProcess.stream_weights`), read off the pipe inside the
    call that loads them: before each, the engine says it has taken the last ("taken"), and the
    trainer sends the next; None ends the sync. The engine does not step in between, and neither
    process holds more than the bucket being loaded. A call instead of a bucket (a trainer that gave
    the sync up: a second Ctrl-C, then `stop`) ends the sync too, and is kept for its turn."""
    while True:
        conn.send((call_id, "taken", None, 0.0))
        bucket = conn.recv()
        if bucket is None or isinstance(bucket, tuple):
            if bucket is not None:
                put_back(bucket)
            return
        yield from bucket
        del bucket
