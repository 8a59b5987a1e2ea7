"""OpenEnv's own environments, unchanged: echo_env (an MCPEnvironment with two FastMCP tools), connect4_env
(an Environment whose `step` annotates its Action, `def reset(self)`), grid_world_env (an action class with
no docstring of its own and an enum field) and maze_env (its action class only in `Environment[A, O, S]`),
copied from huggingface/OpenEnv's envs/ (tests/data/openenv/README.md: the commit, the files, its licence).
minirl speaks to each in its own terms, in process and over the environment's own client to OpenEnv's own
server; nothing here is written in their shape by minirl's side."""

from __future__ import annotations

import json
import os
import sys

import pytest

from minirl.envs import hosting
from minirl.envs.contract import ToolCall
from tests.conftest import ROOT

ENVS = ROOT / "tests" / "data" / "openenv"
ECHO = "echo_env.server.echo_environment:EchoEnvironment"
CONNECT4 = "connect4_env.server.connect4_environment:Connect4Environment"
APPS = {"echo": "echo_env.server.app:app", "connect4": "connect4_env.server.app:app"}
CLIENTS = {"echo": "echo_env.client:EchoEnv", "connect4": "connect4_env.client:Connect4Env"}
EMPTY_BOARD = "board: " + str([[0] * 7] * 6) + "\nlegal_actions: [0, 1, 2, 3, 4, 5, 6]"


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS))


def started(name: str, params=None):
    from minirl.envs.contract import environment_class

    s = hosting.Session()
    text = hosting.start(s, environment_class(name), params or {}, {"seed": 1, "episode_id": "e-1", "prompt": "2+2=",
                                                                    "answer": "4"})
    return s, text


def described(s) -> list[tuple[str, str, list[str]]]:
    return [(t["function"]["name"], t["function"]["description"], sorted(t["function"]["parameters"]["properties"]))
            for t in hosting.tools(s)]


def test_echo_an_mcp_environment_lists_its_fastmcp_tools_and_answers_their_calls():
    import warnings

    s, reset_text = started(ECHO)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        listed = described(s)
    assert not [w for w in said if "inputSchema" in str(w.message)]  # openenv's own, against fastmcp 4: not shown
    assert listed == [("echo_message", "Echo back the provided message.", ["message"]),
                            ("echo_with_length", "Echo back the message with its length.", ["message"])]
    assert reset_text == ""  # its reset observation holds only metadata: nothing said to the model
    assert hosting.step(s, ToolCall("echo_message", {"message": "hi <|im_end|>"}), 5.0) == \
        hosting.Reading("hi <|im_end|>")
    assert hosting.step(s, ToolCall("echo_with_length", {"message": "abc"}), 5.0).text == \
        '{"message":"abc","length":3}'  # a tool's dict result, as FastMCP writes it
    unknown = hosting.step(s, ToolCall("nope", {}), 5.0)
    missing = hosting.step(s, ToolCall("echo_message", {}), 5.0)
    assert unknown.error and unknown.text == "error: Unknown tool: 'nope'"  # the model's mistake, answered
    assert missing.error and missing.text.startswith("error: ") and "message" in missing.text
    assert hosting.close(s) == (None, False)


def test_connect4_its_own_action_class_its_board_and_its_own_end():
    s, reset_text = started(CONNECT4)
    [(name, doc, args)] = described(s)
    assert (name, doc, args) == ("connect4", "Action for Connect4 environment.", ["column"])
    assert reset_text == EMPTY_BOARD  # `def reset(self)`: given nothing it does not take
    move = hosting.step(s, ToolCall("connect4", {"column": 3}), 5.0)
    assert not move.error and not move.done and move.reward == 0.0
    assert move.text.splitlines()[0].endswith("[0, 0, 0, 1, 0, 0, 0]]")  # its piece, bottom row
    wrong = hosting.step(s, ToolCall("connect4", {"col": 1}), 5.0)
    assert wrong == hosting.Reading("error: column: Field required; col: Extra inputs are not permitted", error=True)
    out = hosting.step(s, ToolCall("connect4", {"column": 9}), 5.0)  # the game's own rule: an illegal move ends it, -1
    assert (out.error, out.done, out.reward) == (False, True, -1.0)


def test_grid_world_without_a_docstring_of_its_own_is_not_described_by_openenvs_base_class():
    s, reset_text = started("grid_world_env.server.grid_world_environment:GridWorldEnvironment")
    [tool] = hosting.tools(s)
    assert tool["function"]["name"] == "grid_world" and tool["function"]["description"] == ""
    assert tool["function"]["parameters"]["$defs"]["MoveAction"]["enum"] == ["UP", "DOWN", "LEFT", "RIGHT"]
    assert reset_text == "x: 0\ny: 0\nmessage: Welcome to Grid World! Goal is at [4, 4]."
    down = hosting.step(s, ToolCall("grid_world", {"action": "DOWN"}), 5.0)
    assert (down.text, down.reward) == ("x: 1\ny: 0\nmessage: Keep going...", -0.1)
    sideways = hosting.step(s, ToolCall("grid_world", {"action": "SIDEWAYS"}), 5.0)
    assert sideways == hosting.Reading("error: action: Input should be 'UP', 'DOWN', 'LEFT' or 'RIGHT'", error=True)


def test_maze_its_action_class_from_the_environments_generic_arguments_and_its_params():
    s, reset_text = started("maze_env.server.maze_env_environment:MazeEnvironment",
                            {"maze_array": [[0, 0], [1, 0]], "exit_cell": [1, 1]})
    assert described(s) == [("maze", "Action for the Maze environment.", ["action"])]
    assert reset_text.startswith("legal_actions: ") and "current_position: [0, 0]" in reset_text
    legal = [int(a) for a in reset_text.split("[", 1)[1].split("]", 1)[0].split(",")]
    moves = [hosting.step(s, ToolCall("maze", {"action": a}), 5.0) for a in legal]
    assert all(not m.error and m.reward is not None for m in moves)


def serving(kind: str, log):
    """OpenEnv's own server for the environment (its app module, under uvicorn) on 127.0.0.1: its URL, once
    the server answers."""
    from tests.conftest import free_port, serving as server

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ENVS), str(ROOT)])}
    return server([sys.executable, "-m", "uvicorn", APPS[kind], "--port", str(port)], port, log, env)


@pytest.mark.parametrize("kind", ["echo", "connect4"])
def test_over_the_environments_own_client_the_replies_are_those_in_process(kind, tmp_path):
    calls = {"echo": [("echo_message", {"message": "hi"}), ("echo_with_length", {"message": "abc"}), ("nope", {})],
             "connect4": [("connect4", {"column": 3}), ("connect4", {"col": 1}), ("connect4", {"column": 9})]}[kind]
    readings = []
    with serving(kind, tmp_path / "server.log") as url:
        for name, params in ((ECHO if kind == "echo" else CONNECT4, None), (CLIENTS[kind], {"base_url": url})):
            s, reset_text = started(name, params)
            readings.append((type(s.kind).__name__, reset_text, hosting.tools(s),
                             [hosting.step(s, ToolCall(t, a), 20.0) for t, a in calls]))
            hosting.close(s)
    (here, *inside), (there, *over) = readings
    assert (here, there) == ("OpenEnv", "Client") and inside == over


@pytest.mark.slow
def test_connect4_trains_three_steps_through_the_cli(tiny_dir, tmp_path, monkeypatch):
    """`minirl run` with connect4 in process (the `column` format of tests/env_any_format.py: the last digit
    a turn wrote before ")" is its move): three steps, no environment fault; the game's own end and reward
    are the episode's R, a move that does not validate the model's mistake. (echo's client to OpenEnv's
    server answers as echo in process, above; a client through the CLI: tests/test_env_adapters.py.)"""
    from tests.test_env_adapters import three_steps

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ENVS), str(ROOT)]))
    run, steps = three_steps(tiny_dir, tmp_path, [f"env.name={CONNECT4}", "env.max_reply_tokens=24"], "column")
    assert len(steps) == 3 and all(x["episode/env_errors"] == 0 for x in steps), \
        [x.get("episode/faults") for x in steps]
    assert sum(x["episode/tool_calls"] for x in steps) > 0 and sum(x["episode/env_tokens"] for x in steps) > 0
    assert json.loads((run / "summary.json").read_text())["heldout"]["end"]["env_faults"] == 0  # it runs them too
    samples = [r for line in (run / "samples.jsonl").read_text().splitlines() for r in json.loads(line)["responses"]]
    for r in samples:  # the game's end is its R (a random model's moves end it only by an illegal one), not graded
        assert (r["reward"], r["score"]) == (-1.0, None) if r["episode"]["ended"] == "done" else r["score"] is not None
