"""Where each environment lives: one worker for its lifetime, a cap on those alive at once, a time
limit on every call.

An episode's environment is built, reset, stepped and closed by one worker, in order: a thread of
its own with an event loop of its own (`env.isolation = "thread"`), so a sqlite connection, a browser
page or an asyncio client opened in `reset` works in every `step`, and an `async def` method is
awaited there; or a process of its own (`"process"`), which is killed when a call passes its limit
and whose crash is that episode's fault alone. Workers are kept between episodes (a thread or a
process started once serves many), never shared by two environments alive at once, except where the
class asks for one thread (OpenEnv's `REQUIRES_SINGLE_THREAD_EXECUTOR`: every instance on one worker,
its calls one after another).

`Host.open` gives a worker while fewer than the cap are alive (`env.max_concurrency`, 0: no cap; 1
where the class says `SUPPORTS_CONCURRENT_SESSIONS = False`), else None: the episode waits. Every
call is a `Job` timed from its own start, not from its wait behind others; the turn loop gives up
on one past `env.step_timeout_s`: a process worker is killed then, a thread cannot be, so its
environment's `close` runs once the call returns (queued behind it) and `Host.hung` counts the calls
still running. A job's outcome is what the call returned or what it raised (`BaseException`:
`SystemExit` from an environment ends that episode, not the run).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import inspect
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from minirl.envs.adapters import kind_of
from minirl.envs.contract import (NOT_GIVEN, ToolCall, accepted, check_built, check_params, check_reward_function,
                                  environment_class, main_thread_only, reward_function)
from minirl.envs.observations import Reading, reward_of
from minirl.errors import UsageError


class Job:
    """One call on a worker: `fn(session, *args)`; its outcome (`out` or `err`) once `done`."""

    __slots__ = ("fn", "args", "started", "ended", "out", "err", "given_up")

    def __init__(self, fn, args: tuple):
        self.fn, self.args = fn, args
        self.started: float | None = None  # when the worker began it (perf_counter)
        self.ended: float | None = None
        self.out = self.err = None
        self.given_up = False  # past its limit: its episode ended without it

    @property
    def done(self) -> bool:
        return self.ended is not None

    def past(self, limit_s: float, now: float) -> bool:
        return not self.done and self.started is not None and now - self.started > limit_s

    @property
    def seconds(self) -> float:
        return 0.0 if self.started is None else (self.ended or time.perf_counter()) - self.started


class Session:
    """One episode's environment as its worker holds it: the object, how it is spoken to (its kind:
    adapters.py), and the event loop its awaitables run on (made on first need, closed with it)."""

    __slots__ = ("env", "kind", "loop", "scorer", "row")

    def __init__(self):
        self.env = self.kind = self.loop = self.scorer = None
        self.row: dict = {}  # what the episode was reset with: the row's fields for a reward function

    def resolve(self, value):
        """`value`, awaited on the session's own loop where it is awaitable (an `async def` method)."""
        if not inspect.isawaitable(value):
            return value
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(_awaited(value))

    def end(self) -> None:
        if self.loop is not None:
            self.loop.close()
        self.env = self.kind = self.loop = self.scorer = None


async def _awaited(value):
    return await value


# ---- the calls a worker runs (module functions: a process worker runs them by name) ----------------
def start(session: Session, env_ref, params: dict, reset: dict, reward_func: str = "") -> str:
    """A new environment (`env_ref`: its class, or `module:Class`), spoken to as its kind, reset with the
    keyword arguments its `reset` takes of `reset` (seed, episode_id, the row's fields): the text of its
    reset observation ("" where it gives none). A kept one (a reusable kind's: a client's session) is
    reset alone. `reward_func` (env.reward_func): what scores the episode as it ends (`close`)."""
    with _off_the_main_thread():
        if session.env is None:
            ref = environment_class(env_ref) if isinstance(env_ref, str) else env_ref
            if isinstance(ref, type):
                session.kind = kind_of(ref)
                session.env = session.kind.build(ref, params)
            else:  # a factory: what it builds decides the kind
                env = ref(**params)
                check_built(env)
                session.kind, session.env = kind_of(type(env)), env
            session.scorer = reward_function(reward_func) if reward_func else None
        session.row = reset
        return session.kind.reset(session, reset)


def step(session: Session, call: ToolCall, timeout_s: float) -> Reading:
    """One call of the environment, its observation read (observations.py)."""
    with _off_the_main_thread():
        return session.kind.act(session, call, timeout_s)


@contextlib.contextmanager
def _off_the_main_thread():
    """An environment that sets a signal handler (a tool's own timeout by SIGALRM) cannot on a worker
    thread: its episode's fault, saying which isolation runs it on a main thread (a process worker's)."""
    try:
        yield
    except ValueError as err:
        if not main_thread_only(err):
            raise
        raise RuntimeError(f"{err}: the environment sets a signal handler, which Python allows only on a process's "
                           "main thread, and env.isolation = 'thread' runs it on a worker thread: set "
                           "env.isolation = 'process'") from None


def steps(session: Session, calls: Sequence[ToolCall], timeout_s: float) -> list[Reading]:
    """A turn's calls in order, each within `timeout_s`; none after one that ends the episode (done)."""
    out: list[Reading] = []
    for call in calls:
        out.append(step(session, call, timeout_s))
        if out[-1].done:
            break
    return out


def tools(session: Session) -> list[dict]:
    """The tools the environment says it has, as chat templates take them (adapters.py)."""
    return session.kind.tools(session)


def close(session: Session) -> tuple[float | None, bool]:
    """The episode over: the environment's reward for it, where its kind gives one at the end (TRL's
    `get_reward`), and whether the environment is kept for the worker's next episode (a reusable kind's:
    a client's session); else its `close`, where it has one, and its loop closed."""
    if session.env is None:
        session.end()
        return None, False
    kept = session.kind.reusable
    try:
        reward = scored(session) if session.scorer is not None else session.kind.reward(session)
        if not kept:
            session.kind.close(session)
        return reward, kept
    finally:
        if not kept:
            session.end()


def scored(session: Session) -> float | None:
    """The episode's R by env.reward_func, as TRL calls a reward function: `environments=[env]` and the row's
    fields (but its prompt, and minirl's seed and episode id), each a list of one; it returns one value a
    list (None: no reward, the grader scores). An environment with its own `get_reward` beside it is
    refused: TRL would add the two."""
    if callable(getattr(session.env, "get_reward", None)):
        raise TypeError(f"{type(session.env).__name__} has its own get_reward(), and env.reward_func names another "
                        "reward: TRL would add the two; keep one")
    fields = {k: [v] for k, v in session.row.items() if k not in NOT_GIVEN}
    out = session.resolve(session.scorer(**accepted(session.scorer, {**fields, "environments": [session.env]})))
    if not isinstance(out, (list, tuple)) or len(out) != 1:
        raise TypeError(f"env.reward_func returned {out!r} for one environment: a reward function returns a list, "
                        "one value an environment")
    return reward_of(out[0])


def dispose(session: Session) -> None:
    """A kept environment ended (a client's session closed): the run's environments are done with it."""
    try:
        if session.env is not None:
            session.kind.dispose(session)
    finally:
        session.end()


CALLS = {f.__name__: f for f in (start, step, steps, tools, close, dispose)}


# ---- workers ---------------------------------------------------------------------------------------
class ThreadWorker:
    """A thread that runs its jobs one after another (each episode's Session its own)."""

    killable = False

    def __init__(self, host: "Host"):
        self.host, self.jobs = host, queue.SimpleQueue()
        self.kept: list[Session] = []  # environments kept for its next episodes (a reusable kind's)
        self.thread = threading.Thread(target=self._run, daemon=True, name="minirl-env")
        self.thread.start()

    def submit(self, session: Session, fn, *args) -> Job:
        job = Job(fn, args)
        self.jobs.put((session, job))
        return job

    def kill(self) -> bool:
        return False  # a thread cannot be stopped: its call runs on, counted in Host.hung

    def retire(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (item := self.jobs.get()) is not None:
            session, job = item
            job.started = time.perf_counter()
            try:
                job.out = job.fn(session, *job.args)
            except BaseException as err:  # noqa: BLE001 - SystemExit too: the episode's fault, handed to the turn loop
                job.err = err
            self.host.finished(job)


class ProcessWorker:
    """A process of its own that holds one environment at a time: the jobs' calls run there (by name),
    their outcomes come back pickled; `kill` ends it (a call past its limit, or its environment's crash)."""

    killable = True

    def __init__(self, host: "Host"):
        self.host, self.jobs = host, queue.SimpleQueue()
        self.kept: list[Session] = []  # its process keeps the environment itself: a stand-in says that it does
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        # the environment's module importable there as it is here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "minirl.envs.hosting", str(down_r), str(up_w)],
                                     pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL)
        os.close(down_r)
        os.close(up_w)
        self.down, self.up = Connection(down_w, readable=False), Connection(up_r, writable=False)
        self.dead = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="minirl-env-proc")
        self.thread.start()

    def submit(self, session: Session, fn, *args) -> Job:
        job = Job(fn, args)
        self.jobs.put(job)
        return job

    def kill(self) -> bool:
        self.dead = True
        self.proc.kill()
        return True

    def retire(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        try:  # its process's start (an interpreter, minirl's environment rooms) is no call's time
            self.up.recv()
        except (EOFError, OSError):
            self.dead = True
        while (job := self.jobs.get()) is not None:
            job.started = time.perf_counter()
            if self.dead:
                job.err = RuntimeError("its environment's process was killed")
            else:
                try:
                    self.down.send((job.fn.__name__, job.args))
                    ok, value = self.up.recv()
                    if ok:
                        job.out = value
                    else:
                        job.err = value
                except (EOFError, OSError):
                    self.dead = True
                    code = self.proc.wait()
                    job.err = RuntimeError(f"its environment's process ended (exit {code})")
            self.host.finished(job)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.down.close()
            if not self.dead:
                self.proc.wait(timeout=5)


def _serve(down: Connection, up: Connection) -> None:
    """A process worker's side: run each call on its one session, send back its outcome."""
    session = Session()
    up.send((True, "ready"))
    while True:
        try:
            name, args = down.recv()
        except EOFError:
            return
        try:
            out = (True, CALLS[name](session, *args))
        except BaseException as err:  # noqa: BLE001 - handed back, the worker serves on
            out = (False, err)
        try:
            up.send(out)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            up.send((False, RuntimeError(f"{type(out[1]).__name__} could not be sent back from the environment's "
                                         f"process: {err}")))


# ---- the host ---------------------------------------------------------------------------------------
class Host:
    """One recipe's environments in this process: their workers, and the cap on those alive at once.

    isolation:   "thread" or "process"
    max_live:    environments alive at once (0: no cap)
    one_thread:  every environment on one worker (OpenEnv's REQUIRES_SINGLE_THREAD_EXECUTOR)
    """

    def __init__(self, *, isolation: str = "thread", max_live: int = 0, one_thread: bool = False):
        self.isolation, self.max_live = isolation, max_live
        self.cond = threading.Condition()
        self.live = 0
        self.idle: collections.deque = collections.deque()
        self.shared = ThreadWorker(self) if one_thread and isolation == "thread" else None
        self._hung: list[Job] = []
        self.returned = 0  # jobs that have returned so far: a waiter that saw n returns at once when n moved

    def open(self):
        """A worker for a new environment, or None while `max_live` are alive."""
        with self.cond:
            if self.max_live and self.live >= self.max_live:
                return None
            self.live += 1
            if self.shared is not None:
                return self.shared
            worker = self.idle.pop() if self.idle else None
        return worker or (ProcessWorker(self) if self.isolation == "process" else ThreadWorker(self))

    def release(self, worker, *, reuse: bool, kept: Session | None = None) -> None:
        """An environment gone (closed, or given up on): its place free; its worker kept for the next
        where `reuse` (nothing of the last one still running on it), with the environment itself where
        its kind keeps it (`kept`: a client's session, reset by the worker's next episode)."""
        with self.cond:
            self.live -= 1
            if kept is not None:
                worker.kept.append(kept)
            if worker is not self.shared:
                if reuse and not getattr(worker, "dead", False):
                    self.idle.append(worker)
                else:
                    self._end(worker)
            self.cond.notify_all()

    def lower_cap(self) -> None:
        """A server refused one more session with `live` alive (this one among them): the cap is the others."""
        with self.cond:
            self.max_live = max(1, self.live - 1)

    def session(self, worker) -> Session:
        """The session an episode opened on `worker` takes: one its last episode kept, else a new one."""
        with self.cond:
            return worker.kept.pop() if worker.kept else Session()

    def give_up(self, worker, job: Job) -> None:
        """A job past its limit: its process killed, or (a thread) counted while it runs on."""
        job.given_up = True
        if not worker.kill():
            with self.cond:
                self._hung.append(job)

    @property
    def hung(self) -> int:
        """Calls given up on that are still running (threads, which cannot be stopped)."""
        with self.cond:
            self._hung = [j for j in self._hung if not j.done]
            return len(self._hung)

    def finished(self, job: Job) -> None:
        with self.cond:
            job.ended = time.perf_counter()
            self.returned += 1
            self.cond.notify_all()

    def outcome(self, job: Job, limit_s: float) -> bool:
        """Wait for `job`: True once it returned, False once it ran past `limit_s` from its start."""
        while True:
            seen = self.returned
            if job.done:
                return True
            if job.past(limit_s, time.perf_counter()):
                return False
            self.wait(0.05, seen)

    def wait(self, timeout: float, seen: int) -> None:
        """Until a job returns after the `seen`-th (at once where one has already), or `timeout` seconds."""
        with self.cond:
            if self.returned == seen:
                self.cond.wait(timeout)

    def let_go(self) -> None:
        """The environments kept on idle workers disposed of (a client's session closed: a server's
        sessions free for others); the workers stay, for the next environments."""
        with self.cond:
            idle = [*self.idle, *([self.shared] if self.shared is not None else [])]
            kept = [(w, w.kept.pop()) for w in idle for _ in range(len(w.kept))]
        for w, session in kept:
            w.submit(session, dispose)

    def close(self) -> None:
        """Every idle worker ended (a process worker's process with it), the environments kept on them
        disposed of first; the shared worker too: the host is done."""
        with self.cond:
            idle, self.idle = list(self.idle), collections.deque()
            if self.shared is not None:
                idle.append(self.shared)
        for w in idle:
            self._end(w)

    @staticmethod
    def _end(worker) -> None:
        """A worker's kept environments disposed of, then the worker ended once what it runs returns."""
        while worker.kept:
            worker.submit(worker.kept.pop(), dispose)
        worker.retire()


def check_start(settings, row: dict, *, seed: int) -> list[dict]:
    """One episode of a recipe's [env] started as the run starts them (on a worker of its isolation, within
    `step_timeout_s`, reset with a dataset row and a seed by the run's rule), its tools listed, then
    closed: an environment that cannot start one stops the run before any engine starts, in one line.
    Returns the tools (what the model is told: chat templates' `tools=`)."""
    cls = environment_class(settings.name)
    check_params(settings.name, cls, settings.params)
    if settings.reward_func:
        check_reward_function(settings.reward_func, reward_function(settings.reward_func), row)
        if callable(getattr(cls, "get_reward", None)):  # a factory's: at its episodes' end (`scored`)
            raise UsageError(f"env.name = {settings.name!r} has its own get_reward(), and env.reward_func = "
                             f"{settings.reward_func!r} names another reward: TRL would add the two; keep one")
    host = Host(isolation=settings.isolation)
    worker, session = host.open(), Session()
    ref = settings.name if settings.isolation == "process" else cls
    job = worker.submit(session, start, ref, settings.params, {**row, "seed": seed, "episode_id": "preflight"},
                        settings.reward_func)
    try:
        if not host.outcome(job, settings.step_timeout_s):
            host.give_up(worker, job)
            raise UsageError(f"env.name = {settings.name!r} could not start an episode: its constructor and reset() "
                             f"took longer than env.step_timeout_s = {settings.step_timeout_s:g} s")
        if job.err is not None:
            raise UsageError(f"env.name = {settings.name!r} could not start an episode: {type(job.err).__name__}: "
                             f"{job.err}")
        listed = worker.submit(session, tools)
        if not host.outcome(listed, settings.step_timeout_s) or listed.err is not None:
            why = f"{type(listed.err).__name__}: {listed.err}" if listed.done else "it hung"
            raise UsageError(f"env.name = {settings.name!r} could not list its tools: {why}")
        closed = worker.submit(session, close)
        if host.outcome(closed, settings.step_timeout_s) and closed.err is None and closed.out[1]:
            # a kept session (a client's): the run opens its own
            host.outcome(worker.submit(session, dispose), settings.step_timeout_s)
        return listed.out
    finally:
        host.release(worker, reuse=False)
        host.close()


if __name__ == "__main__":  # a process worker: python -m minirl.envs.hosting DOWN_FD UP_FD
    importlib.invalidate_caches()
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
