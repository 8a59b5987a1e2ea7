"""How a turn writes a tool call and how a reply follows it (`env.tool_format`), and a reply's tokens.

The engine stops a turn on the call's closing token; the call is read from that turn's text alone;
only the reply is tokenized: the format's scaffold (the template's turn close before it, the next
generation prompt after it) with the environment's text between. The scaffold is tokenized as the
template's own text (its special tokens are single symbols); the environment's text as plain text
(a `<|im_end|>` a tool prints is characters, never a turn delimiter). A reply longer than
`env.max_reply_tokens` (the scaffold counted) is cut, by characters before it is tokenized, then by
tokens, the scaffold kept whole and the format's marker where it was cut: the model reads that it
was cut, and the next turn opens where the template opens one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from minirl.envs.contract import ToolCall
from minirl.errors import UsageError

# characters kept of a reply before it is tokenized, per token it may have: no tokenizer's token is
# longer, so what is dropped here could never have fit, and a 1 MB reply costs no tokenizer time
CHARS_PER_TOKEN = 32


class CallError(ValueError):
    """A turn's call that cannot be read (answered to the model as a tool error, counted)."""


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
    cut:          what ends a reply that was cut to fit `env.max_reply_tokens`
    """

    open: str
    close: str
    body: str = "json"
    tool: str = ""
    reply: str = "{}"
    unreadable: str = "error: {}"
    cut: str = "…(cut)"

    def call(self, text: str) -> ToolCall | None:
        """The call a turn's text ends with, None where it ends without one; CallError where the
        call cannot be read.

        >>> ToolFormat("(", ")", "expr", tool="calc").call("12*34=(12*34)")
        ToolCall(tool_name='calc', arguments={'expr': '12*34'})
        >>> ToolFormat("<tool_call>", "</tool_call>").call('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
        ToolCall(tool_name='f', arguments={})
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

    @property
    def scaffold(self) -> tuple[str, str]:
        """The reply's text before and after the environment's."""
        head, _, tail = self.reply.partition("{}")
        return head, tail


# Qwen3's chat template (Hermes tool calls): a call closes with the single token </tool_call>; a tool
# message is rendered inside the user turn as <tool_response>, then the assistant's generation prompt
QWEN3 = ToolFormat("<tool_call>", "</tool_call>", "json",
                   reply="<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")

# The tiny char model's (its vocabulary has no tags nor English): "(12*34)" calls the one tool, "=408;"
# answers, "=?;" says the call could not be read, "=12:;" a reply cut after "12"
TINY = ToolFormat("(", ")", "expr", tool="calc", reply="={};", unreadable="?", cut=":")
TOOL_FORMATS = {"qwen3": QWEN3, "tiny": TINY}


@dataclass(frozen=True)
class Replies:
    """A format's replies as token ids. `encode` tokenizes the template's own text (its special
    tokens as single symbols), `encode_text` the environment's (as plain characters)."""

    fmt: ToolFormat
    encode: Callable[[str], list[int]]
    encode_text: Callable[[str], list[int]]

    def ids(self, text: str, most: int | None) -> tuple[list[int], bool]:
        """A reply's ids, at most `most` (None: any), and whether it was cut to fit.

        The scaffold is kept whole; the text is cut by characters first (what cannot fit is never
        tokenized), then by tokens, and the format's marker follows what was kept."""
        head, tail = (self.encode(s) for s in self.fmt.scaffold)
        text = printable(text)
        room = None if most is None else most - len(head) - len(tail)
        cut = room is not None and len(text) > room * CHARS_PER_TOKEN
        if cut:
            text = text[: room * CHARS_PER_TOKEN]
        body = self.encode_text(text)
        if room is None or (not cut and len(body) <= room):
            return head + body + tail, False
        marker = self.encode_text(self.fmt.cut)
        keep = max(0, room - len(marker))
        return head + body[:keep] + marker + tail, True

    def smallest(self) -> int:
        """The fewest tokens a cut reply takes: the scaffold, the marker and one token of text."""
        head, tail = (self.encode(s) for s in self.fmt.scaffold)
        return len(head) + len(tail) + len(self.encode_text(self.fmt.cut)) + 1


def printable(text: str) -> str:
    """Text a tokenizer takes: lone surrogates (a tool's undecodable bytes) replaced."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def check_format(fmt_name: str, encode, encode_text, max_reply_tokens: int) -> None:
    """The format's closing text is one token of the model's vocabulary (the engine stops a turn on
    it), and `env.max_reply_tokens` holds a cut reply (the scaffold, the marker and a token of text)."""
    fmt = TOOL_FORMATS[fmt_name]
    n = len(encode(fmt.close))
    if n != 1:
        raise UsageError(f"env.tool_format = {fmt_name!r} closes a call with {fmt.close!r}, {n} tokens of this model's "
                         "vocabulary: the engine stops a turn on one token; choose the model's own format")
    least = Replies(fmt, encode, encode_text).smallest()
    if max_reply_tokens < least:
        raise UsageError(f"env.max_reply_tokens = {max_reply_tokens} cannot hold a reply in env.tool_format = "
                         f"{fmt_name!r}: its scaffold and cut marker take {least - 1} tokens of this model's "
                         f"vocabulary (set env.max_reply_tokens ≥ {least})")
