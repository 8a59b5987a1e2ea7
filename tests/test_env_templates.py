"""#96: replies as the model's own chat template renders them. An episode's text is the template's rendering
of the same messages (tools listed, one call or several in a turn, their replies, thinking on and off); a
call inside the model's reasoning is not run; a template that renders earlier turns again differently is
refused in one line. Against the tiny model's chat tokenizer (Qwen3's chat tokens, a template of Qwen3's
shape), through `transformers`' own `apply_chat_template`; the turns a scripted engine double samples."""

from __future__ import annotations

import pytest

from minirl.envs.contract import Observation, ToolCall
from minirl.envs.formats import QWEN3
from minirl.envs.templates import format_for
from minirl.errors import UsageError
from minirl.rollout.engine import Completion
from minirl.rollout.turn_loop import sample_episodes

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate integer arithmetic.",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                          "required": ["expr"]}}}]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from minirl.setup.tokenizer import CHAT_VOCAB, build_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path_factory.mktemp("chat"), CHAT_VOCAB, 512,
                                                             chat=True)))


class Turns:
    """An engine double: its k-th `generate` samples the k-th text (tokenized as the model's own text)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.stops = tok, texts, []

    def generate(self, prompts, *, n, max_tokens, stop, **kw):
        self.stops.append(list(stop))
        ids = tuple(self.tok.encode(self.texts[len(self.stops) - 1], add_special_tokens=False))
        return [[Completion(ids, (-0.5,) * len(ids), "stop")] for _ in prompts]


class Calc:
    def __init__(self):
        self.calls = []

    def step(self, action):
        self.calls.append(action.arguments["expr"])
        return Observation(result=str(eval(action.arguments["expr"])))  # noqa: S307 - the test's own expressions


def call(expr: str) -> dict:
    return {"type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}


def written(expr: str) -> str:
    return QWEN3.written(ToolCall("calc", {"expr": expr}))


def episode(tok, texts, *, thinking: bool, max_calls: int = 1, env=None, user_turns: bool = False):
    fmt = format_for("qwen3", tok, chat=True, chat_kwargs={"enable_thinking": thinking}, tools=TOOLS,
                     max_calls=max_calls, user_turns=user_turns)
    prompt = tok.apply_chat_template([{"role": "user", "content": "6*7="}], add_generation_prompt=True, tools=TOOLS,
                                     enable_thinking=thinking, tokenize=True, return_dict=False)
    env, engine = env or Calc(), Turns(tok, texts)
    (c,), = sample_episodes(engine, [prompt], [[env]], fmt=fmt, user_turns=user_turns,
                            encode=lambda s: tok.encode(s, add_special_tokens=False),
                            encode_text=lambda s: tok.encode(s, add_special_tokens=False, split_special_tokens=True),
                            decode=lambda ids: tok.decode(list(ids)), n=1, temperature=1.0, max_tokens=400,
                            max_turns=4, max_model_len=2000, seed=0, max_reply_tokens=400, max_calls=max_calls)
    return tok.decode(list(prompt) + list(c.token_ids)), c, env, engine


def rendered(tok, messages, *, thinking: bool) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, enable_thinking=thinking, tokenize=False)


@pytest.mark.parametrize("thinking", [False, True])
def test_an_episode_of_one_call_a_turn_is_the_templates_rendering_of_its_messages(chat_tok, thinking):
    # thinking on, the model writes its reasoning block; off, every generation prompt closes it
    think = ["<think>\nI will ask the tool.\n</think>\n\n", "<think>\nIt said 42.\n</think>\n\n",
             "<think>\nDone.\n</think>\n\n"] if thinking else ["", "", ""]
    text, c, env, engine = episode(chat_tok, [think[0] + written("6*7"), think[1] + written("42-0"),
                                              think[2] + "42<|im_end|>"], thinking=thinking)
    messages = [{"role": "user", "content": "6*7="},
                {"role": "assistant", "content": think[0], "tool_calls": [call("6*7")]},
                {"role": "tool", "name": "calc", "content": "42"},
                {"role": "assistant", "content": think[1], "tool_calls": [call("42-0")]},
                {"role": "tool", "name": "calc", "content": "42"},
                {"role": "assistant", "content": think[2] + "42"}]
    assert text + "\n" == rendered(chat_tok, messages, thinking=thinking)
    assert env.calls == ["6*7", "42-0"] and c.episode.turns == 3 and c.episode.tool_calls == 2
    assert engine.stops[0] == chat_tok.encode("</tool_call>", add_special_tokens=False)  # one call: stopped at it
    # every turn opens as the template opens one: thinking off closes the reasoning block of each
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (0 if thinking else 3)
    assert "<tools>\ncalc(expr)\n</tools>" in text  # the tools, as the template lists them


def test_several_calls_of_a_turn_are_run_and_answered_together_as_the_template_renders_them(chat_tok):
    turn = written("6*7") + "\n" + written("2+3")
    text, c, env, engine = episode(chat_tok, [turn + "<|im_end|>", "42 and 5<|im_end|>"], thinking=False,
                                   max_calls=2)
    messages = [{"role": "user", "content": "6*7="},
                {"role": "assistant", "content": "", "tool_calls": [call("6*7"), call("2+3")]},
                {"role": "tool", "name": "calc", "content": "42"},
                {"role": "tool", "name": "calc", "content": "5"},
                {"role": "assistant", "content": "42 and 5"}]
    assert text + "\n" == rendered(chat_tok, messages, thinking=False)
    assert env.calls == ["6*7", "2+3"] and c.episode.tool_calls == 2 and c.episode.turns == 2
    assert engine.stops[0] == []  # a turn of several calls runs to its end (the template's turn close, EOS)
    sampled = chat_tok.decode([t for t, m in zip(c.token_ids, c.mask) if m])
    assert sampled == turn + "<|im_end|>" + "42 and 5<|im_end|>"  # the replies trained on nothing


def test_calls_past_max_calls_and_unreadable_ones_are_answered_as_the_models_errors(chat_tok):
    turn = written("1+1") + "\n" + "<tool_call>\nnot json\n</tool_call>" + "\n" + written("2+2") + written("3+3")
    text, c, env, _ = episode(chat_tok, [turn + "<|im_end|>", "2<|im_end|>"], thinking=False, max_calls=3)
    assert env.calls == ["1+1", "2+2"] and c.episode.tool_calls == 4 and c.episode.tool_errors == 2
    replies = text.split("<tool_response>\n")[1:]
    assert replies[0].startswith("2\n") and replies[1].startswith("error: the call is not JSON")
    assert replies[2].startswith("4\n") and replies[3].startswith("error: at most 3 calls a turn, this one not run")


@pytest.mark.parametrize("max_calls", [1, 2])
def test_a_call_inside_the_models_reasoning_is_not_run(chat_tok, max_calls):
    musing = "<think>\nmaybe " + written("9*9")
    rest = "\nno: I know it.\n</think>\n\n42<|im_end|>"
    texts = [musing + rest] if max_calls > 1 else [musing, rest]  # one call a turn: the engine stopped at it
    text, c, env, _ = episode(chat_tok, texts, thinking=True, max_calls=max_calls)
    assert env.calls == [] and c.episode.tool_calls == 0 and c.episode.turns == 1 and c.episode.ended == "answer"
    assert text.endswith(musing + rest) and all(c.mask)


def test_a_template_that_renders_earlier_turns_again_differently_is_refused_in_one_line(chat_tok):
    import copy

    tok = copy.deepcopy(chat_tok)
    # as Qwen3's own does: an earlier turn's empty reasoning block is dropped once more messages follow it
    turn = ("{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + "
            "content.lstrip('\\n') }}")
    tok.chat_template = tok.chat_template.replace(
        turn, "{%- if loop.last or reasoning %}" + turn + "{%- else %}{{- '<|im_start|>assistant\\n' + content }}"
              "{%- endif %}")
    assert tok.chat_template != chat_tok.chat_template
    format_for("qwen3", tok, chat=True, chat_kwargs={"enable_thinking": True}, tools=TOOLS)  # reasoning kept: fine
    with pytest.raises(UsageError, match="renders an earlier turn differently once tool messages follow it") as e:
        format_for("qwen3", tok, chat=True, chat_kwargs={"enable_thinking": False}, tools=TOOLS)
    assert "\n" not in str(e.value)


def test_several_calls_need_the_chat_template_and_qwen3s_format():
    from minirl.config import recipes

    with pytest.raises(UsageError, match="env.max_calls = 2 answers several calls of a turn together"):
        recipes.load(recipes.shipped("tiny-tools"), ["env.max_calls=2"])
    rec = recipes.load(recipes.shipped("tiny-tools-qwen3"), ["env.max_calls=2"])
    assert rec.env.max_calls == 2 and rec.data.chat_template_kwargs == {"enable_thinking": False}


def test_an_environment_that_answers_as_the_user_plays_a_game_of_turns_as_the_template_renders_them(chat_tok):
    """`env.replies_to = "turns"`: an OpenEnv game (the installed package; its own Action of one text field)
    answers each turn without a call as the next user turn, until it says done; its reward is the episode's."""
    pytest.importorskip("openenv")
    from tests.openenv_shapes import GuessGame

    text, c, _, _ = episode(chat_tok, ["10<|im_end|>", "70<|im_end|>", "42<|im_end|>"], thinking=False, env=GuessGame,
                            user_turns=True)
    messages = [{"role": "user", "content": "6*7="}, {"role": "assistant", "content": "10"},
                {"role": "user", "content": "higher"}, {"role": "assistant", "content": "70"},
                {"role": "user", "content": "lower"}, {"role": "assistant", "content": "42"}]
    assert text + "\n" == rendered(chat_tok, messages, thinking=False)
    assert c.episode.ended == "done" and c.episode.reward == 1.0 and c.episode.turns == 3
    assert c.episode.tool_calls == 0 and c.episode.env_errors == 0


def test_replies_as_the_user_need_a_format_with_a_user_turn():
    from minirl.config import recipes

    with pytest.raises(UsageError, match="env.replies_to = 'turns' answers the model's turns as the user, and "
                                         "env.tool_format = 'tiny' has no user turn"):
        recipes.load(recipes.shipped("tiny-tools"), ["env.replies_to=turns"])
