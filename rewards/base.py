"""The grader interface and its registry: the built-ins, then whatever the entry-point group
`minirl.graders` adds (third-party packages)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol

from minirl.errors import UsageError

GROUP = "minirl.graders"
# minirl's own graders, registered here rather than as entry points of its package metadata: they
# are there wherever minirl's folder is importable, installed or not (the GPU kit runs minirl from a
# checkout on PYTHONPATH, where entry points do not exist: #72)
BUILTIN = {
    "exact": "rewards.builtin:ExactGrader",
    "numeric": "rewards.builtin:NumericGrader",
    "regex": "rewards.builtin:RegexGrader",
    "math": "rewards.math:MathGrader",
    "arith": "rewards.builtin:ArithGrader",
    "code": "rewards.code:CodeGrader",
    "rg": "rewards.gym:GymGrader",
}


@dataclass(frozen=True, slots=True)
class Score:
    """score in [0, 1]; info holds what the grader saw (extracted answer, error, ...)."""

    score: float
    info: dict[str, Any] = field(default_factory=dict)


class Grader(Protocol):
    """A grader never raises on model output: anything unparsable scores 0 with the reason in info.

    It may say what a record must hold, `fields`: groups of field names, any one group of which,
    every field non-empty, makes a record gradable (the code grader: a test and an entry point, or
    stdin/stdout cases). A run or an eval checks its data against them before any engine starts
    (`gradable`, minirl/setup/preflight.py); a grader without `fields` is not checked."""

    def __call__(self, record: dict[str, Any], response: str) -> Score: ...


class NeedsAnswer:
    """For graders that compare a response with the record's `self.answer_field`."""

    @property
    def fields(self) -> tuple[tuple[str, ...], ...]:
        return ((self.answer_field,),)


REASONING_TAGS = ("<think>", "</think>")  # R1 and Qwen3


def reasoning_tags(tags: tuple[str, str] | list[str] | None) -> tuple[str, str] | None:
    """A grader's `reasoning_tags` parameter checked: [opening, closing], or empty/None for none
    (the whole response graded). A TypeError names a bad one (load_grader: bad reward.params)."""
    if tags and (len(tags) != 2 or not all(isinstance(t, str) and t for t in tags)):
        raise TypeError(f"reasoning_tags must be [opening, closing] tags, or [] to grade the whole response: {tags!r}")
    return tuple(tags) if tags else None


def final_part(response: str, tags: tuple[str, str] | None = REASONING_TAGS) -> str | None:
    """What a reasoning model's answer is read from (#81): after the last closing reasoning tag, or
    the whole response without tags (or with `tags` None); None where a reasoning block is left
    open (cut off mid-thought: no answer was given).

    >>> final_part("<think>maybe 5</think> 7"), final_part("draft 5</think>7"), final_part("<think>5")
    (' 7', '7', None)
    """
    if tags is None:
        return response
    opening, closing = tags
    part = response.rsplit(closing, 1)[1] if closing in response else response
    return None if opening in part else part


def gradable(record: dict[str, Any], fields: tuple[tuple[str, ...], ...]) -> bool:
    """Whether `record` holds one of the groups of `fields`, every field of it non-empty."""
    return not fields or any(all(record.get(f) is not None and str(record[f]).strip() for f in group)
                             for group in fields)


def describe(fields: tuple[tuple[str, ...], ...]) -> str:
    """"'test' and 'entry_point', or 'input_output'": the groups, for a message."""
    return ", or ".join(" and ".join(repr(f) for f in group) for group in fields)


def available() -> dict[str, Any]:
    """Name → entry point of every grader: the built-ins, and the plug-ins' (a plug-in cannot
    take a built-in's name)."""
    plugins = {ep.name: ep for ep in entry_points(group=GROUP)}
    return {**plugins, **{name: EntryPoint(name, value, GROUP) for name, value in BUILTIN.items()}}


def load_grader(name: str, params: dict[str, Any] | None = None) -> Grader:
    """Instantiate the grader registered as `name` with the recipe's `reward.params`."""
    eps = available()
    if name not in eps:
        raise UsageError(f"unknown grader {name!r}; installed: {', '.join(sorted(eps)) or 'none'}")
    ep = eps[name]
    try:
        cls = ep.load()
    except Exception as e:  # noqa: BLE001 - a plug-in's module or class that is not there: one line
        raise UsageError(f"grader {name!r} ({ep.value}) cannot be loaded: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]}") from None
    try:
        return cls(**(params or {}))
    except TypeError as e:
        raise UsageError(f"grader {name!r}: bad reward.params: {e}") from None
    except Exception as e:  # noqa: BLE001 - a constructor that raises: one line naming it
        raise UsageError(f"grader {name!r} ({ep.value}) failed to start: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]}") from None
