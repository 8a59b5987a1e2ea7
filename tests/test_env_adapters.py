"""The environments users already have plug in unchanged (#96): OpenEnv's, in process, written against the
installed `openenv` package in its repository's shapes (tests/openenv_shapes.py: an MCPEnvironment with
FastMCP tools; an Environment with its own Action and Observation and `def reset(self)`), and a class as
TRL's docs write an `environment_factory`. Each is spoken to in its own terms (minirl/envs/adapters.py)."""

from __future__ import annotations

import pytest

from minirl.envs import hosting
from minirl.envs.contract import ToolCall
from minirl.envs.formats import TINY
from tests.test_env_faults import ByTurn

SHAPES = ["tests.openenv_shapes:CalcTools", "tests.openenv_shapes:CalcGame", "tests.openenv_shapes:CalcTrl",
          "tests.openenv_shapes:CALC_FUNCTIONS"]


def started(name: str, **row):
    from minirl.envs.contract import environment_class

    s = hosting.Session()
    text = hosting.start(s, environment_class(name), {}, {"seed": 1, "episode_id": "e-1", **row})
    return s, text


@pytest.mark.parametrize("name", SHAPES)
def test_each_kind_is_stepped_in_its_own_terms_and_lists_its_tools(name):
    s, reset_text = started(name, prompt="12*3=", answer="36")
    kind = type(s.kind).__name__
    tools = [t["function"]["name"] for t in hosting.tools(s)]
    got = hosting.step(s, ToolCall("calc", {"expr": "12*3"}), 5.0)
    wrong = hosting.step(s, ToolCall("calc", {"exp": "12*3"}), 5.0)
    reward, _ = hosting.close(s)
    assert {"tests.openenv_shapes:CalcTools": ("OpenEnv", ["calc", "fail"], "", "36", None),
            "tests.openenv_shapes:CalcGame": ("OpenEnv", ["calc"], "value: 0\ncalls: 0", "value: 36\ncalls: 1", None),
            "tests.openenv_shapes:CalcTrl": ("TRL", ["calc"], "", "36", 1.0),
            "tests.openenv_shapes:CALC_FUNCTIONS": ("TRL", ["calc"], "", "36", None)}[name] == \
        (kind, tools, reset_text, got.text, reward)
    assert not got.error and wrong.error  # the model's mistake, answered
    assert wrong.text.startswith("{'error': " if kind == "TRL" else "error: ")  # TRL's words for TRL's tools


FACTORIES = {  # what each builds is spoken to as its kind, as the class itself would be
    "tests.openenv_shapes:make_calc_trl": ("TRL", "", "36", 1.0),
    "tests.openenv_shapes:make_bound_calc": ("TRL", "", "36", None),  # its tools only on what it built
    "tests.openenv_shapes:calc_game_factory": ("OpenEnv", "value: 0\ncalls: 0", "value: 36\ncalls: 1", None),
}


@pytest.mark.parametrize("name", FACTORIES)
def test_a_factory_is_called_and_what_it_built_is_spoken_to_in_its_own_terms(name):
    """TRL's `environment_factory` is any callable that builds an environment: env.name may name one."""
    s, reset_text = started(name, prompt="12*3=", answer="36")
    kind = type(s.kind).__name__
    assert [t["function"]["name"] for t in hosting.tools(s)] == ["calc"]
    got = hosting.step(s, ToolCall("calc", {"expr": "12*3"}), 5.0)
    wrong = hosting.step(s, ToolCall("calc", {"exp": "12*3"}), 5.0)
    reward, _ = hosting.close(s)
    assert (kind, reset_text, got.text, reward) == FACTORIES[name]
    assert not got.error and wrong.error


def test_a_factory_runs_in_an_environment_process_by_its_name(tiny_tok):
    """env.isolation = "process": the worker's process imports the factory by name and calls it there."""
    from minirl.config.recipe import EnvConfig
    from minirl.data.prompts import Problem, Prompter
    from minirl.rollout.environments import Environments

    envs = Environments(EnvConfig(name="tests.openenv_shapes:make_bound_calc", tool_format="tiny", max_turns=3,
                                  max_reply_tokens=32, isolation="process"), tokenizer=tiny_tok, max_model_len=128,
                        prompter=Prompter("prompt", max_tokens=64))
    encode = envs.encode
    engine = ByTurn([encode("(12*3)"), encode("36") + [tiny_tok.eos_token_id]], encode(")")[0])
    try:
        groups = envs.sample(engine, [Problem(tuple(encode("12*3=")), {"prompt": "12*3=", "answer": "36"})], n=2,
                             temperature=1.0, max_tokens=20, seed=7)
    finally:
        envs.close()
    assert all(c.episode.env_errors == 0 and c.episode.tool_calls == 1 and
               envs.decode([t for t, m in zip(c.token_ids, c.mask) if not m]).startswith("=36") for c in groups[0])


def test_an_openenv_action_that_does_not_validate_is_the_tools_error_reply():
    s, _ = started("tests.openenv_shapes:CalcGame")
    wrong = hosting.step(s, ToolCall("calc", {"exp": "1"}), 5.0)
    assert wrong == hosting.Reading("error: expr: Field required; exp: Extra inputs are not permitted", error=True)
    other = hosting.step(s, ToolCall("move", {}), 5.0)
    assert other.error and other.text == "error: no tool 'move': the tool is 'calc'"
    schema = hosting.tools(s)[0]["function"]["parameters"]
    assert set(schema["properties"]) == {"expr"}  # OpenEnv's `metadata` is no argument of the model's


def test_a_trl_tools_exception_is_its_error_reply_and_get_reward_is_r():
    s, _ = started("tests.openenv_shapes:CalcTrl")
    raised = hosting.step(s, ToolCall("calc", {"expr": "0"}), 5.0)
    assert raised.error and raised.text == "{'error': 'zero is not an expression'}"  # TRL's own tool message
    unknown = hosting.step(s, ToolCall("calc2", {}), 5.0)
    assert unknown.error and unknown.text == "{'error': 'Tool calc2 not found.'}"
    schema = hosting.tools(s)[0]["function"]
    assert schema["description"] == "Evaluate an integer expression." and \
        schema["parameters"]["properties"]["expr"]["description"] == "digits and + - *"
    assert hosting.close(s) == (1.0, True)  # kept for the worker's next episode, as TRL pools them


class Pooled:
    """A TRL class that counts how often it is built, reset and closed."""

    built = reset_ = closed = 0

    def __init__(self):
        Pooled.built += 1

    def reset(self, **row) -> None:
        Pooled.reset_ += 1
        self.calls = 0

    def calc(self, expr: str) -> str:
        """Evaluate an integer expression.

        Args:
            expr: digits and + - *
        """
        self.calls += 1
        return str(eval(expr))

    def close(self) -> None:
        Pooled.closed += 1


def test_a_trl_class_is_built_once_a_worker_and_reset_for_each_episode(tiny_tok):
    """TRL's contract, "construct once, reset often": 12 episodes a batch, two batches, on 2 workers at
    once: two built, reset 24 times, each episode's state its own (one call each); closed when the
    environments let go of what they keep."""
    from minirl.config.recipe import EnvConfig
    from minirl.data.prompts import Problem, Prompter
    from minirl.rollout.environments import Environments

    Pooled.built = Pooled.reset_ = Pooled.closed = 0
    envs = Environments(EnvConfig(name="tests.test_env_adapters:Pooled", tool_format="tiny", max_turns=3,
                                  max_reply_tokens=32, max_concurrency=2), tokenizer=tiny_tok, max_model_len=128,
                        prompter=Prompter("prompt", max_tokens=64))
    encode = envs.encode
    engine = ByTurn([encode("(12*3)"), encode("36") + [tiny_tok.eos_token_id]], encode(")")[0])
    problems = [Problem(tuple(encode("12*3=")), {"prompt": "12*3=", "answer": "36"})] * 3
    for _ in range(2):
        groups = envs.sample(engine, problems, n=4, temperature=1.0, max_tokens=20, seed=3)
        assert all(c.episode.env_errors == 0 and c.episode.tool_calls == 1 for g in groups for c in g)
    assert (Pooled.built, Pooled.reset_, Pooled.closed) == (2, 24, 0)
    envs.release()  # their workers' last jobs: each worker's kept environment disposed of, on its own thread
    for w in envs.host.idle:
        done = w.submit(hosting.Session(), hosting.close)  # queued behind the disposal
        assert envs.host.outcome(done, 10)
    envs.close()
    assert Pooled.closed == 2


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.mark.parametrize("name", SHAPES)
def test_each_kind_runs_episodes_its_replies_verbatim_and_its_reset_observation_in_the_first_prompt(name, tiny_tok):
    """Episodes of each kind through the recipe's Environments (the tiny format calls `calc`): no fault,
    each reply the environment's own text in the format's scaffold, the reset observation after the
    problem in the first turn's prompt (CalcGame's), TRL's get_reward the episode's R."""
    from minirl.config.recipe import EnvConfig
    from minirl.data.prompts import Problem, Prompter
    from minirl.envs.formats import Replies
    from minirl.envs.outcome import env_reward
    from minirl.rollout.environments import Environments

    envs = Environments(EnvConfig(name=name, tool_format="tiny", max_turns=3, max_reply_tokens=32), tokenizer=tiny_tok,
                        max_model_len=128, prompter=Prompter("prompt", max_tokens=64))
    encode = envs.encode
    engine = ByTurn([encode("(12*3)"), encode("36") + [tiny_tok.eos_token_id]], encode(")")[0])
    asked = []
    generate = engine.generate
    engine.generate = lambda prompts, **kw: (asked.extend(prompts), generate(prompts, **kw))[1]
    groups = envs.sample(engine, [Problem(tuple(encode("12*3=")), {"prompt": "12*3=", "answer": "36"})], n=2,
                         temperature=1.0, max_tokens=20, seed=7)
    want = {"tests.openenv_shapes:CalcGame": ("value: 0\ncalls: 0", "value: 36\ncalls: 1")}.get(name, ("", "36"))
    reply, _ = Replies(TINY, encode, envs.encode_text).ids(want[1], 32)
    for c in groups[0]:
        assert c.episode.env_errors == 0 and c.episode.ended == "answer" and c.episode.tool_calls == 1
        assert [t for t, m in zip(c.token_ids, c.mask) if not m] == reply
        assert env_reward(c) == (1.0 if name.endswith("Trl") else None)
    assert list(asked[0]) == encode("12*3=" + want[0])  # the first turn's prompt: the problem, then what reset said


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SHAPES if not n.endswith(("CalcGame", "CalcTrl"))])
def test_each_kind_trains_three_steps_through_the_cli(name, tiny_dir, tmp_path):
    """`minirl run` with each kind as env.name, unchanged: three steps on the random tiny model (the `any`
    format of tests/env_any_format.py sends whatever a turn wrote before ")" to `calc`), no environment
    fault, the environment's replies in the episodes; the held-out evaluation runs them too. (An OpenEnv
    Environment with its own Action class: OpenEnv's own connect4, tests/test_openenv_envs.py; a TRL class:
    the embedded tools task's calculator, tests/test_episodes.py.)"""
    import json

    run, steps = three_steps(tiny_dir, tmp_path, [f"env.name={name}", "env.max_reply_tokens=16"])
    assert len(steps) == 3 and all(x["episode/env_errors"] == 0 and x["episode/masked"] == 0 for x in steps)
    assert sum(x["episode/tool_calls"] for x in steps) > 0 and sum(x["episode/env_tokens"] for x in steps) > 0
    assert json.loads((run / "summary.json").read_text())["heldout"]["end"]["env_faults"] == 0


@pytest.fixture(params=["tools", "game"])
def server(request, tmp_path):
    """OpenEnv's own server for the test's environment on 127.0.0.1, 2 sessions at once; waits until it answers."""
    import sys

    from tests.conftest import free_port, serving

    port = free_port()
    with serving([sys.executable, "-m", "tests.openenv_shapes", request.param, str(port), "2"], port,
                 tmp_path / "server.log") as url:
        yield request.param, url


def test_a_client_runs_more_episodes_than_its_server_has_sessions(server, tiny_tok):
    """12 episodes over OpenEnv's client against its server with 2 sessions: the server's refusal sets how
    many live at once, each session is kept and reset for the next episode, no episode fails; the replies
    are the server's observations, read (an MCP result's text; the game's own fields)."""
    from minirl.config.recipe import EnvConfig
    from minirl.data.prompts import Problem, Prompter
    from minirl.rollout.environments import Environments

    kind, url = server
    name = {"tools": "tests.openenv_shapes:CalcToolsClient", "game": "tests.openenv_shapes:CalcGameClient"}[kind]
    envs = Environments(EnvConfig(name=name, params={"base_url": url}, tool_format="tiny", max_turns=3,
                                  max_reply_tokens=32, step_timeout_s=20), tokenizer=tiny_tok, max_model_len=128,
                        prompter=Prompter("prompt", max_tokens=64))
    encode = envs.encode
    engine = ByTurn([encode("(12*3)"), encode("36") + [tiny_tok.eos_token_id]], encode(")")[0])
    problems = [Problem(tuple(encode("12*3=")), {"prompt": "12*3=", "answer": "36"})] * 3
    for _ in range(2):  # a second batch reuses the kept sessions
        groups = envs.sample(engine, problems, n=4, temperature=1.0, max_tokens=20, seed=3)
        eps = [c.episode for g in groups for c in g]
        assert all(e.env_errors == 0 and e.ended == "answer" and e.tool_calls == 1 for e in eps), \
            [e.fault for e in eps if e.fault][:3]
        want = "36" if kind == "tools" else "value: 36\ncalls: 1"
        assert all(envs.decode([t for t, m in zip(c.token_ids, c.mask) if not m]) == envs.decode(envs.encode_text(
            TINY.text(want))) for g in groups for c in g)
    assert envs.host.max_live == 2 and envs.host.live == 0 and sum(len(w.kept) for w in envs.host.idle) == 2
    envs.close()


@pytest.mark.slow
def test_a_client_trains_three_steps_through_the_cli_on_fewer_sessions_than_episodes(server, tiny_dir, tmp_path):
    """`minirl run` with OpenEnv's client to its server (2 sessions; 32 episodes a step): three steps, no
    environment fault, the server's replies in the episodes."""
    kind, url = server
    name = {"tools": "tests.openenv_shapes:CalcToolsClient", "game": "tests.openenv_shapes:CalcGameClient"}[kind]
    _, steps = three_steps(tiny_dir, tmp_path, [f"env.name={name}", f'env.params={{"base_url": "{url}"}}',
                                                "env.max_reply_tokens=24"])
    assert len(steps) == 3 and all(x["episode/env_errors"] == 0 for x in steps), \
        [x.get("episode/faults") for x in steps]
    assert sum(x["episode/env_tokens"] for x in steps) > 0


def three_steps(tiny_dir, tmp_path, sets: list[str], fmt: str = "any", rows: list[dict] | None = None):
    """Three steps of `minirl run` on the random tiny model with a format of tests/env_any_format.py (`any`:
    whatever a turn wrote before ")" goes to `calc`), 8 prompts × 4 episodes: the run folder and its steps' rows.
    `rows`: both splits' rows instead of the embedded task's."""
    import json
    import subprocess
    import sys

    from minirl.data.task import write_jsonl
    from tests.conftest import ROOT, data_workspace

    ws = data_workspace(tmp_path / "ws", train=64, heldout=8)
    if rows is not None:
        for split in ("train", "heldout"):
            write_jsonl(ws / f"data/{split}.jsonl", rows)
    sets = [*sets, f"env.tool_format={fmt}", "env.max_turns=2", "rollout.max_tokens=8", "train.prompts_per_step=8",
            "train.group_size=4", "eval.k=1"]
    r = subprocess.run([sys.executable, "-m", "tests.env_any_format", "run", str(ws), "--model", str(tiny_dir),
                        "--steps", "3", *[a for s in sets for a in ("--set", s)]], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = next((ws / "runs").iterdir())
    return run, [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "episode/turns" in x]


def test_a_prompt_renders_the_tools_through_the_chat_template_and_the_reset_observation_within_its_limit(tmp_path):
    """The tools as the chat template renders `tools=` (a template of the test's), and an episode's reset
    observation after the problem, cut with the marker where the prompt would pass data.max_prompt_tokens."""
    from transformers import AutoTokenizer

    from minirl.data.prompts import Prompter, prompt_ids
    from minirl.envs.adapters import function
    from minirl.setup.tokenizer import WIDE_VOCAB, build_tokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "tok", WIDE_VOCAB, 256)))
    tok.chat_template = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}"
                         "{% endif %}{% for m in messages %}user: {{ m['content'] }}{{ '\\n' }}{% endfor %}model:")
    tools = [function("calc", "", {"type": "object"}), function("note", "", {"type": "object"})]
    assert tok.decode(prompt_ids(tok, "1+2=", chat=True, tools=tools)) == "tools: calc note\nuser: 1+2=\nmodel:"
    p = Prompter("prompt", chat=True, tools=tuple(tools), max_tokens=44, marker="~")
    assert tok.decode(p.ids(tok, {"prompt": "1+2="}, " board 3")) == "tools: calc note\nuser: 1+2= board 3\nmodel:"
    cut = tok.decode(p.ids(tok, {"prompt": "1+2="}, " " + "x" * 50))
    assert len(tok.encode(cut, add_special_tokens=False)) == 44 and cut.endswith("x~\nmodel:"), cut


class Dead:
    """A TRL class whose connection dies with a row it cannot take: every later reset of it raises too, as a real
    environment with a dead connection does."""

    built = 0

    def __init__(self):
        Dead.built += 1
        self.dead = False

    def reset(self, **row) -> None:
        if self.dead or row.get("answer") == "dead":
            self.dead = True
            raise ConnectionError("the environment's connection is gone")

    def calc(self, expr: str) -> str:
        """Evaluate an integer expression.

        Args:
            expr: digits and + - *
        """
        return str(eval(expr))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_an_environment_that_faulted_is_never_kept_for_another_episode(tiny_tok, isolation):
    """The fault is that episode's alone: the environment it broke is closed, and the next episode on the same
    worker (a thread, or a process that holds it) gets a new one (kept, it would fault every episode after it)."""
    from minirl.config.recipe import EnvConfig
    from minirl.data.prompts import Problem, Prompter
    from minirl.rollout.environments import Environments

    Dead.built = 0
    envs = Environments(EnvConfig(name="tests.test_env_adapters:Dead", tool_format="tiny", max_turns=3,
                                  max_reply_tokens=32, max_concurrency=1, isolation=isolation), tokenizer=tiny_tok,
                        max_model_len=128, prompter=Prompter("prompt", max_tokens=64))
    encode = envs.encode
    engine = ByTurn([encode("(12*3)"), encode("36") + [tiny_tok.eos_token_id]], encode(")")[0])
    rows = [{"prompt": "12*3=", "answer": a} for a in ("dead", "36", "36", "36")]
    try:
        groups = envs.sample(engine, [Problem(tuple(encode("12*3=")), r) for r in rows], n=1, temperature=1.0,
                             max_tokens=20, seed=3)
    finally:
        envs.close()
    assert [g[0].episode.env_errors for g in groups] == [1, 0, 0, 0]
    assert Dead.built == (2 if isolation == "thread" else 0)  # a process's count is its own
