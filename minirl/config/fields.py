"""A recipe's typed fields: each declares its own range, choices or rule (`number`, `one_of`, `rule`),
and `check_fields` checks a dataclass of them, failing in one line naming the key."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

from minirl.errors import UsageError


def number(default: float, lo: float = -math.inf, hi: float | Callable[[], float] = math.inf, *,
           above: bool = False) -> Any:
    """A numeric field: finite, ≥ lo (> lo with `above`) and ≤ hi (a callable: read when checked)."""
    return field(default=default, metadata={"range": (lo, hi, not above)})


def one_of(default: str, names) -> Any:
    """A field naming one of `names`: a registry (a mapping, read when checked: a test may add to
    it) or a fixed list."""
    return field(default=default, metadata={"choices": names if isinstance(names, Mapping) else tuple(names)})


def rule(default: Any, check: Callable[[str, Any], str | None], lo: float | None = None,
         hi: float | Callable[[], float] = math.inf) -> Any:
    """A field with its own rule: `check(key, value)` returns the message of a bad value, or None;
    numbers may also carry a range, checked after it."""
    meta: dict[str, Any] = {"rule": check}
    if lo is not None:
        meta["range"] = (lo, hi, True)
    return field(default=default, metadata=meta)


def _finite(v: Any) -> bool:
    return isinstance(v, bool) or not isinstance(v, (int, float)) or math.isfinite(v)


def check_fields(obj: Any, prefix: str = "") -> None:
    """Every field of `obj` (a Recipe or one section) against what it declares; fails naming its key."""
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
            continue
        if not _finite(value):
            raise UsageError(f"{key} = {value}; it must be a finite number")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise UsageError(f"{key} = {value!r}; choose one of {', '.join(f.metadata['choices'])}")
        if "rule" in f.metadata and (message := f.metadata["rule"](key, value)):
            raise UsageError(message)
        if "range" in f.metadata:
            lo, hi, lo_ok = f.metadata["range"]
            hi = hi() if callable(hi) else hi
            if value < lo or (value == lo and not lo_ok) or value > hi:
                lower = f"≥ {lo}" if lo_ok else f"> {lo}"
                upper = f" and ≤ {hi}" if math.isfinite(hi) else ""
                raise UsageError(f"{key} = {value}; it must be {lower}{upper}")
