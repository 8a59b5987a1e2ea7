"""A tool format as the model's own chat template renders it: the scaffold of a reply, of several
replies in one turn, and of the next generation prompt, taken from the template, never written here.

The template renders a conversation twice, with and without tool messages after an assistant turn that
calls tools (the turn as the model writes it under the template's generation prompt: its reasoning as
`enable_thinking` leaves it), and the reply is what the second rendering adds, between the call's close
and the next generation prompt. That holds only for a template that renders the earlier messages the same
whatever follows them (prefix-preserving): minirl keeps every turn as it was sampled and never renders
history again, so a template that would render it otherwise is refused in one line. A reply so taken
follows the template on every turn: `enable_thinking = false` closes the reasoning block of every
generation prompt, as Qwen3's does. An environment that answers a turn without a call as the user
(`env.replies_to = "turns"`) is rendered the same way, as the next user turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from minirl.envs.formats import TOOL_FORMATS, ToolFormat
from minirl.errors import UsageError

QUESTION = "minirl question"
REASONING = "minirl reasoning"
TOOL = "minirl_tool"
ANSWER = "minirl answer"
SAID = "minirl user"


def _reply(i: int) -> str:
    return f"minirl reply {i}"


def rendered(base: ToolFormat, tok, *, chat_kwargs: dict | None = None, tools: Sequence[dict] = (),
             max_calls: int = 1, user_turns: bool = False) -> ToolFormat:
    """`base` (a format of tags: its open, close, body, reasoning tags) with its replies as `tok`'s chat
    template renders tool messages. `max_calls` > 1: the turn runs to its end (the template's turn close,
    the tokenizer's EOS) and holds up to that many calls, answered together. `user_turns`: with the
    scaffold of the environment's words as the next user turn (`env.replies_to = "turns"`)."""
    kw = {**(chat_kwargs or {}), **({"tools": list(tools)} if tools else {})}

    def render(messages: list[dict], gen: bool) -> str:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)

    user = {"role": "user", "content": QUESTION}
    prompt = render([user], True)
    # the assistant's turn as the model writes it: its own reasoning, unless the generation prompt closed it
    opens, closes = base.think
    thinks = bool(opens) and prompt.rfind(closes) < prompt.rfind(QUESTION)
    content = f"{opens}\n{REASONING}\n{closes}\n\n" if thinks else ""

    def turn(n: int) -> dict:
        calls = [{"type": "function", "function": {"name": TOOL, "arguments": {"x": i}}} for i in range(n)]
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def replies(n: int) -> list[dict]:
        return [{"role": "tool", "name": TOOL, "content": _reply(i)} for i in range(n)]

    one = _scaffold(render, prompt, [user, turn(1)], replies(1), base)
    fmt = dataclasses.replace(base, reply=one.reply)
    if max_calls > 1:
        two = _scaffold(render, prompt, [user, turn(2)], replies(2), base)
        eos = tok.eos_token or ""
        if not eos or not one.turn_end.startswith(eos):
            raise UsageError(f"env.max_calls = {max_calls}: the chat template ends an assistant turn with "
                             f"{one.turn_end[:20]!r}, not the tokenizer's EOS {eos!r}, where the engine would stop a "
                             "turn of several calls; set env.max_calls = 1 (one call a turn, stopped at its close)")
        after_eos = one.turn_end[len(eos):]
        fmt = dataclasses.replace(base, reply=after_eos + one.head + "{}" + one.tail, sep=two.sep, at_end=True)
    if user_turns:
        fmt = dataclasses.replace(fmt, user=_as_user(render, prompt, user, content, tok.eos_token or ""))
    return fmt


def _as_user(render, prompt: str, user: dict, content: str, eos: str) -> str:
    """What follows a turn without a call (its EOS sampled) that the environment answers as the user:
    the template's turn close after the EOS, the user turn, the next generation prompt."""
    answer = {"role": "assistant", "content": content + ANSWER}
    said = render([user, answer], False)
    after = render([user, answer, {"role": "user", "content": SAID}], True)
    if not said.startswith(prompt) or not after.startswith(said):
        raise UsageError("env.replies_to = 'turns': the model's chat template renders an earlier turn differently "
                         "once a user turn follows it (Qwen3's drops the reasoning of turns before the last user "
                         "turn): minirl keeps every turn as it was sampled; give the model a template that keeps "
                         "them (its folder's chat_template.jinja), or env.replies_to = 'calls'")
    end = said[said.rfind(ANSWER) + len(ANSWER):]
    if not eos or not end.startswith(eos):
        raise UsageError(f"env.replies_to = 'turns': the chat template ends an assistant turn with {end[:20]!r}, not "
                         f"the tokenizer's EOS {eos!r}, where the engine stops a turn without a call")
    at = after.find(SAID, len(said))
    return end[len(eos):] + after[len(said):at] + "{}" + after[at + len(SAID):]


@dataclasses.dataclass(frozen=True)
class _Scaffold:
    turn_end: str  # what the template writes after the assistant's last call (its turn close)
    head: str  # then, before the first tool message's text
    tail: str  # after the last tool message's text: the next generation prompt's end included
    sep: str  # between two tool messages' texts
    reply: str  # turn_end + head + "{}" + tail: what follows a call's close


def _scaffold(render, prompt: str, before: list[dict], tool_msgs: list[dict], base: ToolFormat) -> _Scaffold:
    said = render(before, False)
    after = render(before + tool_msgs, True)
    if not said.startswith(prompt) or not after.startswith(said):
        at = next(i for i, (a, b) in enumerate(zip(after, said + "\0")) if a != b)
        raise UsageError("the model's chat template renders an earlier turn differently once tool messages follow it "
                         f"(at {said[max(0, at - 30):at + 30]!r}): minirl keeps every turn as it was sampled, so its "
                         "episodes would not be what the template renders; give the model a prefix-preserving "
                         "template (its folder's chat_template.jinja; Qwen3's keeps earlier turns as written when "
                         "data.chat_template_kwargs.enable_thinking is true, or with TRL's qwen3_training template)")
    texts = [m["content"] for m in tool_msgs]
    at = [after.find(t, len(said)) for t in texts]
    close = said.rfind(base.close)
    if close < len(prompt) or min(at) < 0 or at != sorted(at):
        raise UsageError(f"the model's chat template does not render a tool call as {base.open}…{base.close} and "
                         "its tool messages' text: choose env.tool_format for the model's own format")
    turn_end = said[close + len(base.close):]
    head = after[len(said):at[0]]
    tail = after[at[-1] + len(texts[-1]):]
    sep = after[at[0] + len(texts[0]):at[1]] if len(at) > 1 else ""
    return _Scaffold(turn_end, head, tail, sep, turn_end + head + "{}" + tail)


def format_for(name: str, tok, *, chat: bool, chat_kwargs: dict | None = None, tools: Sequence[dict] = (),
               max_calls: int = 1, user_turns: bool = False) -> ToolFormat:
    """`env.tool_format` as a run writes it: a format of tags (qwen3's) with prompts through the chat
    template takes its replies from the template; any other is as named."""
    base = TOOL_FORMATS[name]
    if base.body != "json" or not chat or not getattr(tok, "chat_template", None):
        return base
    return rendered(base, tok, chat_kwargs=chat_kwargs, tools=tools, max_calls=max_calls, user_turns=user_turns)
