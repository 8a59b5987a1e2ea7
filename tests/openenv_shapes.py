"""Environments written against the installed `openenv` package in the shapes its own repository uses
(huggingface/OpenEnv's envs/: an MCPEnvironment with FastMCP tools; an Environment with its own Action and
Observation classes and `def reset(self)`), a class written as TRL's docs write an `environment_factory`,
factories (functions that build one, as TRL's `EnvironmentFactory` type allows) and a list of tool functions
(TRL's `tools=`). Written for minirl's tests; no
minirl import. Each serves the one tool the tiny format can call, `calc(expr)`."""

from __future__ import annotations

import functools

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


def value(expr: str) -> str:
    """Integer arithmetic of digits and + - *, else "?"."""
    if not expr or len(expr) > 24 or any(ch not in "0123456789+-*" for ch in expr):
        return "?"
    try:
        return str(eval(expr.lstrip("0") or "0"))
    except SyntaxError:
        return "?"


class CalcTools(MCPEnvironment):
    """An MCP environment: its tools are FastMCP functions."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calc")

        @mcp.tool
        def calc(expr: str) -> str:
            """Evaluate an integer expression of digits and + - *."""
            return value(expr)

        @mcp.tool
        def fail(reason: str) -> str:
            """Always fails."""
            raise RuntimeError(reason)

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(done=False, reward=None, metadata={"ready": True})

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


class CalcAction(Action):
    """Evaluate an integer expression."""

    expr: str = Field(description="digits and + - *")


class CalcObservation(Observation):
    value: str = Field(default="", description="the expression's value")
    calls: int = Field(default=0, description="calls so far")


class CalcGame(Environment):
    """A non-MCP environment: its own Action and Observation, `def reset(self)` (no seed, no row)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self) -> CalcObservation:
        self._state = State(episode_id=None, step_count=0)
        return CalcObservation(value="0", calls=0)

    def step(self, action: CalcAction, timeout_s=None, **kwargs) -> CalcObservation:
        self._state.step_count += 1
        return CalcObservation(value=value(action.expr), calls=self._state.step_count)

    @property
    def state(self) -> State:
        return self._state


class GuessAction(Action):
    """A guess of the hidden number."""

    guess: str = Field(..., description="the number guessed")


class GuessObservation(Observation):
    hint: str = Field(default="", description="higher, lower, or right")


class GuessGame(Environment):
    """A non-MCP game that answers every turn as the user would (no tool): "higher", "lower", then done."""

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint="guess a number from 1 to 100")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        said = action.guess.strip()
        if said == "42":
            return GuessObservation(hint="right", done=True, reward=1.0)
        return GuessObservation(hint="higher" if said.isdigit() and int(said) < 42 else "lower")

    @property
    def state(self) -> State:
        return self._state


class CalcTrl:
    """A TRL environment_factory class: its public methods are its tools."""

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        self.answer = kwargs.get("answer")
        return None

    def calc(self, expr: str) -> str:
        """Evaluate an integer expression.

        Args:
            expr: digits and + - *
        """
        self.calls += 1
        if expr == "0":
            raise ValueError("zero is not an expression")
        return value(expr)

    def get_reward(self) -> float:
        return float(self.calls > 0)


class TrlCalculator:
    """The tools task's calculator written as TRL's docs write an `environment_factory` class: its one public
    method is the tool; no reward of its own (the task's grader scores the answer)."""

    def reset(self, **kwargs) -> str | None:
        return None

    def calc(self, expr: str) -> str:
        """Evaluate an integer expression of at most 32 characters.

        Args:
            expr: digits, + - * and brackets
        """
        if not 0 < len(expr) <= 32 or any(ch not in "0123456789+-*()" for ch in expr):
            return "?"
        try:
            return str(eval(expr.lstrip("0") or "0", {"__builtins__": {}}))
        except (SyntaxError, TypeError):
            return "?"


# ---- over OpenEnv's client, against its own server (what `openenv serve` / uvicorn server.app:app runs) ----
from openenv.core.client_types import StepResult  # noqa: E402
from openenv.core.env_client import EnvClient  # noqa: E402
from openenv.core.mcp_client import MCPToolClient  # noqa: E402


def make_calc_trl() -> CalcTrl:
    """A TRL `environment_factory` as its type says one is, `Callable[[], env]`: a function that builds one."""
    return CalcTrl()


def make_bound_calc():
    """A factory whose class gets its tools as it is built, as TRL's OpenReward adapter binds each tool the
    server lists onto a class it makes: the tools are on what it returns, not on anything importable."""

    def calc(self, expr: str) -> str:
        """Evaluate an integer expression.

        Args:
            expr: digits and + - *
        """
        return value(expr)

    cls = type("BoundTools", (), {"reset": lambda self, **row: None})
    setattr(cls, "calc", calc)
    return cls()


calc_game_factory = functools.partial(CalcGame)  # an OpenEnv environment's class behind a partial


def calc(expr: str) -> str:
    """Evaluate an integer expression.

    Args:
        expr: digits and + - *
    """
    return value(expr)


CALC_FUNCTIONS = [calc]  # TRL's standalone tools (`GRPOTrainer(tools=[calc])`): a list of functions


class CalcToolsClient(MCPToolClient):
    """CalcTools' client, as an MCP environment's client is written (nothing of its own)."""


class CalcGameClient(EnvClient[CalcAction, CalcObservation, State]):
    """CalcGame's client, as a non-MCP environment's client is written."""

    def _step_payload(self, action: CalcAction) -> dict:
        return {"expr": action.expr}

    def _parse_result(self, payload: dict) -> StepResult:
        obs = payload.get("observation", {})
        observation = CalcObservation(value=obs.get("value", ""), calls=obs.get("calls", 0),
                                      done=payload.get("done", False), reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


def serve(kind: str, port: int, sessions: int) -> None:
    """OpenEnv's server for CalcTools ("tools") or CalcGame ("game") on 127.0.0.1:port, `sessions` at once.

        python -m tests.openenv_shapes tools|game PORT SESSIONS"""
    import uvicorn
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    if kind == "tools":
        app = create_app(CalcTools, CallToolAction, CallToolObservation, env_name="calc", max_concurrent_envs=sessions)
    else:
        app = create_app(CalcGame, CalcAction, CalcObservation, env_name="calc", max_concurrent_envs=sessions)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    import sys

    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
