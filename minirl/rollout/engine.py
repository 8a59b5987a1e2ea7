"""The rollout engine's contract: what the run's step, the held-out evaluation, export and the
doctor ask of an engine (`Engine`), what it answers (`Completion`), and how the engine the recipe
names is built in this process (`build`; the factory every caller uses, in this process or in one
of its own, is `minirl.rollout.make_engine`).

An engine samples completions with the log-probabilities of what it sampled (log μ, the IS
correction's denominator) and, for R3, the experts it routed every fed position to; scores given
responses; takes the trainer's weights in place (`sync.py` streams them, or hands views it may keep
and re-read); and may free its memory between rollouts (`sleep`, `wake`). A second engine is one
module implementing `Engine` and one line in minirl/config/engines.py (`rollout.engine` names it; the
validator takes its choices from there); tests/test_rollout.py runs the step on a double of it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from minirl.config.engines import ENGINES


@dataclass(frozen=True, slots=True)
class Truncation:
    """How a sample's distribution is cut after its temperature, as vLLM's sampler cuts it: min-p, then
    top-k and top-p (each off at its default). A token's log μ is the cut distribution's, renormalized over
    the tokens it keeps (rollout/cpu/logprobs.py)."""

    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0

    @classmethod
    def of(cls, settings) -> "Truncation":
        """The cuts a recipe section names (`[rollout]`'s or `[eval]`'s top_p, top_k, min_p)."""
        return cls(top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p)

    @property
    def cuts(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def kw(self) -> dict:
        """`generate`'s keyword for these cuts, none where nothing is cut (an engine double need not take it)."""
        return {"truncation": self} if self.cuts else {}


NO_CUT = Truncation()


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled response.

    token_ids:    [L] int, the generated tokens (EOS included when the model stopped)
    logprobs:     [L] float, log μ_θold(y_t | x, y_<t) of each sampled token, from the rollout engine
    finish:       "stop" (EOS) or "length" (cut at max_tokens)

    Example: prompt "12+34=" -> token_ids [7, 9, 2] ("46<eos>"), logprobs [-0.11, -0.35, -0.02].
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str
    routes: object = None  # R3: np.int16 [len(prompt) + len(response) − 1, n_moe_layers, top_k], else None
    # [L] the policy version whose weights sampled each token (the versions the engine was told of,
    # `set_version`; with rollout.inflight_updates a batch's tokens may span several), else None
    versions: tuple[int, ...] | None = None
    preempted: int = 0  # times the scheduler preempted the request that sampled it (its KV cache recomputed)
    # R3: draws of this sample thrown away because a preemption recomputed their routes (rollout/vllm.py)
    regenerated: int = 0
    # [L] a multi-turn episode's (rollout/episodes.py): 1 where the engine sampled the token, 0 where an
    # environment's reply put it (no μ, no loss); None: every token sampled (one turn)
    mask: tuple[int, ...] | None = None
    episode: "EpisodeInfo | None" = None  # what the episode's turns did (multi-turn only)
    # [L] how many tokens the sampler's cut (top-k, top-p, min-p) kept where each token was drawn, the
    # kept set being that many of the most likely (0: nothing cut there); None: nothing cut anywhere
    kept: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class EpisodeInfo:
    """A multi-turn episode's own record (rollout/episodes.py).

    turns:        engine calls that sampled its tokens
    tool_calls:   calls the model made (answered with a reply or an error, or given to a faulty environment)
    tool_errors:  calls whose reply was an error (the model's call unreadable, the tool's own error)
    env_errors:   the environment's own faults (at most one an episode: its first): raised, hung past
                  its limit, an observation it could not read, a non-finite reward, a start that
                  failed; or a `close` that raised or hung once the episode had ended
    env_s:        seconds of the environment's calls (start, steps, close)
    env_tokens:   tokens of the environment's replies
    reward:       the environment's reward when it ended the episode (`done` with a reward), else None
    ended:        "answer" (a turn ended without a call), "done" (the environment), "max_turns" (a call
                  at the turn limit), "length" (the token budget), "context" (no room for a reply),
                  "env_error" (the environment's fault: the episode trains on nothing)
    fault:        the environment's fault (or its close's), in a few words
    replies_cut:  replies cut to fit env.max_reply_tokens or the context
    step_rewards: every reward the environment gave, in order (the final one included)
    prefix_compared, prefix_rerouted: R3, positions whose rows a later turn's prefill recomputed, and
                  how many of them it routed otherwise than the rows kept
    hung_running: calls of the process's environments given up on and still running as its batch ended
    """

    turns: int
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    env_s: float = 0.0
    env_tokens: int = 0
    reward: float | None = None
    ended: str = "answer"
    fault: str = ""
    replies_cut: int = 0
    step_rewards: tuple[float, ...] = ()
    prefix_compared: int = 0
    prefix_rerouted: int = 0
    hung_running: int = 0


@runtime_checkable
class Engine(Protocol):
    """What minirl asks of a rollout engine (vllm.py's `VLLMEngine`, or process.py's `EngineProcess`
    around one). The weight sync reads three attributes: the dtype it casts to, whether the engine
    emulates FP8 (the sync then rounds the weights itself) and the format it rounds them to."""

    torch_dtype: torch.dtype
    emulate_fp8: bool
    weight_format: str

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, max_tokens: int,
                 seed: int | None = None, seeded_requests: bool = False,
                 truncation: Truncation = NO_CUT) -> list[list[Completion]]:
        """n completions per prompt, [len(prompts)][n], in prompt order; `seed` makes a call repeat.
        `seeded_requests`: each prompt's samples from a generator of its own, so that they do not
        depend on which other requests the engine holds (the held-out evaluation, #74). `truncation`:
        min-p, top-k and top-p after the temperature (an evaluation's sampler settings)."""

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """log μ of each given response token under the weights last synced."""

    def load_weights(self, hf_named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Every weight in place (HF names), consumed as a stream; every weight it holds written,
        in its shape, or an errors.EngineFault naming what was not (coverage.py). `version`: the
        policy version they are, set in the same call: no token sampled with the new weights
        carries the old version."""

    def load_live_weights(self, views: dict[str, torch.Tensor], key: int = 0, *, version: int | None = None) -> bool:
        """Copy from HF-named views of the trainer's parameters it may keep between syncs; False
        where it cannot (the caller then streams `load_weights`). `version` as there."""

    def set_version(self, version: int) -> None:
        """The policy version of the weights it holds (a resumed run's), which the tokens it samples next carry."""

    def settle(self) -> None:
        """Return once the last sync is written whole."""

    def sleep(self) -> None:
        """Free the engine's memory for training (a no-op where there is no sleep mode)."""

    def wake(self) -> None:
        """Take it back (the sync wakes an engine that dropped its weights)."""


def engine_class(name: str):
    """The class `rollout.engine = name` builds (minirl/config/engines.py; imported only when asked: vLLM
    is heavy). Each has `from_config(model_dir, rollout, **settings)`."""
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build(model_dir: Path, rollout, *, seed: int, max_model_len: int, **settings) -> Engine:
    """The engine the recipe's [rollout] section names, for `model_dir`, in this process: the
    factory's in-process half (`minirl.rollout.make_engine` is the factory every caller uses; the
    engine's own process calls this). `settings` add to or replace what [rollout] says (a caller's
    own context length, sequences at once, routes, sleep level, share of the GPU)."""
    return engine_class(rollout.engine).from_config(Path(model_dir), rollout, seed=seed, max_model_len=max_model_len,
                                                    **settings)
