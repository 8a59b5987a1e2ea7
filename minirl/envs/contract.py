"""The contract of a multi-turn task's environment: OpenEnv's shape, with or without OpenEnv installed.

An environment is any importable class (`env.name = "module:Class"`, `env.params` its constructor's
keyword arguments), what an importable factory builds (a callable that is not a class: TRL's
`environment_factory`, `env.params` its arguments), or an importable list of tool functions (TRL's
`tools=`: no state, nothing to reset; `tool_functions`), with

    reset(seed=None, episode_id=None, **row) -> observation     a new episode of the task's row
    step(action, timeout_s=None) -> observation                 one tool call, answered
    close()                                                      (optional)

Each method is given only the keyword arguments its signature takes, as OpenEnv's own server does
(`def reset(self)` is valid OpenEnv); any of them may be `async def`. The action minirl sends is a
`ToolCall`, whose fields are those of OpenEnv's `CallToolAction` (`tool_name`, `arguments`); an OpenEnv
`MCPEnvironment` gets OpenEnv's own `CallToolAction` (it checks the class). What an observation may be
is observations.py's; how each environment is hosted, hosting.py's.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import sys
import typing
from dataclasses import dataclass, field

from minirl.errors import UsageError


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call read from a turn (OpenEnv's `CallToolAction` fields).

    Example: '<tool_call>\\n{"name": "calc", "arguments": {"expr": "12*34"}}\\n</tool_call>'
        -> ToolCall("calc", {"expr": "12*34"})"""

    tool_name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Message:
    """A turn without a call, said to an environment that answers every turn (`env.replies_to = "turns"`:
    a game, a simulated user): the model's words, its reasoning left out."""

    content: str


@dataclass(slots=True)
class Observation:
    """What minirl's own environments answer (OpenEnv's `Observation` and `CallToolObservation` fields)."""

    done: bool = False
    reward: float | None = None
    metadata: dict = field(default_factory=dict)
    result: object = None
    error: str | None = None


def environment_class(name: str):
    """`module:Class` (env.name), imported; one line naming it where it cannot be, or is no environment.
    A callable that is not a class is a factory (TRL's `environment_factory`: it builds and returns an
    environment, `env.params` its arguments); what it builds is checked when it has built one
    (`check_built`: the run's preflight starts one episode). A list of functions is TRL's `tools=`: the class
    `tool_functions` makes of it."""
    cls = _imported("env.name", name)
    if isinstance(cls, (list, tuple)):
        return tool_functions(name, cls)
    if isinstance(cls, type) and (missing := _missing(cls)):
        raise UsageError(f"env.name = {name!r} has no {missing}: {_SHAPES}")
    if not callable(cls):
        raise UsageError(f"env.name = {name!r} is a {type(cls).__name__}: name an environment class, a function that "
                         "builds one (TRL's environment_factory; one environment a run, not a dict of them), or a list "
                         "of tool functions (TRL's tools=)")
    return cls


def _imported(key: str, name: str):
    """`module:attr` imported, or one line naming the recipe's `key`."""
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except BaseException as e:  # an import that fails in any way, SystemExit included: the run cannot start (one line)
        if isinstance(e, KeyboardInterrupt):
            raise
        where = (" (its module must be importable: installed, or its folder on PYTHONPATH)"
                 if isinstance(e, ModuleNotFoundError) and e.name == module.split(".")[0] else "")
        raise UsageError(f"{key} = {name!r} cannot be imported: {type(e).__name__}: {e}{where}") from None


def tool_functions(name: str, functions) -> type:
    """TRL's standalone `tools=[f, g]` as an environment class of the TRL kind: each function (sync or
    async) a tool under its own name, its JSON schema read from its signature and docstring as TRL reads
    it; no state, `reset` says nothing, no reward of its own (the task's grader scores the answer).
    One line where a tool could not be told to the model: not a function, a name twice, a name TRL's rule
    for a class's tools would not list (`reset`, `get_reward`, a private one)."""
    if not functions:
        raise UsageError(f"env.name = {name!r} is an empty list: name a list of tool functions (TRL's tools=)")
    tools: dict = {}
    for f in functions:
        if isinstance(f, type) or not callable(f) or not hasattr(f, "__name__"):
            raise UsageError(f"env.name = {name!r} lists {f!r}, which is not a function: a list names tool "
                             "functions (TRL's tools=)")
        tool = f.__name__
        if tool in tools:
            raise UsageError(f"env.name = {name!r} lists two functions named {tool!r}: the model calls a tool by its "
                             "name, rename one")
        if tool in ("reset", "get_reward") or tool.startswith("_"):
            raise UsageError(f"env.name = {name!r} lists a function named {tool!r}, a name TRL's rule keeps out of an "
                             "environment's tools: rename it")
        tools[tool] = staticmethod(f if inspect.isfunction(f) else _as_function(f))
    body = {**tools, "reset": lambda self, **row: None, "__doc__": f"The tool functions of {name} (TRL's tools=).",
            "__tool_functions__": tuple(tools)}  # in the list's order, as TRL tells them to the model
    return type(name.partition(":")[2] or "tools", (), body)


def _as_function(f):
    """A callable that is no plain function (a bound method) as one, its signature and docstring its own:
    what a class's tools are read as (`public_tools`)."""

    @functools.wraps(f)
    def tool(*args, **kwargs):
        return f(*args, **kwargs)

    return tool


def main_thread_only(err: BaseException) -> bool:
    """Python's refusal to set a signal handler off a process's main thread (a tool's own timeout by
    SIGALRM, as TRL's example tools write one): where the environment runs, never what the model asked."""
    return isinstance(err, ValueError) and str(err).endswith("only works in main thread of the main interpreter")


def reward_function(name: str):
    """`module:function` (env.reward_func), imported: a TRL reward function that reads the environment; one
    line where it cannot be, or is no function."""
    fn = _imported("env.reward_func", name)
    if isinstance(fn, type) or not callable(fn):
        raise UsageError(f"env.reward_func = {name!r} is a {type(fn).__name__}: name a reward function, "
                         "reward_func(environments, **kwargs) as TRL's take them")
    return fn


# what TRL gives a reward function that minirl does not: the texts are the grader's to read (reward.grader)
_TEXTS = ("prompts", "completions", "completion_ids")
# a row's fields a reward function is not given: its prompt (TRL passes it as `prompts`), minirl's own two
NOT_GIVEN = ("prompt", "seed", "episode_id")


def check_reward_function(name: str, fn, row: dict) -> None:
    """A reward function that needs what minirl does not give it (the prompts and completions TRL passes, or
    a field the rows lack) refused in one line before any engine starts; minirl gives `environments` and the
    row's fields, each as a list of one, as TRL gives its dataset's columns."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    given = {"environments", *(k for k in row if k not in NOT_GIVEN)}
    needed = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
              and p.name not in given]
    if needed:
        what = ("the texts, which a grader scores (reward.grader)" if needed[0] in (*_TEXTS, "prompt")
                else "a field the rows do not have")
        raise UsageError(f"env.reward_func = {name!r} takes {needed[0]!r}, {what}: minirl calls it on the "
                         "environment's worker with environments=[env] and the row's fields")


def scores_itself(env) -> bool:
    """Whether a recipe's [env] gives every episode its R, so that its rows need no answer (TRL's environment
    examples' datasets hold a prompt alone): env.reward_func, or a class with its own `get_reward` (TRL's)."""
    if not env.name:
        return False
    return bool(env.reward_func) or callable(getattr(environment_class(env.name), "get_reward", None))


def check_built(env) -> None:
    """What a factory (env.name a callable, not a class) built: an environment, else TypeError naming it."""
    if missing := _missing(type(env)):
        raise TypeError(f"the factory built a {type(env).__name__}, which has no {missing}: {_SHAPES}")


_SHAPES = ("an environment has reset(seed, episode_id, **row) and step(action) (OpenEnv's shape), or reset(**row) "
           "and public methods as its tools (a TRL environment_factory class): docs/tasks.md")


def _missing(cls: type) -> str:
    """What an environment class lacks ("" where nothing)."""
    if not callable(getattr(cls, "reset", None)):
        return "reset()"
    return "" if callable(getattr(cls, "step", None)) or public_tools(cls) else "step() (nor public methods as tools)"


def public_tools(cls: type) -> list[str]:
    """TRL's own rule for an environment class's tools: its functions, but `reset`, `get_reward` and the
    private ones (by name, as `inspect.getmembers` gives them); a list of tool functions' in its own order."""
    if listed := getattr(cls, "__tool_functions__", None):
        return list(listed)
    return [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")]


def check_params(name: str, cls, params: dict) -> None:
    """`env.params` against the class's constructor (a factory's own arguments): a key it does not take is
    one line naming the key (before any environment is built); a constructor that takes **kwargs, or has
    no signature to read, takes any."""
    taken = accepted(cls, params)
    odd = [k for k in params if k not in taken]
    if odd:
        try:
            names = [p.name for p in inspect.signature(cls).parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        except (TypeError, ValueError):
            names = []
        what = f"the constructor of {name}" if isinstance(cls, type) else name  # else a factory's own arguments
        if getattr(cls, "__tool_functions__", None):
            what = f"{name}, a list of tool functions,"
        raise UsageError(f"env.params.{odd[0]}: {what} takes no {odd[0]!r} "
                         f"({'its keyword arguments: ' + ', '.join(names) if names else 'it takes none'})")


def accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments of `kwargs` that `fn`'s signature takes (all of them where it has **kwargs,
    or where it has no signature to read): OpenEnv's own rule for `reset` and `step`.

    >>> accepted(lambda seed=None: 0, {"seed": 1, "episode_id": "a"})
    {'seed': 1}
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or an extension type: nothing to read, everything passed
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name for p in params if p.kind in by_name}
    return {k: v for k, v in kwargs.items() if k in named}


def action(env, call: ToolCall):
    """The action `env` takes for a call: OpenEnv's own `CallToolAction` for its MCP environments
    (which check the class; openenv is then imported already, by the environment), else the ToolCall."""
    mcp = sys.modules.get("openenv.core.env_server.mcp_environment")
    if mcp is not None and isinstance(env, mcp.MCPEnvironment):
        from openenv.core.env_server.mcp_types import CallToolAction  # openenv's own: loaded with its environment

        return CallToolAction(tool_name=call.tool_name, arguments=call.arguments)
    return call


def episode_seed(seed: int | None, i: int, j: int) -> int | None:
    """The seed `reset` gets for episode j of prompt i of a batch seeded `seed`: within [0, 2³²) (what
    numpy's `seed` takes), every episode of a batch its own, the same in a repeated batch.

    >>> episode_seed(5, 0, 1) != episode_seed(5, 1, 0), 0 <= episode_seed(2**62, 3, 4) < 2**32
    (True, True)
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}/{i}/{j}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True, slots=True)
class Concurrency:
    """What an environment class says of how it may run (OpenEnv's class flags, where it sets them).

    one_at_a_time:  `SUPPORTS_CONCURRENT_SESSIONS = False`: one instance alive at a time (OpenEnv's
                    server then allows one session); a class that does not say (no OpenEnv base) runs
                    as many as `env.max_concurrency` allows
    one_thread:     `REQUIRES_SINGLE_THREAD_EXECUTOR = True`: every instance's calls on one thread, one
                    after another (OpenEnv's server shares one single-thread executor among its sessions)
    """

    one_at_a_time: bool = False
    one_thread: bool = False

    @classmethod
    def of(cls, env_ref) -> "Concurrency":
        """The flags of `env_ref`'s class: a class's own, a factory's where it says which class it builds (a
        `functools.partial` of one, a function annotated to return one); else none said."""
        env_cls = env_ref
        if not isinstance(env_ref, type):
            try:
                built = typing.get_type_hints(env_ref).get("return")
            except Exception:  # noqa: BLE001 - annotations that do not resolve, or none to read: none said
                built = None
            env_cls = getattr(env_ref, "func", built)
        says = getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", None)
        return cls(one_at_a_time=says is not None and not says,
                   one_thread=bool(getattr(env_cls, "REQUIRES_SINGLE_THREAD_EXECUTOR", False)))
