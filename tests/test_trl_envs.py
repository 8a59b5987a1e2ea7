"""TRL's own tools and environment classes, unchanged (tests/data/trl/README.md: the commit, the excerpts, its
licence): the tool functions of TRL's GRPOTrainer docs (`tools=[multiply, async_add]`, one of them async), its
agent example's database tool (`tools=[query_biogrid]`, which times itself out by SIGALRM), and the
`environment_factory` classes of its docs (`IncrementEnv`) and its 2048 example (`Game2048Env`, scored by the
example's own reward function, which reads the environment). minirl speaks to each as TRL does: the tools told
to the model as TRL's schemas, in TRL's order, answered in TRL's words."""

from __future__ import annotations

import sqlite3

import pytest

from minirl.envs import hosting
from minirl.envs.contract import ToolCall, environment_class
from tests.data.trl.grpo_agent import query_biogrid
from tests.data.trl.grpo_trainer_docs import async_add, multiply

DOCS_TOOLS = [multiply, async_add]  # what a TRL user passes as `tools=`: env.name names the list
BIOGRID_TOOLS = [query_biogrid]
ROW = {"seed": 1, "episode_id": "e-1", "prompt": "Does the gene TP53 interact with MDM2?", "answer": "yes"}


def started(name: str, reward_func: str = ""):
    s = hosting.Session()
    return s, hosting.start(s, environment_class(name), {}, ROW, reward_func)


def told(s) -> list[tuple[str, str, dict]]:
    return [(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]["properties"])
            for t in hosting.tools(s)]


def test_trls_tool_functions_are_told_in_its_order_and_answered_in_its_words():
    """`tools=[multiply, async_add]` from TRL's docs: both told to the model, in the list's order (TRL's, not by
    name), with the descriptions of their docstrings; the async one awaited; a bad call answered as TRL answers
    it (`str({"error": str(e)})`), the model's mistake; no reward of their own (the task's grader scores)."""
    s, reset_text = started("tests.test_trl_envs:DOCS_TOOLS")
    assert type(s.kind).__name__ == "TRL" and reset_text == ""
    assert told(s) == [
        ("multiply", "Multiplies two integers.", {"a": {"type": "integer", "description": "The first integer."},
                                                  "b": {"type": "integer", "description": "The second integer."}}),
        ("async_add", "Asynchronously adds two integers.",
         {"a": {"type": "integer", "description": "The first integer."},
          "b": {"type": "integer", "description": "The second integer."}})]
    assert hosting.step(s, ToolCall("multiply", {"a": 6, "b": 7}), 5.0) == hosting.Reading("42")
    assert hosting.step(s, ToolCall("async_add", {"a": 2, "b": 3}), 5.0) == hosting.Reading("5")
    missing = hosting.step(s, ToolCall("multiply", {"a": 6}), 5.0)
    assert missing == hosting.Reading(str({"error": "multiply() missing 1 required positional argument: 'b'"}),
                                      error=True)
    assert hosting.step(s, ToolCall("divide", {}), 5.0) == \
        hosting.Reading("{'error': 'Tool divide not found.'}", error=True)
    assert hosting.close(s)[0] is None


@pytest.fixture
def biogrid(tmp_path, monkeypatch):
    """The database TRL's example builds from a Hub dataset (`biogrid.db` in the working folder, table
    `interactions`), a few rows of it here: no download."""
    monkeypatch.chdir(tmp_path)
    with sqlite3.connect("biogrid.db") as db:
        db.execute("CREATE TABLE interactions (Official_Symbol_Interactor_A TEXT, Official_Symbol_Interactor_B TEXT)")
        db.executemany("INSERT INTO interactions VALUES (?, ?)", [("TP53", "MDM2"), ("BRCA1", "BARD1")])
    return "tests.test_trl_envs:BIOGRID_TOOLS"


def run_calls(name: str, isolation: str, calls: list[ToolCall]):
    """An episode on a worker of `isolation`, as a run's are: started, then each call; the jobs' outcomes."""
    host = hosting.Host(isolation=isolation)
    worker, session = host.open(), hosting.Session()
    jobs = [worker.submit(session, hosting.start, name, {}, ROW)]
    jobs += [worker.submit(session, hosting.step, call, 10.0) for call in calls]
    try:
        for job in jobs:
            assert host.outcome(job, 20.0)
        return jobs
    finally:
        host.release(worker, reuse=False)
        host.close()


def test_a_tool_that_times_itself_out_by_a_signal_is_the_environments_fault_on_a_thread_and_runs_in_a_process(
        biogrid):
    """TRL's `query_biogrid` sets a SIGALRM handler, which Python allows only on a process's main thread. On a
    worker thread (env.isolation = "thread") that is where minirl runs it, never the model's mistake: the call
    raises, its episode's fault, naming the isolation that runs it; TRL's words would have answered the model
    `{'error': 'signal only works in main thread …'}` after every call. In a process of its own its calls run on
    that process's main thread: rows answered as text, a bad query in TRL's words (the model's mistake)."""
    query = ToolCall("query_biogrid", {"sql_command": "SELECT * FROM interactions WHERE "
                                                      "Official_Symbol_Interactor_A = 'TP53'"})
    _, on_thread = run_calls(biogrid, "thread", [query])
    said = str(on_thread.err)
    assert isinstance(on_thread.err, RuntimeError) and said.startswith("signal only works in main thread")
    assert said.endswith("set env.isolation = 'process'")
    start, rows, wrong = run_calls(biogrid, "process", [query, ToolCall("query_biogrid", {"sql_command": "SELECT x"})])
    assert (start.err, start.out, rows.err, wrong.err) == (None, "", None, None)
    assert rows.out == hosting.Reading('[["TP53", "MDM2"]]')
    assert wrong.out == hosting.Reading("{'error': 'no such column: x'}", error=True)


def test_trls_docs_increment_env_its_reset_text_its_tool_and_its_own_reward():
    """`IncrementEnv` of TRL's docs: what `reset` returns is said to the model after the row's prompt, its
    `increment` is the tool, and its `get_reward` the episode's R."""
    s, reset_text = started("tests.data.trl.grpo_trainer_docs:IncrementEnv")
    target = s.env.target
    assert reset_text == f"Increment the counter by {target}."
    assert [name for name, _, _ in told(s)] == ["increment"]
    assert hosting.step(s, ToolCall("increment", {"step": target}), 5.0) == hosting.Reading(str(target))
    assert hosting.close(s)[0] == 1.0


def test_trls_2048_example_its_board_its_move_and_its_game_over_in_its_words():
    """`Game2048Env` of TRL's example: the board said at reset, `move` the one tool (its private helpers and
    static method not told), a move answered with the board, and its own "Game over." raised as TRL answers it."""
    s, reset_text = started("tests.data.trl.grpo_2048:Game2048Env")
    lines = reset_text.splitlines()
    assert lines[0] == "score=0.0" and lines[-1] == "done=False" and len(lines) == 6
    assert sorted(int(v) for row in lines[1:5] for v in row.split() if v != "0") in ([2, 2], [2, 4], [4, 4])
    assert told(s) == [("move", "Play one move in 2048.", {"direction": {"type": "string", "description":
                                                                          'One of "up", "down", "left", "right".'}})]
    moved = hosting.step(s, ToolCall("move", {"direction": "left"}), 5.0)
    assert not moved.error and moved.text.startswith("score=") and moved.text.endswith("done=False")
    s.env.done = True
    assert hosting.step(s, ToolCall("move", {"direction": "up"}), 5.0) == \
        hosting.Reading("{'error': 'Game over.'}", error=True)


SEEN: list = []


def what_it_is_given(environments, answer, **kwargs):
    """A reward function that says what it was given, and gives no reward (the grader scores)."""
    SEEN.append((len(environments), answer, sorted(kwargs)))
    return [None]


def test_trls_2048_reward_function_reads_the_environment_as_its_episode_ends():
    """`reward_score(environments, **kwargs)` of TRL's 2048 example as env.reward_func: called as the episode
    ends with `environments=[env]`, its one value the episode's R; the row's fields each a list of one (TRL's
    columns), but its prompt and minirl's seed and episode id; None gives no R (the grader scores); beside an
    environment's own `get_reward` refused (TRL would add the two), the episode's fault."""
    s, _ = started("tests.data.trl.grpo_2048:Game2048Env", "tests.data.trl.grpo_2048:reward_score")
    s.env.board = [[2, 2, 0, 0], [0] * 4, [0] * 4, [4, 4, 8, 0]]
    assert hosting.step(s, ToolCall("move", {"direction": "left"}), 5.0).text.startswith("score=12.0\n")
    assert hosting.close(s) == (12.0, True)  # 2 + 2 and 4 + 4 merged: the game's own score
    SEEN.clear()
    s, _ = started("tests.test_trl_envs:DOCS_TOOLS", "tests.test_trl_envs:what_it_is_given")
    assert hosting.close(s) == (None, True) and SEEN == [(1, ["yes"], [])]
    s, _ = started("tests.data.trl.grpo_trainer_docs:IncrementEnv", "tests.data.trl.grpo_2048:reward_score")
    with pytest.raises(TypeError, match="IncrementEnv has its own get_reward"):
        hosting.close(s)


def test_a_reward_function_that_reads_the_texts_is_refused_before_any_engine_starts():
    """TRL passes a reward function the prompts and completions too; minirl calls one on the environment's
    worker, where the texts are the grader's: one that needs them, or a field the rows lack, is one line."""
    from minirl.envs.contract import check_reward_function
    from minirl.errors import UsageError

    def reads_texts(completions, environments, **kwargs):
        return [0.0]

    with pytest.raises(UsageError, match="takes 'completions', the texts, which a grader scores"):
        check_reward_function("m:reads_texts", reads_texts, {"prompt": "p", "answer": "a"})
    with pytest.raises(UsageError, match="takes 'answer', a field the rows do not have"):
        check_reward_function("m:what_it_is_given", what_it_is_given, {"prompt": "p"})

    def reads_the_prompt(environments, prompt):  # TRL gives the prompts as `prompts`, never a row's `prompt`
        return [0.0]

    with pytest.raises(UsageError, match="takes 'prompt', the texts, which a grader scores"):
        check_reward_function("m:reads_the_prompt", reads_the_prompt, {"prompt": "p", "answer": "a"})
    check_reward_function("m:what_it_is_given", what_it_is_given, {"prompt": "p", "answer": "a"})


@pytest.mark.slow
def test_trls_2048_example_trains_three_steps_through_the_cli_scored_by_its_own_reward_function(tiny_dir, tmp_path):
    """`minirl run` with TRL's `Game2048Env` and `reward_score`, unchanged, each environment in a process of its
    own (which imports both by name), on rows of a prompt alone as TRL's example's dataset is (no answer: the
    game scores every episode): three steps of the random tiny model (the `move` format of
    tests/env_any_format.py: what a turn wrote before ")" is its direction), no environment fault, every
    episode's R the game's score, none graded; the held-out evaluation scores its episodes so too."""
    import json

    from tests.test_env_adapters import three_steps

    run, steps = three_steps(tiny_dir, tmp_path, ["env.name=tests.data.trl.grpo_2048:Game2048Env",
                                                  "env.reward_func=tests.data.trl.grpo_2048:reward_score",
                                                  "env.isolation=process", "env.max_reply_tokens=24"], "move",
                             rows=[{"prompt": "2048"}] * 64)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["heldout"]["end"]["env_faults"] == 0 and summary["heldout"]["end"]["avg@1"] == 0.0
    assert len(steps) == 3 and all(x["episode/env_errors"] == 0 for x in steps), \
        [x.get("episode/faults") for x in steps]
    assert sum(x["episode/tool_calls"] for x in steps) > 0
    samples = [r for line in (run / "samples.jsonl").read_text().splitlines() for r in json.loads(line)["responses"]]
    assert samples and all(r["score"] is None and r["reward"] == 0.0 for r in samples)  # no merge: a score of 0


def test_rows_need_no_answer_where_the_environment_gives_every_r(tmp_path):
    """TRL's environment examples train on rows of a prompt alone (their reward reads the environment): with
    env.reward_func, or a class with its own get_reward, such rows are the run's problems and the held-out
    benchmark's records, with no answer (an ungraded episode the grader's counted error, never a 0 against "");
    without, the data is refused as before, naming the missing field."""
    from minirl.config import recipes
    from minirl.data.prompts import load_problems
    from minirl.data.task import write_jsonl
    from minirl.eval.bench import bench_records
    from minirl.errors import UsageError
    from rewards.pool import GradingPool

    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "2048"}, {"prompt": "4096"}])
    sets = ["env.name=tests.data.trl.grpo_2048:Game2048Env", "env.tool_format=tiny", "data.chat_template=false"]
    for scoring in (["env.reward_func=tests.data.trl.grpo_2048:reward_score"],
                    ["env.name=tests.data.trl.grpo_trainer_docs:IncrementEnv"]):
        rec = recipes.load(recipes.shipped("tiny"), sets + scoring)
        got = bench_records("heldout", rec, heldout_path=tmp_path / "rows.jsonl")
        assert [(r["problem"], "answer" in r) for r in got.records] == [("2048", False), ("4096", False)]
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "2048", "answer": ""}, {"prompt": "4096", "answer": "8"}])
    problems, skipped = load_problems(str(tmp_path / "train.jsonl"), encode=lambda texts: [[1] * len(t) for t in texts],
                                      prompt_field="prompt", answer_field="answer", max_prompt_tokens=8, answers=False)
    assert [p.record for p in problems] == [{"prompt": "2048"}, {"prompt": "4096", "answer": "8"}]
    assert skipped["missing_answer"] == 0
    # an episode the environment leaves without R reaches the grader with no answer: its error, counted, not a 0
    score, = GradingPool("arith", {}, workers=0, timeout_s=5).grade([(got.records[0], "4")])
    assert score.score == 0.0 and score.info["error"] == "KeyError: 'answer'"
    with pytest.raises(UsageError, match="need a problem field .* and 'answer'"):
        bench_records("heldout", recipes.load(recipes.shipped("tiny"), sets), heldout_path=tmp_path / "rows.jsonl")
