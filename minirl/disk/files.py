"""JSON files minirl reads back (checkpoint records, model configs): one line naming the file when
one is missing or broken, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from minirl.errors import UsageError


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; anything else is one UsageError line naming the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{what}: {path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{what}: {path} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what}: {path} must hold a JSON object, not {type(data).__name__}")
    return data


def json_or_empty(path: Path) -> dict:
    """A JSON object from `path`, or {} where it is missing, unreadable or not an object (for what
    only reports, or decides from what is there)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
