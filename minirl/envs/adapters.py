"""The environments users already have, each spoken to in its own terms (#96). `kind_of(cls)` picks one:

    Native    minirl's own shape: `reset(seed, episode_id, **row)`, `step(action)` taking a `ToolCall`
              (tool_name, arguments), or a `Message` (a turn without a call, `env.replies_to = "turns"`).
              No tools it can list (the recipe's format names them).
    OpenEnv   an `openenv` `Environment` in process. An `MCPEnvironment` is stepped with OpenEnv's own
              `CallToolAction`, its tools listed with `ListToolsAction`. Any other is stepped with its
              own `Action` class (its `step`'s annotation, else the class's generic argument), built from
              the call's arguments and validated there: a validation error is the tool's error reply (the
              model's mistake, answered); its one tool is the action class (its name without "Action",
              snake_case; its docstring; its JSON schema). A turn without a call (`env.replies_to =
              "turns"`) fills the action's one text field. Its `rubric` gives the reward of an observation
              that has none.
    TRL       a TRL `environment_factory` class (no `step`): its public methods are the tools (schemas from
              their signatures and docstrings, as transformers writes them), `reset(**row) -> str | None`,
              an optional `get_reward()` the episode's reward; a tool that raises is answered with its
              error (the model's call failed, not the environment), in TRL's words. Kept between
              episodes, as TRL pools them. A factory (a callable that is not a class) is spoken to as
              what it builds.

Every kind's reset observation is read (observations.py): the model reads it after its prompt. Its
tools (`tools`) are OpenAI-style function schemas, what a chat template's `tools=` renders. All of this
runs on the environment's worker (hosting.py), in its thread or process.
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
import warnings

from minirl.envs.contract import Message, ToolCall, accepted, action, main_thread_only, public_tools
from minirl.envs.observations import Reading, read, reward_of, text_of


def kind_of(cls) -> "Native":
    """The adapter for an environment class (its kind decided by what it is, never by its name)."""
    env_mod = sys.modules.get("openenv.core.env_server.interfaces")
    if env_mod is not None and isinstance(cls, type) and issubclass(cls, env_mod.Environment):
        return OpenEnv(cls)
    client_mod = sys.modules.get("openenv.core.env_client")
    if client_mod is not None and isinstance(cls, type) and issubclass(cls, client_mod.EnvClient):
        return Client(cls)
    if not callable(getattr(cls, "step", None)) and callable(getattr(cls, "reset", None)):
        return TRL(cls)
    return Native()


class Native:
    """minirl's own contract (OpenEnv's shape without OpenEnv)."""

    name = "minirl"
    reusable = False  # an environment kept for the worker's next episode (a client's session)

    def build(self, cls, params: dict):
        return cls(**params)

    def reset(self, session, kw: dict) -> str:
        """The reset observation's text ("" where it gives none)."""
        obs = session.resolve(session.env.reset(**accepted(session.env.reset, kw)))
        return "" if obs is None else read(obs).text

    def act(self, session, call: ToolCall, timeout_s: float) -> Reading:
        env = session.env
        obs = session.resolve(env.step(action(env, call), **accepted(env.step, {"timeout_s": timeout_s})))
        return read(obs)

    def tools(self, session) -> list[dict]:
        return []

    def reward(self, session) -> float | None:
        return None

    def close(self, session) -> None:
        done = getattr(session.env, "close", None)
        if callable(done):
            session.resolve(done())

    dispose = close  # what ends a kept environment (a reusable kind's)


class OpenEnv(Native):
    """An `openenv` `Environment` in process: MCP, or stepped with its own action class."""

    name = "openenv"

    def __init__(self, cls):
        self.mcp = self.is_mcp(cls)
        self.action_cls = None if self.mcp else action_type(cls)
        if not self.mcp and self.action_cls is None:
            raise TypeError(f"{cls.__name__}.step takes an action of no class minirl can find: annotate it "
                            "(def step(self, action: MyAction)) or subclass Environment[MyAction, …]")

    @staticmethod
    def is_mcp(cls) -> bool:
        from openenv.core.env_server.mcp_environment import MCPEnvironment  # openenv is loaded: cls is one of its

        return issubclass(cls, MCPEnvironment)

    @property
    def tool_name(self) -> str:
        return tool_name(self.action_cls)

    def act(self, session, call: ToolCall | Message, timeout_s: float) -> Reading:
        env = session.env
        if isinstance(call, Message):  # the model's turn, as the environment's own action of one text field
            if self.mcp:
                raise TypeError("an MCP environment answers tool calls, not turns: env.replies_to = 'calls'")
            act = self.action_cls.model_validate({text_field(self.action_cls): call.content})
        elif self.mcp:
            from openenv.core.env_server.mcp_types import CallToolAction  # openenv is loaded: env is one of its

            act = CallToolAction(tool_name=call.tool_name, arguments=call.arguments)
        else:
            if call.tool_name != self.tool_name:
                return Reading(f"error: no tool {call.tool_name!r}: the tool is {self.tool_name!r}", error=True)
            try:
                act = self.action_cls.model_validate(call.arguments)
            except Exception as err:  # noqa: BLE001 - pydantic's ValidationError: the call's arguments, the model's
                return Reading(f"error: {_validation_text(err)}", error=True)
        obs = session.resolve(env.step(act, **accepted(env.step, {"timeout_s": timeout_s})))
        got = read(obs)
        rubric = getattr(env, "rubric", None)
        if got.reward is None and rubric is not None:  # the environment did not apply its rubric itself
            got = Reading(got.text, got.error, got.done, reward_of(session.resolve(rubric(act, obs))))
        return got

    def tools(self, session) -> list[dict]:
        if self.mcp:
            from openenv.core.env_server.mcp_types import ListToolsAction

            # openenv 0.10.0 reads fastmcp's `Tool.inputSchema`, which fastmcp 4 (installed beside vLLM's mcp 2:
            # pyproject.toml) renames: each listing warned the user of code neither theirs nor minirl's. Set
            # here, after fastmcp's import put its own filter first.
            warnings.filterwarnings("ignore", message=r"Accessing `Tool\.inputSchema` is deprecated",
                                    category=DeprecationWarning)
            listed = session.resolve(session.env.step(ListToolsAction()))
            listed = getattr(listed, "observation", listed).tools  # a client's StepResult holds the observation
            return [function(t.name, t.description or "", t.input_schema) for t in listed]
        schema = self.action_cls.model_json_schema()
        schema.pop("title", None)
        # OpenEnv's plumbing on every Action, not the model's to fill
        schema.get("properties", {}).pop("metadata", None)
        return [function(self.tool_name, _doc(self.action_cls), schema)]


class Client(OpenEnv):
    """An `openenv` `EnvClient` (an `MCPToolClient` among them) to an environment's server, `env.params` its
    arguments (`base_url`). Its session is kept for the worker's next episode (reset again, as OpenEnv's
    server allows), so a run holds as many sessions as environments alive at once, not one an episode;
    it is closed when the run's environments end."""

    name = "openenv-client"
    reusable = True

    @staticmethod
    def is_mcp(cls) -> bool:
        from openenv.core.mcp_client import MCPClientBase  # openenv is loaded: cls is one of its

        return issubclass(cls, MCPClientBase)

    def close(self, session) -> None:
        pass  # kept: `dispose` ends it

    def dispose(self, session) -> None:
        Native.close(self, session)


class TRL(Native):
    """A TRL `environment_factory` class: its public methods are the tools. Built once and reset often, as
    TRL pools them: kept for the worker's next episode (`reset` starts it), closed when the run's
    environments let go of what they keep."""

    name = "trl"
    reusable = True

    def __init__(self, cls):
        self.methods = public_tools(cls)

    def reset(self, session, kw: dict) -> str:
        """TRL calls `reset(**row)`: the row's fields (and minirl's seed and episode id) its signature takes."""
        said = session.resolve(session.env.reset(**accepted(session.env.reset, kw)))
        return "" if said is None else text_of(said)

    def act(self, session, call: ToolCall | Message, timeout_s: float) -> Reading:
        """In TRL's own words (GRPOTrainer's tool loop): the tool message is `str(result)`, a list of
        content blocks read as text; a missing tool or a tool's exception `str({"error": str(e)})`."""
        if isinstance(call, Message):
            raise TypeError("a TRL environment class answers tool calls, not turns: env.replies_to = 'calls'")
        if call.tool_name not in self.methods:
            return Reading(str({"error": f"Tool {call.tool_name} not found."}), error=True)
        try:
            out = session.resolve(getattr(session.env, call.tool_name)(**call.arguments))
        except Exception as err:  # noqa: BLE001 - TRL answers a tool's exception as its error message
            if main_thread_only(err):  # where it runs, not what the model asked: the episode's fault (hosting.py)
                raise
            return Reading(str({"error": str(err)}), error=True)
        return Reading(text_of(out) if isinstance(out, list) else str(out))

    def tools(self, session) -> list[dict]:
        from transformers.utils import get_json_schema  # what TRL and the chat templates use

        return [get_json_schema(getattr(session.env, n)) for n in self.methods]

    def reward(self, session) -> float | None:
        get = getattr(session.env, "get_reward", None)
        return reward_of(session.resolve(get())) if callable(get) else None

    def close(self, session) -> None:
        pass  # kept: `dispose` ends it

    def dispose(self, session) -> None:
        Native.close(self, session)


def function(name: str, description: str, parameters: dict) -> dict:
    """A tool as chat templates take it (`tools=`): OpenAI's function schema."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def action_type(cls):
    """The action class an OpenEnv environment's `step` takes: its annotation, else the class's first
    generic argument (`Environment[MyAction, MyObservation, MyState]`); None where neither says."""
    try:
        hint = typing.get_type_hints(cls.step).get("action")
    except Exception:  # noqa: BLE001 - annotations that do not resolve: the generic argument may still say
        hint = None
    if isinstance(hint, type) and hasattr(hint, "model_validate"):
        return hint
    for base in getattr(cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type) and hasattr(args[0], "model_validate"):
            return args[0]
    return None


def text_field(action_cls) -> str:
    """The field of an action class a turn's text fills: its one required text field, else one named
    message, content or text; TypeError where it has none (it answers tool calls, not turns)."""
    fields = getattr(action_cls, "model_fields", {})
    text = [n for n, f in fields.items() if f.annotation is str and n != "metadata"]
    required = [n for n in text if fields[n].is_required()]
    if len(required) == 1:
        return required[0]
    named = [n for n in ("message", "content", "text") if n in text]
    if not named:
        raise TypeError(f"{action_cls.__name__} has no text field a turn can fill (one required str field, or one "
                        "named message, content or text): env.replies_to = 'calls'")
    return named[0]


def tool_name(action_cls) -> str:
    """An action class's tool name: its name without "Action", in snake_case.

    >>> tool_name(type("Connect4Action", (), {})), tool_name(type("GridWorldAction", (), {}))
    ('connect4', 'grid_world')
    """
    base = re.sub(r"Action$", "", action_cls.__name__) or action_cls.__name__
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()


def _doc(cls) -> str:
    """The first paragraph of the class's own docstring: never a base class's (`inspect.getdoc` would
    describe an OpenEnv action written without one as "Base class for all environment actions.")."""
    return inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")


def _validation_text(err: Exception) -> str:
    """A pydantic ValidationError in one line: each field and what is wrong with it."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'arguments'}: {e.get('msg', '')}"
                         for e in errors())
    return str(err).splitlines()[0]
