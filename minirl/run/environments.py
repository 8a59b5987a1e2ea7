"""A run's multi-turn episodes (#84): the recipe's [env] class built for each episode and reset with its
row, the turn loop of rollout/episodes.py run over the engine, and what the step reads of an episode:
the answer the grader scores, the environment's own reward, the rows.

The class is any importable `module:Class` in OpenEnv's shape (minirl/data/environment.py): minirl's
own, OpenEnv's, or a user's. One line, before anything is sampled, where it cannot be imported, built
or reset: nothing can run then.
"""

from __future__ import annotations

from collections.abc import Sequence

from minirl.data.environment import TOOL_FORMATS, environment_class
from minirl.errors import UsageError
from minirl.models import sizing
from minirl.rollout.engine import Completion
from minirl.rollout.episodes import sample_episodes


class Environments:
    """Samples a step's episodes: `sample(engine, problems, n=, temperature=, max_tokens=, seed=)`."""

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
               seed: int | None) -> list[list[Completion]]:
        envs = [[self._start(p, j, seed) for j in range(n)] for p in problems]
        try:
            return sample_episodes(engine, [p.prompt_ids for p in problems], envs, fmt=self.fmt, encode=self.encode,
                                   decode=self.decode, n=n, temperature=temperature, max_tokens=max_tokens,
                                   max_turns=self.settings.max_turns, max_model_len=self.max_model_len,
                                   max_reply_tokens=self.settings.max_reply_tokens, seed=seed,
                                   step_timeout_s=self.settings.step_timeout_s)
        finally:
            for env in (e for row in envs for e in row):
                close = getattr(env, "close", None)
                if callable(close):
                    close()

    def _start(self, problem, j: int, seed: int | None):
        """Episode j of `problem`: a new environment, reset with the row's fields."""
        row = dict(problem.record) if isinstance(getattr(problem, "record", None), dict) else {}
        try:
            env = self.cls(**self.settings.params)
            env.reset(seed=None if seed is None else seed + j, episode_id=str(j), **row)
        except Exception as e:  # nothing can run: every episode of the run starts this way
            raise UsageError(f"env.name = {self.settings.name!r} could not start an episode: {type(e).__name__}: {e}") \
                from None
        return env


def answer_ids(c: Completion) -> tuple[int, ...]:
    """What the grader reads of a completion: an episode's last turn, after the last reply (the answer)."""
    if c.mask is None or 0 not in c.mask:
        return c.token_ids
    last = len(c.mask) - c.mask[::-1].index(0)
    return c.token_ids[last:]


def rewards(comps: Sequence[Completion], scores: Sequence) -> list[float]:
    """Each completion's R: the environment's reward where it ended the episode with one, else the
    grader's score of its answer."""
    return [c.episode.reward if c.episode is not None and c.episode.reward is not None else s.score
            for c, s in zip(comps, scores, strict=True)]


def sampled(c: Completion) -> int:
    """Tokens the engine sampled (an episode's replies left out): the length the overlong shaping reads."""
    return len(c.token_ids) if c.mask is None else sum(c.mask)


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
            "timing/env_s": round(sum(e.env_s for e in eps), 4)}
