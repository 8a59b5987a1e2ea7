"""The grader interface and its registry (entry-point group `minirl.graders`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

from minirl.errors import UsageError

GROUP = "minirl.graders"


@dataclass(frozen=True, slots=True)
class Score:
    """score in [0, 1]; info holds what the grader saw (extracted answer, error, ...)."""

    score: float
    info: dict[str, Any] = field(default_factory=dict)


class Grader(Protocol):
    """A grader never raises on model output: anything unparsable scores 0 with the reason in info."""

    def __call__(self, record: dict[str, Any], response: str) -> Score: ...


def available() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_grader(name: str, params: dict[str, Any] | None = None) -> Grader:
    """Instantiate the grader registered as `name` with the recipe's `reward.params`."""
    eps = available()
    if name not in eps:
        raise UsageError(f"unknown grader {name!r}; installed: {', '.join(sorted(eps)) or 'none'}")
    cls = eps[name].load()
    try:
        return cls(**(params or {}))
    except TypeError as e:
        raise UsageError(f"grader {name!r}: bad reward.params: {e}") from None
