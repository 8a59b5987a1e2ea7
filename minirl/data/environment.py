"""The contract of a multi-turn task's environment: OpenEnv's shape, without OpenEnv installed.

An environment is any object with

    reset(seed=None, episode_id=None, **task) -> Observation     a new episode of the task's row
    step(action) -> Observation                                  one tool call, answered
    close()                                                      (optional)

and an observation any object with OpenEnv's `done`, `reward` and `metadata`, plus, for a tool's
reply, the `result` and `error` of OpenEnv's `CallToolObservation` (else `metadata["text"]`). The
actions minirl sends are `ToolCall`s, whose fields are those of OpenEnv's `CallToolAction`
(`tool_name`, `arguments`). So an OpenEnv environment class plugs in unchanged (its server side runs
in process: no Docker, no HTTP), and `openenv` stays an optional extra (it pulls in FastAPI and gradio).

How a call is written in the model's turn and a reply in the next is a `ToolFormat`: the engine
stops a turn on the call's closing token, the call is read from that turn's text alone, and only
the reply (with the template's turn close and next generation prompt around it) is tokenized, so
the tokens trained are the tokens sampled (rollout/episodes.py).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field

from minirl.errors import UsageError


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call read from a turn (OpenEnv's `CallToolAction` fields).

    Example: '<tool_call>\\n{"name": "calc", "arguments": {"expr": "12*34"}}\\n</tool_call>'
        -> ToolCall("calc", {"expr": "12*34"})"""

    tool_name: str
    arguments: dict = field(default_factory=dict)


@dataclass(slots=True)
class Observation:
    """What minirl's own environments answer (OpenEnv's `Observation` and `CallToolObservation` fields)."""

    done: bool = False
    reward: float | None = None
    metadata: dict = field(default_factory=dict)
    result: object = None
    error: str | None = None


class CallError(ValueError):
    """A turn's call that cannot be read (answered to the model as a tool error, counted)."""


def reply(obs) -> tuple[str, bool]:
    """The text the model reads of an observation, and whether it is a tool error.

    >>> reply(Observation(result=408))
    ('408', False)
    >>> reply(Observation(error="division by zero"))
    ('error: division by zero', True)
    """
    error = getattr(obs, "error", None)
    if error:  # OpenEnv's ToolError has a message
        return f"error: {getattr(error, 'message', error)}", True
    result = getattr(obs, "result", None)
    if result is None:
        result = (getattr(obs, "metadata", None) or {}).get("text", "")
    failed = bool(getattr(result, "is_error", False))  # an MCP CallToolResult the tool marked failed
    if isinstance(result, (int, float)):
        result = str(result)
    elif not isinstance(result, str):  # an MCP CallToolResult's text parts, a text, or any JSON-able value
        parts = getattr(result, "content", None)
        if isinstance(parts, list) and all(hasattr(p, "text") for p in parts):
            result = "".join(p.text for p in parts)
        else:
            result = getattr(result, "text", None) or json.dumps(result, default=str)
    return (f"error: {result}" if failed else result), failed


def action(env, call: ToolCall):
    """The action `env` takes for a call: OpenEnv's own `CallToolAction` for its MCP environments
    (which check the class; openenv is then imported already, by the environment), else the ToolCall."""
    mcp = sys.modules.get("openenv.core.env_server.mcp_environment")
    if mcp is not None and isinstance(env, mcp.MCPEnvironment):
        from openenv.core.env_server.mcp_types import CallToolAction  # openenv's own: loaded with its environment

        return CallToolAction(tool_name=call.tool_name, arguments=call.arguments)
    return call


def final_reward(obs) -> float | None:
    """The reward of an observation that ends the episode; None where it gives none. A reward that
    is not a finite number raises ValueError (the environment's fault, counted)."""
    r = getattr(obs, "reward", None)
    if r is None:
        return None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise ValueError(f"the environment's reward {r!r} is not a finite number")
    return float(r)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a turn writes a tool call and how a reply follows it.

    open, close:  the text around a call (`open` "": the turn's whole text); `close` must be one
                  token of the vocabulary (the engine stops the turn on it, and it is kept as the
                  turn's last sampled token)
    body:         "json": {"name": ..., "arguments": {...}} (Hermes, Qwen3's chat template);
                  "expr": the text itself, the argument `expr` of the one tool `tool`
    reply:        the text that follows the call, `{}` the tool's reply: the template's turn close,
                  the reply, the next generation prompt
    unreadable:   the reply to a call that cannot be read, `{}` why (a tool error the model can learn from)
    """

    open: str
    close: str
    body: str = "json"
    tool: str = ""
    reply: str = "{}"
    unreadable: str = "error: {}"

    def call(self, text: str) -> ToolCall | None:
        """The call a turn's text ends with, None where it ends without one; CallError where the
        call cannot be read.

        >>> ToolFormat("(", ")", "expr", tool="calc").call("12*34=(12*34)")
        ToolCall(tool_name='calc', arguments={'expr': '12*34'})
        >>> ToolFormat("<tool_call>", "</tool_call>").call('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
        ToolCall(tool_name='f', arguments={'x': 1})
        """
        if not text.endswith(self.close):
            return None
        start = text.rfind(self.open, 0, len(text) - len(self.close)) if self.open else 0  # "": the whole turn
        if start < 0:
            raise CallError(f"{self.close!r} without {self.open!r}")
        inner = text[start + len(self.open): len(text) - len(self.close)].strip()
        if self.body == "expr":
            return ToolCall(self.tool, {"expr": inner})
        try:
            call = json.loads(inner)
        except ValueError as e:
            raise CallError(f"the call is not JSON: {e}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise CallError('the call has no "name"')
        args = call.get("arguments", {})
        if isinstance(args, str):  # some templates write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError as e:
                raise CallError(f"the call's arguments are not JSON: {e}") from None
        if not isinstance(args, dict):
            raise CallError("the call's arguments are not an object")
        return ToolCall(call["name"], args)

    def text(self, answer: str) -> str:
        """The text that follows a call answered `answer`."""
        return self.reply.replace("{}", answer)


# Qwen3's chat template (Hermes tool calls): a call closes with the single token </tool_call>; a tool
# message is rendered inside the user turn as <tool_response>, then the assistant's generation prompt
QWEN3 = ToolFormat("<tool_call>", "</tool_call>", "json",
                   reply="<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")

# The tiny char model's (its vocabulary has no tags nor English): "(12*34)" calls the one tool, "=408;"
# answers, "=?;" says the call could not be read
TINY = ToolFormat("(", ")", "expr", tool="calc", reply="={};", unreadable="?")
TOOL_FORMATS = {"qwen3": QWEN3, "tiny": TINY}


def environment_class(name: str):
    """`module:Class` (env.name), imported; one line naming it where it cannot be, or is no environment."""
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as e:  # an import that fails in any way: the run cannot start (one line)
        where = (" (its module must be importable: installed, or its folder on PYTHONPATH)"
                 if isinstance(e, ModuleNotFoundError) and e.name == module.split(".")[0] else "")
        raise UsageError(f"env.name = {name!r} cannot be imported: {type(e).__name__}: {e}{where}") from None
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise UsageError(f"env.name = {name!r} has no {method}(): an environment has reset(seed, episode_id, **row) "
                             "and step(action) (OpenEnv's shape, docs/tasks.md)")
    return cls


def start_episode(cls, env, row: dict, *, seed: int | None, episode_id: str):
    """A new environment of `cls` with a recipe's [env] params, reset with a dataset row, built and
    reset within `env.step_timeout_s` (a server that never answers must not stall the run); one line
    where it cannot start (whatever it raises, or a hang: no episode of the run could)."""
    def build(_):
        e = cls(**env.params)
        e.reset(seed=seed, episode_id=episode_id, **row)
        return e

    try:
        return within(build, None, env.step_timeout_s)
    except TimeoutError:
        raise UsageError(f"env.name = {env.name!r} could not start an episode: its constructor and reset() took "
                         f"longer than env.step_timeout_s = {env.step_timeout_s:g} s") from None
    except Exception as err:  # noqa: BLE001 - named in the line
        raise UsageError(f"env.name = {env.name!r} could not start an episode: {type(err).__name__}: {err}") from None


def close(e) -> None:
    """An environment's `close`, where it has one (OpenEnv's is optional)."""
    done = getattr(e, "close", None)
    if callable(done):
        done()


def check_start(env, row: dict) -> None:
    """One episode of `env` (a recipe's [env]) built and reset with a dataset row, then closed: an
    environment that cannot start one stops the run before any engine starts (one line)."""
    close(start_episode(environment_class(env.name), env, row, seed=0, episode_id="preflight"))


def check_format(fmt_name: str, encode) -> None:
    """The format's closing text is one token of the model's vocabulary (the engine stops a turn on it)."""
    fmt = TOOL_FORMATS[fmt_name]
    n = len(encode(fmt.close))
    if n != 1:
        raise UsageError(f"env.tool_format = {fmt_name!r} closes a call with {fmt.close!r}, {n} tokens of this model's "
                         "vocabulary: the engine stops a turn on one token; choose the model's own format")


# What a step and an evaluation read of a completion, a multi-turn episode's (rollout/episodes.py) or
# a single turn's alike (torch-free: the CLI imports the evaluation at its start).
def answer_ids(c) -> tuple[int, ...]:
    """What the grader reads of a completion: an episode's last turn, after the last reply (the answer)."""
    if c.mask is None or 0 not in c.mask:
        return c.token_ids
    last = len(c.mask) - c.mask[::-1].index(0)
    return c.token_ids[last:]


def rewards(comps, scores) -> list[float]:
    """Each completion's R: the environment's reward where it ended the episode with one, else the
    grader's score of its answer."""
    return [c.episode.reward if c.episode is not None and c.episode.reward is not None else s.score
            for c, s in zip(comps, scores, strict=True)]


def sampled(c) -> int:
    """Tokens the engine sampled (an episode's replies left out): the length the overlong shaping reads."""
    return len(c.token_ids) if c.mask is None else sum(c.mask)


def spawn(fn, arg) -> tuple[threading.Thread, dict]:
    """`fn(arg)` started in a daemon thread of its own: the thread, and a box that gets its start
    `t0`, then its outcome (`out` or `err`) and seconds `s`."""
    box: dict = {"t0": time.perf_counter()}

    def run():
        try:
            box["out"] = fn(arg)
        except BaseException as err:  # handed to the caller, which counts it
            box["err"] = err
        finally:
            box["s"] = time.perf_counter() - box["t0"]

    t = threading.Thread(target=run, daemon=True, name="minirl-env-step")
    t.start()
    return t, box


def within(fn, arg, timeout_s: float):
    """`fn(arg)` in a thread of its own, given up after `timeout_s` (TimeoutError; the thread, which
    cannot be stopped from here, is left running as a daemon)."""
    t, box = spawn(fn, arg)
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError
    if "err" in box:
        raise box["err"]
    return box["out"]
