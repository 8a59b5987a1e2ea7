"""Multi-turn episodes, token in, token out: a batch's episodes as the turn loop drives them (`Turns`;
the synchronous loop is turn_loop.py, an engine's stream is stream.py).

An episode is the task's prompt, then turns: the engine samples until a stop (the tool call's
closing token, EOS, or the episode's token budget), the calls are read from that turn's sampled ids
alone (one a turn, stopped at its close; or, with `env.max_calls` > 1, every call of a turn that ran to
its end, up to the cap, a call inside the model's reasoning never run), the environment answers, and
only its replies are tokenized and appended, together as the chat template renders them; the
episode's ids so far are the next turn's prompt. Sampled ids are kept verbatim (the closing token included) and never
decoded back into the trained sequence, so nothing is re-rendered and the ids trained are the ids
sampled, with the environment's between them. One flat record per episode:

    ids       everything after the prompt: sampled and environment tokens, in order
    mask      1 sampled (log μ, version, route kept from the forward that sampled it), 0 environment
    routes    R3: one row per position fed through the engine. A sampled token keeps the row recorded
              when it was sampled; the environment's tokens and the last sampled token of each turn
              (never fed while its turn ran) take the rows of the next turn's prefill. The prefill
              recomputes the earlier positions' rows too: they are compared with the kept ones (a
              sync between two turns may move them: `prefix_rerouted`), and the kept ones train (the
              routes the tokens were sampled under, as their log μ is).

Each episode's environment lives on one worker of the recipe's `Host` (minirl/envs/hosting.py) for its
lifetime: built and reset there before its first turn is asked (an episode waits while
`env.max_concurrency` environments are alive), stepped there, closed there as the episode ends. Every
call is a job the loop polls: at k = 0 the loop waits for a round's calls before its next `generate`;
an engine's stream (stream.py) asks each episode's next turn as soon as its call returned, and the
engine steps meanwhile.

An episode ends on an answer (a turn without a call), the environment's `done`, `env.max_turns` or the
token budget at a call (a truncation: `finish` "length"), the context (no room for a reply), or the
environment's fault: raised (anything, `SystemExit` too), hung past `step_timeout_s`, an observation it
could not read, a non-finite reward, a start that failed. A faulted episode is counted and named in its
`EpisodeInfo` and trains on nothing (minirl/envs/outcome.py); past `env.max_error_frac` of a step's
episodes the run stops (run/checks.py). A reply longer than `env.max_reply_tokens` is cut, never a fault.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minirl.envs import hosting
from minirl.envs.contract import Message
from minirl.envs.formats import CallError, Replies, ToolFormat
from minirl.errors import EngineFault
from minirl.rollout.engine import Completion, EpisodeInfo

WAIT_S = 0.05  # longest wait for an environment's call before the loop looks again (deadlines, a stream's engine)
RETRY_S = 0.2  # before a start a server refused (at capacity, none of this host's sessions open) is asked again


@dataclass
class _Episode:
    i: int
    j: int
    prompt: list[int]
    start: tuple  # (environment class or module:Class, its params, reset's keyword arguments)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # the sampler's kept counts (0: nothing cut; replies 0)
    routes: list = field(default_factory=list)  # R3: row blocks, concatenated at the end
    routed: int = 0  # positions the blocks cover
    info: dict = field(default_factory=lambda: dict(turns=0, tool_calls=0, tool_errors=0, env_errors=0, env_s=0.0,
                                                    env_tokens=0, reward=None, ended="", fault="", replies_cut=0,
                                                    step_rewards=[], prefix_compared=0, prefix_rerouted=0,
                                                    hung_running=0))
    finish: str = "stop"
    preempted: int = 0
    regenerated: int = 0
    # where it stands: "waiting" (for a worker), "starting", "ready" (a turn to ask), "sampling",
    # "stepping", "closing", "done"
    phase: str = "waiting"
    worker: object = None
    session: hosting.Session | None = None
    job: hosting.Job | None = None
    first_start: float | None = None  # when its environment was first asked to start (a refused start retries)
    retry_at: float = 0.0  # not before then (a server at capacity with none of this host's sessions open)
    turn_from: int = 0  # where in `ids` the turn being sampled began (after the last reply)
    goes_on: bool = False  # its next sample continues the same turn (a call inside its reasoning, not run)
    answers: list = field(default_factory=list)  # the turn's calls being run: a ToolCall, or the error text answered
    as_user: bool = False  # ... or the turn itself, said to the environment, which answers as the user
    limit_s: float = 0.0  # the job in flight's limit

    @property
    def sampled(self) -> int:
        return sum(self.mask)

    def take(self, c: Completion) -> None:
        """A turn's sample, verbatim; with R3 the rows of positions no earlier turn covered, and the
        earlier positions' recomputed rows compared with those kept."""
        start = len(self.prompt) + len(self.ids)  # what this turn's prompt was
        self.ids += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logps += c.logprobs
        self.versions += c.versions if c.versions is not None else [None] * len(c.token_ids)
        self.kept += c.kept if c.kept is not None else [0] * len(c.token_ids)
        if c.routes is not None:
            if len(c.routes) != start + len(c.token_ids) - 1 or len(c.routes) < self.routed:  # never misaligned
                raise EngineFault(f"an episode's turn came back with routes for {len(c.routes)} positions, its "
                                  f"tokens {start + len(c.token_ids) - 1}: R3 cannot replay routes that do not line "
                                  "up with the episode (train.replay = \"r2\" or \"off\" trains without them)")
            if self.routed:
                kept = np.concatenate(self.routes)
                again = np.asarray(c.routes[: self.routed])
                moved = (np.sort(kept, axis=-1) != np.sort(again, axis=-1)).reshape(self.routed, -1).any(axis=1)
                self.info["prefix_compared"] += self.routed
                self.info["prefix_rerouted"] += int(moved.sum())
            self.routes.append(c.routes[self.routed:])
            self.routed = len(c.routes)
        self.finish = c.finish
        self.preempted += c.preempted
        self.regenerated += c.regenerated
        self.info["turns"] += int(not self.goes_on)
        self.goes_on = False

    def hear(self, ids: Sequence[int]) -> None:
        """The environment's reply: loss mask 0, no μ, the version of the turn before."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logps += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else None] * len(ids)
        self.kept += [0] * len(ids)
        self.info["env_tokens"] += len(ids)
        self.turn_from = len(self.ids)

    def fault(self, why: str) -> None:
        """The environment's fault, the episode's first (counted once)."""
        if not self.info["fault"]:
            self.info["env_errors"] += 1
            self.info["fault"] = why

    def completion(self) -> Completion:
        routes = None
        if self.routes:
            routes = np.concatenate(self.routes)
            if len(routes) != len(self.prompt) + len(self.ids) - 1:  # never misaligned: asserted
                raise EngineFault(f"an episode's routes cover {len(routes)} positions of "
                                  f"{len(self.prompt) + len(self.ids) - 1}: R3 cannot replay routes that do not "
                                  "line up with the episode (train.replay = \"r2\" or \"off\" trains without them)")
        versions = tuple(self.versions) if self.versions and None not in self.versions else None
        info = {**self.info, "step_rewards": tuple(self.info["step_rewards"])}
        return Completion(tuple(self.ids), tuple(self.logps), self.finish, routes, versions, self.preempted,
                          self.regenerated, mask=tuple(self.mask), episode=EpisodeInfo(**info),
                          kept=tuple(self.kept) if any(self.kept) else None)


class Turns:
    """A batch's episodes, n of each prompt, as the turn loop drives them.

    `begin` starts the environments (as many as the host's cap allows); `took` takes the turns that
    just ended (what episode j of prompt i sampled) and sends the calls to the environments; `poll`
    collects what the environments answered (starts, replies, closes), gives up on calls past their
    limit, starts waiting episodes, and returns what each episode ready for a turn asks next: (i, j,
    (its ids so far, what it may still sample)), in (i, j) order. `settle` is `poll` once nothing is
    in flight (the synchronous loop's); `finished` once every episode ended and its environment closed."""

    def __init__(self, prompts: Sequence[Sequence[int]], starts: Sequence[Sequence[tuple]], *, host: hosting.Host,
                 fmt: ToolFormat, encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str], n: int,
                 max_tokens: int, max_turns: int, max_model_len: int, step_timeout_s: float = 30.0,
                 max_reply_tokens: int | None = None, encode_text: Callable[[str], list[int]] | None = None,
                 prompt_for: Callable[[int, str], list[int]] | None = None, max_calls: int = 1,
                 user_turns: bool = False):
        # a turn of one call stops on its close; a format's turn of several calls runs to its end (EOS)
        self.stop = [] if fmt.at_end else encode(fmt.close)
        if not fmt.at_end and len(self.stop) != 1:
            raise ValueError(f"a tool call's closing text {fmt.close!r} is {len(self.stop)} tokens: the engine stops "
                             "a turn on one token of the vocabulary")
        self.max_calls = max_calls if fmt.at_end else 1
        self.user_turns = user_turns  # the environment answers a turn without a call as the user
        self.episodes = [[_Episode(i, j, list(p), starts[i][j]) for j in range(n)] for i, p in enumerate(prompts)]
        self.host, self.fmt, self.decode = host, fmt, decode
        self.replies = Replies(fmt, encode, encode_text or encode)
        self.max_tokens, self.max_turns, self.max_model_len = max_tokens, max_turns, max_model_len
        self.step_timeout_s, self.max_reply_tokens = step_timeout_s, max_reply_tokens
        # prompt i rendered again with an episode's reset observation (None: the observation is not shown)
        self.prompt_for = prompt_for
        self._busy: dict[tuple[int, int], _Episode] = {}  # episodes with a job in flight
        self._seen = 0  # the host's returned jobs when this batch last looked
        self._waiting = collections.deque(e for group in self.episodes for e in group)  # for a worker

    @property
    def all(self):
        return (e for group in self.episodes for e in group)

    # ----- the loop's side ----------------------------------------------------------------------------
    def begin(self) -> None:
        """The environments started, as many as the host lets live at once (the rest as places free)."""
        self._fill()

    def took(self, done: Sequence[tuple[int, int, Completion]]) -> None:
        """The turns that just ended, (i, j, what episode j of prompt i sampled): the calls they end
        with sent to their environments (each on its own worker: a batch's calls run together)."""
        for i, j, c in done:
            e = self.episodes[i][j]
            e.take(c)
            if e.info["fault"]:  # its environment could not start: what it sampled is no sample of the task
                self._end(e, "env_error")
                continue
            calls = None if c.finish == "length" else self._calls(e, c)
            if calls is None and self.user_turns and c.finish != "length" and c.token_ids:
                calls = [Message(self.fmt.outside_reasoning(self.decode(e.ids[e.turn_from:-1])).strip())]
            if calls is None:
                self._end(e, "length" if c.finish == "length" else "answer")
            elif calls and e.info["turns"] >= self.max_turns:  # calls left unanswered: cut short, as at the budget
                self._end(e, "max_turns", cut=True)
            elif e.sampled >= self.max_tokens:  # no token left to answer a reply with: none is asked for
                self._end(e, "length", cut=True)
            elif not calls:  # a call inside its reasoning: the model thinking about a call, the turn goes on
                e.goes_on, e.phase = True, "ready"
            else:
                e.as_user = isinstance(calls[0], Message)  # the environment's words as the user, not a tool's
                if not e.as_user:
                    e.info["tool_calls"] += len(calls)
                    e.info["tool_errors"] += sum(isinstance(x, str) for x in calls)
                e.answers = calls
                run = [x for x in calls if not isinstance(x, str)]
                if run:
                    self._submit(e, "stepping", hosting.steps, run, self.step_timeout_s, limit_s=self.step_timeout_s
                                 * len(run))
                else:
                    self._reply(e, calls)

    def _calls(self, e: _Episode, c: Completion) -> list | None:
        """The calls a turn that just ended makes, each a ToolCall to run or the error text it is answered
        with (a call that cannot be read, one past `max_calls`: the model's mistakes); None: the turn is its
        answer; []: it stopped on a call inside its reasoning, which is not run."""
        if self.fmt.at_end:
            if not c.token_ids:
                return None
            found = self.fmt.calls(self.decode(e.ids[e.turn_from:]))
            if not found:
                return None
        else:
            if not c.token_ids or c.token_ids[-1] != self.stop[0]:
                return None
            text = self.decode(e.ids[e.turn_from:])
            if self.fmt.reasoning_open(text):
                return []
            try:
                found = [self.fmt.call(text) or CallError(f"no call before {self.fmt.close!r}")]
            except CallError as err:  # closed a call it never opened: read as a malformed call
                found = [err]
        return [self.fmt.unreadable.replace("{}", str(x)) if isinstance(x, CallError) else
                self.fmt.unreadable.replace("{}", f"at most {self.max_calls} calls a turn, this one not run")
                if k >= self.max_calls else x for k, x in enumerate(found)]

    def poll(self) -> list[tuple[int, int, tuple[list[int], int]]]:
        """What the environments answered, settled; the turns now ready, asked (i, j order)."""
        self._seen, now = self.host.returned, time.perf_counter()
        for key, e in list(self._busy.items()):
            job = e.job
            if job.done:
                del self._busy[key]
                self._answered(e, job)
            elif job.past(e.limit_s, now) or (job.started is None and self._stuck(e.worker)):
                del self._busy[key]
                self._hung(e, job)
        self._fill()
        ready = sorted((e for e in self.all if e.phase == "ready"), key=lambda e: (e.i, e.j))
        for e in ready:
            e.phase = "sampling"
        return [(e.i, e.j, (e.prompt + e.ids, budget(e, self.max_tokens, self.max_model_len))) for e in ready]

    def settle(self) -> list[tuple[int, int, tuple[list[int], int]]]:
        """`poll` once no environment's call is in flight (each within its limit): the synchronous loop's."""
        asks = self.poll()
        while self._busy:
            self.wait()
            asks += self.poll()
        return sorted(asks, key=lambda a: (a[0], a[1]))

    def wait(self) -> None:
        """Until an environment's call returns, or the nearest limit, or WAIT_S."""
        left = min((e.job.started + e.limit_s - time.perf_counter() for e in self._busy.values()
                    if e.job.started is not None), default=WAIT_S)
        self.host.wait(min(WAIT_S, max(0.0, left) + 1e-3), self._seen)

    @property
    def in_flight(self) -> bool:
        return bool(self._busy)

    @property
    def finished(self) -> bool:
        return all(e.phase == "done" for e in self.all)

    def completions(self) -> list[list[Completion]]:
        hung = self.host.hung  # calls given up on and still running, as the batch ends
        for e in self.all:
            e.info["hung_running"] = hung
        return [[e.completion() for e in group] for group in self.episodes]

    def close(self) -> None:
        """Episodes cut short (an error, a rollback's cancel): their calls given up, their environments
        closed once those return; their places freed now (nothing waits for them)."""
        for e in self.all:
            if e.phase == "done":
                continue
            self._busy.pop((e.i, e.j), None)
            if e.worker is not None:
                if e.job is not None and not e.job.done:
                    self.host.give_up(e.worker, e.job)
                if e.phase != "closing":
                    e.worker.submit(e.session, hosting.close)
                self.host.release(e.worker, reuse=False)
            e.phase = "done"

    # ----- the environments' side ---------------------------------------------------------------------
    def _fill(self) -> None:
        """Waiting episodes given a worker while the host has room, and their environments started."""
        while self._waiting and self._waiting[0].retry_at <= time.perf_counter():
            worker = self.host.open()
            if worker is None:
                return
            e = self._waiting.popleft()
            e.worker, e.session = worker, self.host.session(worker)
            e.first_start = e.first_start or time.perf_counter()
            self._submit(e, "starting", hosting.start, *e.start)

    def _submit(self, e: _Episode, phase: str, fn, *args, limit_s: float | None = None) -> None:
        e.phase, e.job = phase, e.worker.submit(e.session, fn, *args)
        e.limit_s = self.step_timeout_s if limit_s is None else limit_s
        self._busy[(e.i, e.j)] = e

    def _answered(self, e: _Episode, job: hosting.Job) -> None:
        """A job of the episode's environment that returned."""
        e.info["env_s"] += job.seconds
        if e.phase == "starting":
            if job.err is not None and at_capacity(job.err) and (
                    self.host.live > 1 or time.perf_counter() - e.first_start < self.step_timeout_s):
                # a server with fewer sessions than environments alive: it says how many it takes, and the
                # episode waits for one of theirs; with none of this host's open (another process holds
                # them), it asks again a moment later, up to step_timeout_s, then it is a fault
                if self.host.live > 1:
                    self.host.lower_cap()
                else:
                    e.retry_at = time.perf_counter() + RETRY_S
                self.host.release(e.worker, reuse=True)
                e.worker = e.session = e.job = None
                e.phase = "waiting"
                self._waiting.appendleft(e)
                return
            if job.err is not None:
                e.fault(f"could not start an episode: {_named(job.err)}")
            elif job.out and self.prompt_for is not None:  # its reset observation, after the prompt's problem
                try:
                    e.prompt = list(self.prompt_for(e.i, job.out))
                except Exception as err:  # noqa: BLE001 - text no tokenizer or template takes: the environment's
                    e.fault(f"its reset observation could not be rendered: {_named(err)}")
            e.phase = "ready"  # its first turn (one that could not start ends there: its tokens keep the batch's shape)
        elif e.phase == "stepping":
            if job.err is not None:
                e.fault(f"step raised {_named(job.err)}")
                self._end(e, "env_error")
            else:
                self._respond(e, job.out)
        elif e.phase == "closing":
            if job.err is not None:
                e.fault(f"close raised {_named(job.err)}")
            reward, keeps = job.out if job.err is None else (None, False)
            if reward is not None and e.info["ended"] != "env_error":  # the reward it gives at the end (TRL's)
                e.info["reward"] = reward
                e.info["step_rewards"].append(reward)
            if keeps and e.info["fault"]:  # what faulted may be broken: never another episode's, closed now
                e.worker.submit(e.session, hosting.dispose)
                keeps = False
            self.host.release(e.worker, reuse=True, kept=e.session if keeps else None)
            e.phase = "done"

    def _hung(self, e: _Episode, job: hosting.Job) -> None:
        """A job past its limit: given up (a process worker killed), its episode's fault; the
        environment closed once the call returns (queued behind it), its place freed now."""
        e.info["env_s"] += job.seconds
        self.host.give_up(e.worker, job)
        what = {"starting": "constructor and reset", "stepping": "step", "closing": "close"}[e.phase]
        e.fault(f"{what} hung past {e.limit_s:g} s" if job.started is not None else
                f"{what} waited behind a call that hung")
        if e.phase != "closing":
            e.worker.submit(e.session, hosting.close)
        self.host.release(e.worker, reuse=False)
        e.worker = None  # nothing more of this episode goes to it
        if e.phase == "starting":
            e.phase = "ready"
        else:
            was = e.phase
            e.phase = "done"
            if was == "stepping":
                e.info["ended"] = "env_error"

    def _stuck(self, worker) -> bool:
        """A shared worker (one thread for every instance) whose running call was given up: what waits
        behind it would never start."""
        return worker is self.host.shared and self.host.hung > 0

    def _respond(self, e: _Episode, readings) -> None:
        """The environment's answers to a turn's calls: the replies appended together, or the episode ended
        by the one that says it is done (the calls after it were not run)."""
        texts, said = [], iter(readings)
        for answer in e.answers:
            if isinstance(answer, str):  # the model's own mistake, answered in the format's words
                texts.append(answer)
                continue
            reading = next(said)
            e.info["tool_errors"] += int(reading.error)
            if reading.reward is not None:
                e.info["step_rewards"].append(reading.reward)
            if reading.done:
                e.info["reward"] = reading.reward
                return self._end(e, "done")
            texts.append(reading.text)
        self._reply(e, texts, user=e.as_user)

    def _reply(self, e: _Episode, texts: list[str], *, user: bool = False) -> None:
        """A turn's replies appended, cut to fit `max_reply_tokens` and the context (room left for a sampled
        token after them); an episode with no room for them is cut short by the context."""
        room = self.max_model_len - len(e.prompt) - len(e.ids) - 1
        most = room if self.max_reply_tokens is None else min(self.max_reply_tokens, room)
        if most < self.replies.smallest(len(texts), user=user):
            return self._end(e, "context", cut=True)
        try:
            ids, cut = self.replies.ids(texts, most, user=user)
        except Exception as err:  # noqa: BLE001 - text no tokenizer takes: the environment's, its episode ended
            e.fault(f"its reply could not be tokenized: {_named(err)}")
            return self._end(e, "env_error")
        e.info["replies_cut"] += int(cut)
        e.hear(ids)
        e.phase = "ready"

    def _end(self, e: _Episode, why: str, *, cut: bool = False) -> None:
        """The episode over (`cut`: short of its answer, a truncation); its environment closed on its worker."""
        e.info["ended"] = why
        if cut:
            e.finish = "length"
        if e.worker is None:
            e.phase = "done"
            return
        self._submit(e, "closing", hosting.close)


def at_capacity(err: BaseException) -> bool:
    """An environment server's refusal of one more session (OpenEnv's "Server at capacity", CAPACITY_REACHED)."""
    said = str(err)
    return "at capacity" in said.lower() or "CAPACITY_REACHED" in said


def _named(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def budget(e: _Episode, max_tokens: int, max_model_len: int) -> int:
    """What an episode may still sample (≥ 1: a reply is taken only where a token can follow it): its
    budget left, within the context left."""
    return max(1, min(max_tokens - e.sampled, max_model_len - len(e.prompt) - len(e.ids)))
