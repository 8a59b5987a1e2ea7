"""The synchronous turn loop over an engine: `run_turns` drives a batch's `Turns` (episodes.py) one
`generate` per round, every live episode's turn together, the environments' calls of a round returned (or
given up) before the next; `sample_episodes` is the same over environments a caller hands in. At k ≥ 1 and
on rollout GPUs an engine's stream drives the same `Turns` instead (stream.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from minirl.envs import hosting
from minirl.envs.contract import accepted
from minirl.envs.formats import ToolFormat
from minirl.rollout.engine import NO_CUT, Completion, Engine, Truncation
from minirl.rollout.episodes import Turns


def run_turns(engine: Engine, turns: Turns, prompts: Sequence[Sequence[int]], *, n: int, temperature: float,
              max_tokens: int, seed: int | None, seeded_requests: bool = False,
              truncation: Truncation = NO_CUT) -> list[list[Completion]]:
    """The synchronous turn loop: a turn of every episode ready per `generate`, the environments'
    calls of a round returned (or given up) before the next. `truncation`: an evaluation's cuts."""
    ask = dict(temperature=temperature, stop=turns.stop, seeded_requests=seeded_requests, **truncation.kw)
    try:
        turns.begin()
        asks = turns.settle()
        if len(asks) == len(prompts) * n and all(p == list(prompts[i]) for i, _, (p, _) in asks):
            # every episode's first turn at once: the group's n share the prompt, one request of n samples each
            groups = engine.generate(prompts, n=n, max_tokens=max_tokens, seed=seed, **ask)
            turns.took([(i, j, c) for i, g in enumerate(groups) for j, c in enumerate(g)])
            asks = turns.settle()
        for turn in itertools.count(1):
            if not asks:
                if turns.finished:
                    break
                turns.wait()
                asks = turns.settle()
                continue
            groups = engine.generate([p for _, _, (p, _) in asks], n=1, max_tokens=[b for _, _, (_, b) in asks],
                                     seed=None if seed is None else seed + 1_000_003 * turn, **ask)
            turns.took([(i, j, g[0]) for (i, j, _), g in zip(asks, groups, strict=True)])
            asks = turns.settle()
        return turns.completions()
    finally:
        turns.close()  # each environment closed once: as its episode ended, or here


def sample_episodes(engine: Engine, prompts: Sequence[Sequence[int]], envs: Sequence[Sequence[object]], *,
                    fmt: ToolFormat, encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str],
                    n: int, temperature: float, max_tokens: int, max_turns: int, max_model_len: int,
                    seed: int | None = None, step_timeout_s: float = 30.0, max_reply_tokens: int | None = None,
                    seeded_requests: bool = False, host: hosting.Host | None = None,
                    encode_text: Callable[[str], list[int]] | None = None, max_calls: int = 1,
                    user_turns: bool = False, truncation: Truncation = NO_CUT) -> list[list[Completion]]:
    """n episodes per prompt, [len(prompts)][n], in prompt order, a turn of every live episode per
    `engine.generate`; `envs[i][j]` is episode j of prompt i's environment: a class (built and reset on
    its worker with no arguments), or an object built and reset already (taken as it is).
    `max_tokens`: the sampled tokens of an episode, all its turns together; `max_model_len`: the
    engine's context, which prompt, turns and replies share. `encode` tokenizes the format's text,
    `encode_text` the environment's (default: `encode`), `decode` a turn's sampled ids.
    `max_reply_tokens`: the longest reply (cut beyond). `seeded_requests`: as `Engine.generate`'s.
    `max_calls`: the calls a turn may make, where `fmt`'s turns run to their end. `user_turns`: the
    environments answer a turn without a call as the user (`env.replies_to = "turns"`). `truncation`: the
    sampler's cuts (top-p, top-k, min-p)."""
    starts = [[(env if isinstance(env, type) else Adopted(env), {}, {}) for env in group] for group in envs]
    own = host is None
    host = host or hosting.Host()
    turns = Turns(prompts, starts, host=host, fmt=fmt, encode=encode, decode=decode, n=n, max_tokens=max_tokens,
                  max_turns=max_turns, max_model_len=max_model_len, step_timeout_s=step_timeout_s,
                  max_reply_tokens=max_reply_tokens, encode_text=encode_text, max_calls=max_calls,
                  user_turns=user_turns)
    try:
        return run_turns(engine, turns, prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                         seeded_requests=seeded_requests, truncation=truncation)
    finally:
        if own:
            host.close()


class Adopted:
    """A "class" whose one instance is an environment built and reset already (a caller's own)."""

    def __init__(self, env):
        self.env = env

    def __call__(self):
        return self

    def reset(self):
        pass

    def step(self, action, timeout_s=None):
        return self.env.step(action, **accepted(self.env.step, {"timeout_s": timeout_s}))

    def close(self):
        done = getattr(self.env, "close", None)
        return done() if callable(done) else None
