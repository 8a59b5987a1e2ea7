"""Every observation a user's environment returns, read the same way: the text the model reads,
whether it is a tool error, whether the episode is done, and the reward.

The rule (docs/tasks.md), first match wins:

    a StepResult (OpenEnv's client: `observation`, `reward`, `done`)   its observation read, its own
                                                                        reward and done taking precedence
    a gym step tuple (obs, reward, terminated, truncated, info)         obs read; done = terminated or
        or (obs, reward, done, info), or its reset's (obs, info)        truncated
    a str / bytes / a number                                            the text itself
    a dict with an observation's keys (done, reward, result, error,     read as those fields
        observation, metadata); an MCP result's dict (content, isError)
    an object with an observation's fields (OpenEnv's Observation and   `error` set: "error: …", a tool
        its subclasses, dataclasses, pydantic models)                   error; else `result` (an MCP
                                                                        CallToolResult's text parts and
                                                                        is_error); else the object's own
                                                                        fields that hold something (not
                                                                        None, not empty): one alone as
                                                                        its text, several as `name:
                                                                        value` lines; else metadata["text"]
    anything else (None, a coroutine nobody awaited, an object of       refused: `Unreadable`, naming the
        none of these shapes)                                           type (the environment's fault)

Values that are not text are written as JSON (numpy scalars and arrays as their numbers, never quoted).
A reward may be a bool, an int, a float, a numpy scalar or any finite real; None is no reward; a
non-finite or non-numeric one is the environment's fault.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass

OWN = ("done", "reward", "metadata")  # an observation's fields that are not what the model reads
FIELDS = {"done", "reward", "result", "error", "observation", "metadata"}
MAX_FIELD_CHARS = 100_000  # of one value written as text: a reply is cut far below (formats.py), this bounds the work


class Unreadable(TypeError):
    """An observation minirl cannot read (the environment's fault: its episode ends, counted)."""


@dataclass(frozen=True, slots=True)
class Reading:
    """An observation as the turn loop uses it.

    text:    what the model reads (a tool error's "error: …" included)
    error:   a tool error (the call failed as the model wrote it: answered, the episode goes on)
    done:    the environment ended the episode
    reward:  its reward, or None
    """

    text: str
    error: bool = False
    done: bool = False
    reward: float | None = None


def read(obs) -> Reading:
    """One observation, by the module's rule.

    >>> read("=408;")
    Reading(text='=408;', error=False, done=False, reward=None)
    >>> read(({"board": [1, 2]}, True, True, False, {}))
    Reading(text='{"board": [1, 2]}', error=False, done=True, reward=1.0)
    """
    if _is_step_result(obs):
        inner = read(obs.observation) if obs.observation is not None else Reading("")
        r = reward_of(obs.reward) if obs.reward is not None else inner.reward
        return Reading(inner.text, inner.error, bool(obs.done) or inner.done, r)
    if isinstance(obs, tuple) and len(obs) == 2 and not hasattr(obs, "_fields"):  # gym's reset: (obs, info)
        return Reading(text_of(obs[0]))
    if isinstance(obs, tuple) and len(obs) in (4, 5) and not hasattr(obs, "_fields"):  # gym's step tuple
        done = bool(obs[2]) or (len(obs) == 5 and bool(obs[3]))
        return Reading(text_of(obs[0]), done=done, reward=reward_of(obs[1]))
    if isinstance(obs, (str, bytes, numbers.Number)) or _numpy_scalar(obs):
        return Reading(text_of(obs))
    if isinstance(obs, dict):
        if FIELDS & set(obs):
            return _fields(obs.get, {k: v for k, v in obs.items() if k not in FIELDS})
        if _mcp_result(obs):
            return Reading(*_mcp_text(obs))
        return Reading(text_of(obs))
    if any(hasattr(obs, f) for f in ("done", "reward", "result", "error")) and not isinstance(obs, type):
        return _fields(lambda f, default=None: getattr(obs, f, default), _own_fields(obs))
    if hasattr(obs, "__await__"):
        raise Unreadable(f"step returned an awaitable ({type(obs).__name__}) that was never awaited")
    raise Unreadable(f"an observation of type {type(obs).__name__} (not an Observation, a StepResult, a str, a dict, "
                     "a number or a gym step tuple: docs/tasks.md)")


def reward_of(r) -> float | None:
    """A reward as a float (None: no reward); ValueError where it is not a finite real.

    >>> reward_of(True), reward_of(3), reward_of(None)
    (1.0, 3.0, None)
    """
    if r is None:
        return None
    if _numpy_scalar(r) or (hasattr(r, "item") and getattr(r, "ndim", None) == 0):
        r = r.item()
    if not isinstance(r, numbers.Real):
        raise ValueError(f"the environment's reward {r!r} ({type(r).__name__}) is not a number")
    value = float(r)
    if not math.isfinite(value):
        raise ValueError(f"the environment's reward {r!r} is not a finite number")
    return value


def text_of(value) -> str:
    """A value the model reads, as text: a str as it is, bytes decoded, an MCP result's text parts,
    anything else as JSON (numpy's numbers as numbers).

    >>> text_of(408), text_of({"a": 1}), text_of(b"ok")
    ('408', '{"a": 1}', 'ok')
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value[:MAX_FIELD_CHARS]).decode("utf-8", "replace")
    if _mcp_result(value):
        return _mcp_text(value)[0]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, BaseException):  # a tool's error given as the exception itself
        return f"{type(value).__name__}: {value}"
    if isinstance(value, numbers.Number) or _numpy_scalar(value):
        value = _plain(value)
        if isinstance(value, int) and value.bit_length() > 10_000:  # past what str() of an int writes
            return f"an integer of {value.bit_length()} bits"
        return str(value)
    return json.dumps(value, default=_plain, ensure_ascii=False)[:MAX_FIELD_CHARS]


def _fields(get, own: dict) -> Reading:
    """An observation read through `get(field, default)`; `own`: its fields beyond OpenEnv's."""
    done, r = bool(get("done", False)), reward_of(get("reward", None))
    error = get("error", None)
    if error:  # OpenEnv's ToolError has a message
        return Reading(f"error: {text_of(getattr(error, 'message', error))}", True, done, r)
    result = get("result", None)
    if result is not None:
        text, failed = _mcp_text(result) if _mcp_result(result) else (text_of(result), False)
        return Reading(f"error: {text}" if failed else text, failed, done, r)
    inner = get("observation", None)
    if inner is not None:
        return Reading(read(inner).text, False, done, r)
    shown = {k: v for k, v in own.items() if k != "tool_name" and v is not None
             and not (isinstance(v, (str, bytes, list, tuple, dict)) and not v)}
    if len(shown) == 1:
        return Reading(text_of(next(iter(shown.values()))), False, done, r)
    if shown:
        return Reading("\n".join(f"{k}: {text_of(v)}" for k, v in shown.items()), False, done, r)
    meta = get("metadata", None)
    return Reading(text_of(meta.get("text", "")) if isinstance(meta, dict) else "", False, done, r)


def _own_fields(obs) -> dict:
    """An observation object's fields beyond OpenEnv's (a pydantic model's, a dataclass's, or its attributes)."""
    fields = getattr(type(obs), "model_fields", None)  # pydantic
    if isinstance(fields, dict):
        names = list(fields)
    elif dataclasses.is_dataclass(obs):
        names = [f.name for f in dataclasses.fields(obs)]
    else:
        names = [k for k in getattr(obs, "__dict__", {}) if not k.startswith("_")]
    return {k: getattr(obs, k, None) for k in names if k not in FIELDS}


def _is_step_result(obs) -> bool:
    """OpenEnv's client `StepResult` (observation, reward, done), and objects of its shape."""
    return not isinstance(obs, (dict, tuple, str)) and all(hasattr(obs, f) for f in ("observation", "reward", "done")) \
        and not hasattr(obs, "result")


def _mcp_result(value) -> bool:
    """An MCP `CallToolResult`: the object (`content` of text parts), or its JSON over a client."""
    if isinstance(value, dict):
        marks = {"isError", "is_error", "structuredContent"}
        return isinstance(value.get("content"), list) and bool(marks & set(value) or not set(value) - {"content"})
    parts = getattr(value, "content", None)
    return isinstance(parts, list) and hasattr(value, "is_error")


def _mcp_text(value) -> tuple[str, bool]:
    """An MCP result's text parts joined, and whether the tool marked it failed."""
    if isinstance(value, dict):
        parts, failed = value["content"], bool(value.get("isError", value.get("is_error", False)))
        texts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in parts]
    else:
        parts, failed = value.content, bool(value.is_error)
        texts = [getattr(p, "text", None) for p in parts]
    if all(isinstance(t, str) for t in texts):
        return "".join(texts), failed
    data = value.get("structuredContent") if isinstance(value, dict) else getattr(value, "structured_content", None)
    return (text_of(data) if data is not None else json.dumps([_plain(p) for p in parts], default=_plain)), failed


def _numpy_scalar(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0


def _plain(value):
    """A JSON encoder's fallback: numpy's and torch's numbers and arrays as lists and numbers, pydantic
    models and dataclasses as their fields, anything else as its str."""
    if isinstance(value, (int, float)):
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return str(value)
