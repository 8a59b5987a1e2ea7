"""Multi-turn episodes: the turn loop, token in, token out.

An episode is the task's prompt, then turns: the engine samples until a stop (the tool call's
closing token, EOS, or the episode's token budget), the call is read from that turn's sampled ids
alone, the environment answers, and only its reply is tokenized and appended; the episode's ids so
far are the next turn's prompt. Sampled ids are kept verbatim (the closing token included) and never
decoded back into the trained sequence, so nothing is re-rendered and the ids trained are the ids
sampled, with the environment's between them. One flat record per episode:

    ids       everything after the prompt: sampled and environment tokens, in order
    mask      1 sampled (log μ, version, route kept from the forward that sampled it), 0 environment
    routes    R3: one row per position fed through the engine. A sampled token keeps the row recorded
              when it was sampled; the environment's tokens and the last sampled token of each turn
              (never fed while its turn ran) take the rows of the next turn's prefill.

It ends on an answer (a turn without a call), the environment's `done`, `max_turns`, the budget or
the context, or a fault of the environment (raised, hung past `step_timeout_s`, a non-finite reward,
a reply that cannot fit, an environment that could not start): counted in the episode's
`EpisodeInfo`, the run goes on (past `env.max_error_frac` of a step's episodes it stops: run/checks.py).
The calls of the turns that end together step at once, each in a thread of its own.

`Environments` builds them from a recipe's [env] (any importable `module:Class` in OpenEnv's shape:
minirl/data/environment.py), one per episode, reset with its row, and samples a batch of episodes for
the run's step and its held-out evaluation alike; `answer_ids`, `rewards` and `rows` are what the step
and the evaluation read of an episode. Preflight refuses in one line, before anything is sampled, an
environment that cannot be built or reset: nothing could run then.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from minirl.data.environment import (TOOL_FORMATS, CallError, ToolFormat, action, close, environment_class, final_reward,
                                     reply, spawn, start_episode, within)
from minirl.errors import EngineFault, UsageError
from minirl.models import sizing
from minirl.rollout.engine import Completion, Engine, EpisodeInfo


@dataclass
class _Episode:
    prompt: list[int]
    env: object
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    routes: list = field(default_factory=list)  # R3: row blocks, concatenated at the end
    routed: int = 0  # positions the blocks cover
    info: dict = field(default_factory=lambda: dict(turns=0, tool_calls=0, tool_errors=0, env_errors=0, env_s=0.0,
                                                    env_tokens=0, reward=None, ended=""))
    finish: str = "stop"
    closed: bool = False  # its environment's `close` called (once, when it ended)
    preempted: int = 0
    regenerated: int = 0

    @property
    def sampled(self) -> int:
        return sum(self.mask)

    def take(self, c: Completion) -> None:
        """A turn's sample, verbatim; with R3 the rows of positions no earlier turn covered."""
        start = len(self.prompt) + len(self.ids)  # what this turn's prompt was
        self.ids += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logps += c.logprobs
        self.versions += c.versions if c.versions is not None else [None] * len(c.token_ids)
        if c.routes is not None:
            if len(c.routes) != start + len(c.token_ids) - 1 or len(c.routes) < self.routed:  # never misaligned
                raise EngineFault(f"an episode's turn came back with routes for {len(c.routes)} positions, its "
                                  f"tokens {start + len(c.token_ids) - 1}: R3 cannot replay routes that do not line "
                                  "up with the episode (train.replay = \"r2\" or \"off\" trains without them)")
            self.routes.append(c.routes[self.routed:])
            self.routed = len(c.routes)
        self.finish = c.finish
        self.preempted += c.preempted
        self.regenerated += c.regenerated
        self.info["turns"] += 1

    def hear(self, ids: Sequence[int]) -> None:
        """The environment's reply: loss mask 0, no μ, the version of the turn before."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logps += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else None] * len(ids)
        self.info["env_tokens"] += len(ids)

    def end(self, why: str) -> None:
        self.info["ended"] = why

    def completion(self) -> Completion:
        routes = None
        if self.routes:
            routes = np.concatenate(self.routes)
            if len(routes) != len(self.prompt) + len(self.ids) - 1:  # never misaligned: asserted
                raise EngineFault(f"an episode's routes cover {len(routes)} positions of "
                                  f"{len(self.prompt) + len(self.ids) - 1}: R3 cannot replay routes that do not "
                                  "line up with the episode (train.replay = \"r2\" or \"off\" trains without them)")
        versions = tuple(self.versions) if self.versions and None not in self.versions else None
        return Completion(tuple(self.ids), tuple(self.logps), self.finish, routes, versions, self.preempted,
                          self.regenerated, mask=tuple(self.mask), episode=EpisodeInfo(**self.info))


class Turns:
    """A batch's episodes, n of each prompt, as the turn loop drives them: `took` takes the turns that
    just ended (what episode j of prompt i sampled), steps the environments of those that called a
    tool together, and returns what each episode that goes on asks next (its ids so far, the next
    turn's prompt, and what it may still sample). The synchronous loop below asks a turn's requests
    together; an engine's stream (stream.py) asks an episode's next turn as soon as its last one
    finished, so with in-flight updates each turn is sampled by the weights of its own time (each
    token stamped with its version)."""

    def __init__(self, prompts: Sequence[Sequence[int]], envs: Sequence[Sequence[object]], *, fmt: ToolFormat,
                 encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str], n: int, max_tokens: int,
                 max_turns: int, max_model_len: int, step_timeout_s: float = 30.0, max_reply_tokens: int | None = None):
        self.stop = encode(fmt.close)
        if len(self.stop) != 1:
            raise ValueError(f"a tool call's closing text {fmt.close!r} is {len(self.stop)} tokens: the engine stops "
                             "a turn on one token of the vocabulary")
        self.episodes = [[_Episode(list(p), envs[i][j]) for j in range(n)] for i, p in enumerate(prompts)]
        for e in (e for group in self.episodes for e in group):
            if isinstance(e.env, Unstarted):  # counted from the start: it may never call
                e.info["env_errors"], e.info["fault"], e.closed = 1, e.env.why, True
        self.fmt, self.encode, self.decode = fmt, encode, decode
        self.max_tokens, self.max_turns, self.max_model_len = max_tokens, max_turns, max_model_len
        self.step_timeout_s, self.max_reply_tokens = step_timeout_s, max_reply_tokens

    def took(self, done: Sequence[tuple[int, int, Completion]]) -> list[tuple[int, int, tuple[list[int], int]]]:
        """The turns that just ended, (i, j, what episode j of prompt i sampled), in order: the
        environments of those that called a tool step together, each in a thread of its own within
        `step_timeout_s` (a batch's calls take the longest one's time, not their sum); what each
        episode that goes on asks next, (i, j, (its ids so far, what it may still sample)), in order."""
        steps = []  # (episode, its step's thread and outcome, or None: a call it could not read, and why)
        for i, j, c in done:
            e = self.episodes[i][j]
            e.take(c)
            if c.finish == "length" or not c.token_ids or c.token_ids[-1] != self.stop[0]:
                e.end("length" if c.finish == "length" else "answer")
            elif e.info["turns"] >= self.max_turns:
                e.end("max_turns")
            elif e.sampled >= self.max_tokens:  # no token left to answer a reply with: none is asked for
                e.end("length")
            elif isinstance(e.env, Unstarted):  # a call with no environment to answer it (counted already)
                e.info["tool_calls"] += 1
                e.end("env_error")
            else:
                call, unreadable = read_call(c.token_ids, self.fmt, self.decode)
                e.info["tool_calls"] += 1
                steps.append((e, None if call is None else spawn(e.env.step, action(e.env, call)), unreadable))
        for e, step, unreadable in steps:
            if step is None:  # the model's own mistake, answered in the format's words: no fault of the environment's
                respond(e, None, self.fmt.unreadable.replace("{}", unreadable), True, self)
                continue
            thread, box = step
            thread.join(max(0.0, box["t0"] + self.step_timeout_s - time.perf_counter()))
            e.info["env_s"] += box.get("s", self.step_timeout_s)
            if thread.is_alive():  # cannot be stopped from here: left running as a daemon, its episode ended
                fault(e, f"step hung past {self.step_timeout_s:g} s")
            elif "err" in box:  # the environment's own fault: counted, the episode ended
                fault(e, f"step raised {type(box['err']).__name__}: {box['err']}")
            else:
                respond(e, box["out"], *reply(box["out"]), self)
        asks = []
        for i, j, _ in done:
            e = self.episodes[i][j]
            if e.info["ended"]:
                self._release(e)
            else:
                asks.append((i, j, (e.prompt + e.ids, budget(e, self.max_tokens, self.max_model_len))))
        return asks

    def completions(self) -> list[list[Completion]]:
        return [[e.completion() for e in group] for group in self.episodes]

    def close(self) -> None:
        """The environments of episodes cut short (an error, a rollback's cancel) closed too; a close
        that raises or hangs there is let go (no episode is answered to count it in)."""
        for e in (e for group in self.episodes for e in group):
            self._release(e, count=False)

    def _release(self, e: _Episode, *, count: bool = True) -> None:
        """An ended episode's environment closed at once (a sandbox, a connection freed), within the
        step's time limit; one that raises or hangs is counted as the episode's environment error."""
        if e.closed:
            return
        e.closed = True
        if e.info.get("fault", "").startswith("step hung"):  # its step still holds it, in a thread left running
            return
        try:
            within(close, e.env, self.step_timeout_s)
            return
        except TimeoutError:
            why = f"close hung past {self.step_timeout_s:g} s"
        except Exception as err:  # the environment's own fault: counted, the run goes on
            why = f"close raised {type(err).__name__}: {err}"
        if count and not e.info.get("fault"):  # an episode's first fault is its one
            e.info["env_errors"] += 1
            e.info["fault"] = why


def sample_episodes(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    envs: Sequence[Sequence[object]],
    *,
    fmt: ToolFormat,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    n: int,
    temperature: float,
    max_tokens: int,
    max_turns: int,
    max_model_len: int,
    seed: int | None = None,
    step_timeout_s: float = 30.0,
    max_reply_tokens: int | None = None,
    seeded_requests: bool = False,
) -> list[list[Completion]]:
    """n episodes per prompt, [len(prompts)][n], in prompt order, a turn of every live episode per
    `engine.generate`; `envs[i][j]` is episode j of prompt i's environment, reset for its row.
    `max_tokens`: the sampled tokens of an episode, all its turns together; `max_model_len`: the
    engine's context, which prompt, turns and replies share. `encode` tokenizes a reply's text (no
    special tokens added), `decode` a turn's sampled ids. `max_reply_tokens`: the longest reply taken
    (the run's context is planned with it). `seeded_requests`: as `Engine.generate`'s, at every turn
    (the held-out evaluation's)."""
    turns = Turns(prompts, envs, fmt=fmt, encode=encode, decode=decode, n=n, max_tokens=max_tokens,
                  max_turns=max_turns, max_model_len=max_model_len, step_timeout_s=step_timeout_s,
                  max_reply_tokens=max_reply_tokens)
    return run_turns(engine, turns, prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                     seeded_requests=seeded_requests)


def run_turns(engine: Engine, turns: Turns, prompts: Sequence[Sequence[int]], *, n: int, temperature: float,
              max_tokens: int, seed: int | None, seeded_requests: bool = False) -> list[list[Completion]]:
    """`sample_episodes`' loop over episodes built already: a turn of every live one per `generate`."""
    ask = dict(temperature=temperature, stop=turns.stop, seeded_requests=seeded_requests)
    try:
        # the first turn: the group's n episodes share the prompt, one request of n samples each
        groups = engine.generate(prompts, n=n, max_tokens=max_tokens, seed=seed, **ask)
        asks = turns.took([(i, j, c) for i, g in enumerate(groups) for j, c in enumerate(g)])
        turn = 1
        while asks:
            groups = engine.generate([p for _, _, (p, _) in asks], n=1, max_tokens=[b for _, _, (_, b) in asks],
                                     seed=None if seed is None else seed + 1_000_003 * turn, **ask)
            asks = turns.took([(i, j, g[0]) for (i, j, _), g in zip(asks, groups, strict=True)])
            turn += 1
        return turns.completions()
    finally:
        turns.close()  # each environment closed once: as its episode ended, or here


def budget(e: _Episode, max_tokens: int, max_model_len: int) -> int:
    """What an episode may still sample (≥ 1: a reply is taken only where a token can follow it): its
    budget left, within the context left."""
    return max(1, min(max_tokens - e.sampled, max_model_len - len(e.prompt) - len(e.ids)))


def read_call(turn_ids, fmt: ToolFormat, decode) -> tuple[object | None, str | None]:
    """The call a turn ended with, read from its own sampled ids: (the call, None), or (None, why it
    could not be read)."""
    try:
        call = fmt.call(decode(turn_ids))
    except CallError as err:
        return None, str(err)
    if call is None:  # closed a call it never opened: read as a malformed call
        return None, f"no call before {fmt.close!r}"
    return call, None


def respond(e: _Episode, obs, text: str, error: bool, turns: Turns) -> None:
    """The environment's answer to an episode's call (`obs`; None: a call it could not read, answered
    `text`): its reply appended, or the episode ended (done, or a fault)."""
    e.info["tool_errors"] += int(error)
    if obs is not None and getattr(obs, "done", False):
        try:
            e.info["reward"] = final_reward(obs)
        except ValueError:
            return fault(e, "a non-finite reward")
        return e.end("done")
    ids, most = turns.encode(turns.fmt.text(text)), turns.max_reply_tokens
    if obs is None and most is not None:
        ids = ids[:most]
    if most is not None and len(ids) > most:
        return fault(e, f"a reply of {len(ids)} tokens (env.max_reply_tokens = {most})")
    if len(e.prompt) + len(e.ids) + len(ids) + 1 > turns.max_model_len:  # room for one more sampled token at least
        return fault(e, "a reply longer than the context")
    e.hear(ids)


def fault(e: _Episode, why: str) -> None:
    e.info["env_errors"] += 1
    e.info["fault"] = why
    e.end("env_error")


class Environments:
    """A recipe's [env]: `sample(engine, problems, n=, temperature=, max_tokens=, seed=)` samples n episodes
    of each problem (a step's, or the held-out evaluation's), each with an environment of its own, a
    turn of every episode per `generate`; `request(problems, seed)` is the same batch for an engine's
    process to run in its stream (stream.py: at `rollout.max_staleness` ≥ 1, and on rollout GPUs).
    Pickled without its tokenizer: the engine's process tokenizes with its own (the model's)."""

    def __init__(self, env, *, tokenizer, max_model_len: int):
        self.settings, self.cls = env, environment_class(env.name)
        self.fmt = TOOL_FORMATS[env.tool_format]
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    @classmethod
    def from_recipe(cls, rec, tokenizer) -> "Environments | None":
        """None for a single-turn recipe (env.name "")."""
        if not rec.env.name:
            return None
        return cls(rec.env, tokenizer=tokenizer, max_model_len=sizing.max_model_len(rec))

    def __getstate__(self) -> dict:
        return dict(settings=self.settings, max_model_len=self.max_model_len)

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["settings"], tokenizer=None, max_model_len=state["max_model_len"])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def sample(self, engine, problems: Sequence, *, n: int, temperature: float, max_tokens: int,
               seed: int | None, seeded_requests: bool = False) -> list[list[Completion]]:
        prompts = [p.prompt_ids for p in problems]
        return run_turns(engine, self.turns(prompts, [_row(p) for p in problems], n=n, max_tokens=max_tokens,
                                            seed=seed),
                         prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                         seeded_requests=seeded_requests)

    def turns(self, prompts: Sequence[Sequence[int]], rows: Sequence[dict], *, n: int, max_tokens: int,
              seed: int | None) -> Turns:
        """n episodes of each prompt, each with an environment of its own reset with its row."""
        s = self.settings
        return Turns(prompts, self._envs(rows, n, seed), fmt=self.fmt, encode=self.encode, decode=self.decode, n=n,
                     max_tokens=max_tokens, max_turns=s.max_turns, max_model_len=self.max_model_len,
                     step_timeout_s=s.step_timeout_s, max_reply_tokens=s.max_reply_tokens)

    def request(self, problems: Sequence, *, seed: int | None) -> "EpisodeRequest":
        """A batch's episodes for an engine's process (its `generate(..., episodes=)`): the rows they
        reset with; the process builds the environments and runs the turns (`EpisodeRequest.turns`)."""
        return EpisodeRequest(self, tuple(_row(p) for p in problems), seed)

    def _envs(self, rows: Sequence[dict], n: int, seed: int | None) -> list[list[object]]:
        """n environments of each row, each reset for its episode. One that cannot start now (its
        server briefly down: the run's preflight started one) is `Unstarted`: that episode's
        environment error, counted, and past env.max_error_frac of a step's episodes the run stops
        (run/checks.py) rather than on the first."""
        def start(row, j):
            try:
                return self._start(row, j, seed)
            except UsageError as e:
                return Unstarted(str(e))

        return [[start(row, j) for j in range(n)] for row in rows]

    def _start(self, row: dict, j: int, seed: int | None):
        """Episode j of a row: a new environment, reset with the row's fields."""
        return start_episode(self.cls, self.settings, row, seed=None if seed is None else seed + j, episode_id=str(j))


class Unstarted:
    """The environment of an episode that could not start (`why`): the episode's turns run without
    it; it counts as the episode's environment error from the start, and a call ends it."""

    def __init__(self, why: str):
        self.why = why

    def step(self, action):
        raise RuntimeError(self.why)


def _row(problem) -> dict:
    return dict(problem.record) if isinstance(getattr(problem, "record", None), dict) else {}


@dataclass(frozen=True)
class EpisodeRequest:
    """A batch's episodes as sent to an engine's process (picklable): the recipe's environments, the
    rows their episodes reset with, the batch's seed."""
    environments: Environments
    rows: tuple[dict, ...]
    seed: int | None

    def part(self, lo: int, hi: int) -> "EpisodeRequest":
        """The episodes of prompts lo…hi − 1 (a call split over rollout GPUs' engines: remote.py)."""
        return replace(self, rows=self.rows[lo:hi])

    def turns(self, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int, tokenizer) -> Turns:
        """In the engine's process, with its tokenizer: the episodes, each environment built and reset
        with its row."""
        self.environments.tokenizer = tokenizer
        return self.environments.turns(prompts, self.rows, n=n, max_tokens=max_tokens, seed=self.seed)


SUMS = ("episode/tool_errors", "episode/env_errors")  # counts: summed over ranks, the rest averaged


def rows(comps: Sequence[Completion]) -> dict:
    """A step's episodes, for its row (none for single-turn completions)."""
    eps = [c.episode for c in comps if c.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    return {"episode/turns": sum(e.turns for e in eps) / n,
            "episode/tool_calls": sum(e.tool_calls for e in eps) / n,
            "episode/tool_errors": sum(e.tool_errors for e in eps),
            "episode/env_errors": sum(e.env_errors for e in eps),
            "episode/env_tokens": sum(e.env_tokens for e in eps) / n,
            "timing/env_s": round(sum(e.env_s for e in eps), 4),
            # what the environment's faults were, by kind (a row says why its episodes ended early)
            **({"episode/faults": dict(collections.Counter(e.fault for e in eps if e.fault))}
               if any(e.fault for e in eps) else {})}
