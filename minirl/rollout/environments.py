"""A recipe's [env] as the rollouts use it: `Environments` builds a batch's episodes (each environment
reset with its row, a seed and an id of its own) and samples them over an engine, or sends them to an
engine's process (`EpisodeRequest`: at k ≥ 1 and on rollout GPUs, where the process's stream runs them
on its own host); `rows` is what a step's row says of its episodes. The turn loop is episodes.py; the
environments' contract, hosting and fault rules are minirl/envs/.
"""

from __future__ import annotations

import collections
import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from minirl.data.prompts import Prompter
from minirl.envs import hosting
from minirl.envs.contract import Concurrency, environment_class, episode_seed
from minirl.envs.templates import format_for
from minirl.models import sizing
from minirl.rollout.engine import NO_CUT, Completion, Truncation
from minirl.rollout.episodes import Turns
from minirl.rollout.turn_loop import run_turns


class Environments:
    """A recipe's [env]: `sample(engine, problems, n=, temperature=, max_tokens=, seed=)` samples n episodes
    of each problem (a step's, or the held-out evaluation's), each with an environment of its own on
    the process's host; `request(problems, seed)` is the same batch for an engine's process to run in
    its stream (stream.py: at `rollout.max_staleness` ≥ 1, and on rollout GPUs). Pickled without its
    tokenizer and host: the engine's process tokenizes with its own (the model's) and hosts its own."""

    def __init__(self, env, *, tokenizer, max_model_len: int, prompter: Prompter | None = None):
        self.settings, self.cls = env, environment_class(env.name)
        self.prompter = prompter  # how a row's prompt is rendered again with an episode's reset observation
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._fmt: tuple = (None, None)  # (the tokenizer it was rendered with, the format)
        flags = Concurrency.of(self.cls)
        self.host = hosting.Host(isolation=env.isolation, max_live=1 if flags.one_at_a_time else env.max_concurrency,
                                 one_thread=flags.one_thread)
        self._ids = itertools.count()
        self._nonce = uuid.uuid4().hex[:8]  # this process's: episode ids unique over the run's processes

    @classmethod
    def from_recipe(cls, rec, tokenizer, tools=()) -> "Environments | None":
        """None for a single-turn recipe (env.name ""). `tools`: the environment's, as the prompts render them."""
        if not rec.env.name:
            return None
        d = rec.data
        prompter = Prompter(d.prompt_field, d.prompt_template, d.chat_template, d.chat_template_kwargs, tuple(tools),
                            d.max_prompt_tokens)
        return cls(rec.env, tokenizer=tokenizer, max_model_len=sizing.max_model_len(rec), prompter=prompter)

    def __getstate__(self) -> dict:
        return dict(settings=self.settings, max_model_len=self.max_model_len, prompter=self.prompter)

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["settings"], tokenizer=None, max_model_len=state["max_model_len"],
                      prompter=state.get("prompter"))

    @property
    def fmt(self):
        """The recipe's tool format as this tokenizer's chat template renders it (envs/templates.py)."""
        if self._fmt[0] is not self.tokenizer:
            p, s = self.prompter, self.settings
            self._fmt = (self.tokenizer, format_for(s.tool_format, self.tokenizer, chat=bool(p and p.chat),
                                                    chat_kwargs=p and p.chat_kwargs, tools=p.tools if p else (),
                                                    max_calls=s.max_calls, user_turns=s.replies_to == "turns"))
        return self._fmt[1]

    def encode(self, text: str) -> list[int]:
        """The format's own text: its special tokens as single symbols."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """The environment's text: a special token's name written in it is characters, never the token."""
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def sample(self, engine, problems: Sequence, *, n: int, temperature: float, max_tokens: int,
               seed: int | None, seeded_requests: bool = False,
               truncation: Truncation = NO_CUT) -> list[list[Completion]]:
        prompts = [p.prompt_ids for p in problems]
        return run_turns(engine, self.turns(prompts, [_row(p) for p in problems], n=n, max_tokens=max_tokens,
                                            seed=seed),
                         prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                         seeded_requests=seeded_requests, truncation=truncation)

    def turns(self, prompts: Sequence[Sequence[int]], rows: Sequence[dict], *, n: int, max_tokens: int,
              seed: int | None) -> Turns:
        """n episodes of each prompt, each with an environment of its own reset with its row."""
        s = self.settings
        ref = s.name if s.isolation == "process" else self.cls  # a process imports it by name
        starts = [[(ref, s.params, {**row, "seed": episode_seed(seed, i, j), "episode_id": self._episode_id()},
                    s.reward_func) for j in range(n)] for i, row in enumerate(rows)]
        shown = None if self.prompter is None else (lambda i, text: self.prompter.ids(self.tokenizer, rows[i], text))
        return Turns(prompts, starts, host=self.host, fmt=self.fmt, encode=self.encode, decode=self.decode, n=n,
                     max_tokens=max_tokens, max_turns=s.max_turns, max_model_len=self.max_model_len,
                     step_timeout_s=s.step_timeout_s, max_reply_tokens=s.max_reply_tokens,
                     encode_text=self.encode_text, prompt_for=shown, max_calls=s.max_calls,
                     user_turns=s.replies_to == "turns")

    def request(self, problems: Sequence, *, seed: int | None) -> "EpisodeRequest":
        """A batch's episodes for an engine's process (its `generate(..., episodes=)`): the rows they
        reset with; the process builds the environments and runs the turns (`EpisodeRequest.turns`)."""
        return EpisodeRequest(self, tuple(_row(p) for p in problems), seed)

    def _episode_id(self) -> str:
        return f"{self._nonce}-{next(self._ids)}"

    def release(self) -> None:
        """The environments kept between episodes disposed of (a client's sessions closed): after an
        evaluation, so that the sessions a server allows are free for the run's other process."""
        self.host.let_go()

    def close(self) -> None:
        self.host.close()


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
        """In the engine's process, with its tokenizer: the episodes, to be started on the process's host
        (one for every call of the same recipe: its cap and its workers are the process's)."""
        key = repr((self.environments.settings, self.environments.max_model_len))
        envs = _RESIDENT.setdefault(key, self.environments)
        envs.tokenizer = tokenizer
        return envs.turns(prompts, self.rows, n=n, max_tokens=max_tokens, seed=self.seed)


# an engine's process: the recipe's environments, as the first call brought them
_RESIDENT: dict[str, Environments] = {}


SUMS = ("episode/tool_errors", "episode/env_errors", "episode/masked", "episode/replies_cut",
        "episode/env_hung_running")  # counts: summed over ranks, the rest averaged
ENDINGS = ("answer", "done", "max_turns", "length", "context", "env_error")


def rows(comps: Sequence[Completion]) -> dict:
    """A step's episodes, for its row (none for single-turn completions)."""
    eps = [c.episode for c in comps if c.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    ended = collections.Counter(e.ended for e in eps)
    compared = sum(e.prefix_compared for e in eps)
    stamped = [c for c in comps if c.episode is not None and c.versions is not None]
    return {"episode/turns": sum(e.turns for e in eps) / n,
            "episode/tool_calls": sum(e.tool_calls for e in eps) / n,
            "episode/tool_errors": sum(e.tool_errors for e in eps),
            "episode/env_errors": sum(e.env_errors for e in eps),
            # episodes the environment's fault ended: no gradient, no place in their group's baseline
            "episode/masked": ended["env_error"],
            "episode/replies_cut": sum(e.replies_cut for e in eps),
            "episode/env_tokens": sum(e.env_tokens for e in eps) / n,
            **{f"episode/ended_{why}": ended[why] / n for why in ENDINGS},
            "timing/env_s": round(sum(e.env_s for e in eps), 4),
            "episode/env_hung_running": max(e.hung_running for e in eps),
            **({"replay/prefix_rerouted_frac": sum(e.prefix_rerouted for e in eps) / compared} if compared else {}),
            # in-flight updates: episodes whose sampled tokens span versions (a sync landed within them)
            **({"episode/across_versions": sum(len({v for v, m in zip(c.versions, c.mask) if m}) > 1
                                               for c in stamped) / len(stamped)} if stamped else {}),
            # what the environment's faults were, by kind (a row says why its episodes ended early)
            **({"episode/faults": dict(collections.Counter(e.fault for e in eps if e.fault))}
               if any(e.fault for e in eps) else {})}
