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
a reply that cannot fit): counted in the episode's `EpisodeInfo`, the run goes on.

`Environments` builds them from a recipe's [env] (any importable `module:Class` in OpenEnv's shape:
minirl/data/environment.py), one per episode, reset with its row, and samples a batch of episodes for
the run's step and its held-out evaluation alike; `answer_ids`, `rewards` and `rows` are what the step
and the evaluation read of an episode. One line, before anything is sampled, where an environment
cannot be built or reset: nothing can run then.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minirl.data.environment import (TOOL_FORMATS, CallError, ToolFormat, action, close, environment_class, final_reward,
                                     reply, start_episode)
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
            if len(c.routes) != start + len(c.token_ids) - 1 or len(c.routes) < self.routed:
                raise RuntimeError(f"a turn's routes cover {len(c.routes)} positions, its tokens "
                                   f"{start + len(c.token_ids) - 1}")
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
                raise RuntimeError(f"an episode's routes cover {len(routes)} positions of "
                                   f"{len(self.prompt) + len(self.ids) - 1}")
        versions = tuple(self.versions) if self.versions and None not in self.versions else None
        return Completion(tuple(self.ids), tuple(self.logps), self.finish, routes, versions, self.preempted,
                          self.regenerated, mask=tuple(self.mask), episode=EpisodeInfo(**self.info))


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
    """n episodes per prompt, [len(prompts)][n], in prompt order; `envs[i][j]` is episode j of prompt
    i's environment, reset for its row. `max_tokens`: the sampled tokens of an episode, all its turns
    together; `max_model_len`: the engine's context, which prompt, turns and replies share.
    `encode` tokenizes a reply's text (no special tokens added), `decode` a turn's sampled ids.
    `max_reply_tokens`: the longest reply taken (the run's context is planned with it). `seeded_requests`:
    as `Engine.generate`'s, at every turn (the held-out evaluation's)."""
    stop = encode(fmt.close)
    if len(stop) != 1:
        raise ValueError(f"a tool call's closing text {fmt.close!r} is {len(stop)} tokens: the engine stops a "
                         "turn on one token of the vocabulary")
    episodes = [[_Episode(list(p), envs[i][j]) for j in range(n)] for i, p in enumerate(prompts)]
    flat = [e for group in episodes for e in group]
    for turn in range(max_turns):
        live = [e for e in flat if not e.info["ended"]]
        if not live:
            break
        call_seed = None if seed is None else seed + 1_000_003 * turn
        if turn == 0:  # the group's n episodes share the prompt: one request of n samples each
            groups = engine.generate(prompts, n=n, temperature=temperature, max_tokens=max_tokens,
                                     seed=call_seed, stop=stop, seeded_requests=seeded_requests)
            samples = [c for g in groups for c in g]
        else:
            budgets = [budget(e, max_tokens, max_model_len) for e in live]
            groups = engine.generate([e.prompt + e.ids for e in live], n=1, temperature=temperature,
                                     max_tokens=budgets, seed=call_seed, stop=stop, seeded_requests=seeded_requests)
            samples = [g[0] for g in groups]
        for e, c in zip(live, samples, strict=True):
            e.take(c)
            if c.finish == "length" or not c.token_ids or c.token_ids[-1] != stop[0]:
                e.end("length" if c.finish == "length" else "answer")
            elif turn == max_turns - 1:
                e.end("max_turns")
            elif e.sampled >= max_tokens:  # no token left to answer a reply with: none is asked for
                e.end("length")
            else:
                answer(e, c.token_ids, fmt, encode, decode, step_timeout_s, max_model_len, max_reply_tokens)
    return [[e.completion() for e in group] for group in episodes]


def budget(e: _Episode, max_tokens: int, max_model_len: int) -> int:
    """What an episode may still sample (≥ 1: a reply is taken only where a token can follow it): its
    budget left, within the context left."""
    return max(1, min(max_tokens - e.sampled, max_model_len - len(e.prompt) - len(e.ids)))


def answer(e: _Episode, turn_ids, fmt: ToolFormat, encode, decode, timeout_s: float, max_model_len: int,
           max_reply: int | None = None) -> None:
    """The environment answers the call the turn ended with; its reply appended, or the episode ended."""
    try:
        call, unreadable = fmt.call(decode(turn_ids)), None
    except CallError as err:
        call, unreadable = None, str(err)
    if call is None and unreadable is None:  # closed a call it never opened: read as a malformed call
        unreadable = f"no call before {fmt.close!r}"
    e.info["tool_calls"] += 1
    if unreadable is not None:  # the model's own mistake, answered in the format's words: not the environment's fault
        text, error, obs = fmt.unreadable.replace("{}", unreadable), True, None
    else:
        t0 = time.perf_counter()
        try:
            obs = within(e.env.step, action(e.env, call), timeout_s)
        except TimeoutError:
            return fault(e, f"step hung past {timeout_s:g} s")
        except Exception as err:  # the environment's own fault: counted, the episode ended
            return fault(e, f"step raised {type(err).__name__}: {err}")
        finally:
            e.info["env_s"] += time.perf_counter() - t0
        text, error = reply(obs)
    e.info["tool_errors"] += int(error)
    if obs is not None and getattr(obs, "done", False):
        try:
            e.info["reward"] = final_reward(obs)
        except ValueError:
            return fault(e, "a non-finite reward")
        return e.end("done")
    ids = encode(fmt.text(text))
    if obs is None and max_reply is not None:
        ids = ids[:max_reply]
    if max_reply is not None and len(ids) > max_reply:
        return fault(e, f"a reply of {len(ids)} tokens (env.max_reply_tokens = {max_reply})")
    if len(e.prompt) + len(e.ids) + len(ids) + 1 > max_model_len:  # room for one more sampled token at least
        return fault(e, "a reply longer than the context")
    e.hear(ids)


def fault(e: _Episode, why: str) -> None:
    e.info["env_errors"] += 1
    e.info["fault"] = why
    e.end("env_error")


def within(step, call, timeout_s: float):
    """`step(call)` in a thread of its own, given up after `timeout_s` (TimeoutError): a hung step
    cannot be stopped from here, so it is left running as a daemon and its episode ends."""
    box: dict = {}

    def run():
        try:
            box["obs"] = step(call)
        except BaseException as err:  # handed to the caller, which counts it
            box["err"] = err

    t = threading.Thread(target=run, daemon=True, name="minirl-env-step")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError
    if "err" in box:
        raise box["err"]
    return box["obs"]


class Environments:
    """A recipe's [env]: `sample(engine, problems, n=, temperature=, max_tokens=, seed=)` samples n episodes
    of each problem (a step's, or the held-out evaluation's), each with an environment of its own."""

    def __init__(self, env, *, encode, decode, max_model_len: int):
        self.settings, self.cls = env, environment_class(env.name)
        self.fmt = TOOL_FORMATS[env.tool_format]
        self.encode, self.decode, self.max_model_len = encode, decode, max_model_len

    @classmethod
    def from_recipe(cls, rec, tokenizer) -> "Environments | None":
        """None for a single-turn recipe (env.name "")."""
        if not rec.env.name:
            return None
        return cls(rec.env, encode=lambda s: tokenizer.encode(s, add_special_tokens=False),
                   decode=lambda ids: tokenizer.decode(list(ids)), max_model_len=sizing.max_model_len(rec))

    def sample(self, engine, problems: Sequence, *, n: int, temperature: float, max_tokens: int,
               seed: int | None, seeded_requests: bool = False) -> list[list[Completion]]:
        envs = [[self._start(p, j, seed) for j in range(n)] for p in problems]
        try:
            return sample_episodes(engine, [p.prompt_ids for p in problems], envs, fmt=self.fmt, encode=self.encode,
                                   decode=self.decode, n=n, temperature=temperature, max_tokens=max_tokens,
                                   max_turns=self.settings.max_turns, max_model_len=self.max_model_len,
                                   max_reply_tokens=self.settings.max_reply_tokens, seed=seed,
                                   step_timeout_s=self.settings.step_timeout_s, seeded_requests=seeded_requests)
        finally:
            for env in (e for row in envs for e in row):
                close(env)

    def _start(self, problem, j: int, seed: int | None):
        """Episode j of `problem`: a new environment, reset with the row's fields."""
        row = dict(problem.record) if isinstance(getattr(problem, "record", None), dict) else {}
        return start_episode(self.cls, self.settings, row, seed=None if seed is None else seed + j, episode_id=str(j))


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
