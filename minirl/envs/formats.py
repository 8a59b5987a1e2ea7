"""How a turn writes a tool call and how a reply follows it (`env.tool_format`), and a reply's tokens.

The engine stops a turn on the call's closing token; the call is read from that turn's text alone;
only the reply is tokenized: the format's scaffold (the template's turn close before it, the next
generation prompt after it) with the environment's text between. The scaffold is tokenized as the
template's own text (its special tokens are single symbols); the environment's text as plain text
(a `<|im_end|>` a tool prints is characters, never a turn delimiter). A reply longer than
`env.max_reply_tokens` (the scaffold counted) is cut, by characters before it is tokenized, then by
tokens, the scaffold kept whole and the format's marker where it was cut: the model reads that it
was cut, and the next turn opens where the template opens one.

A format whose turns run to their end (`at_end`: the turn's EOS, sampled and kept) may hold several calls
in one turn; each call outside a reasoning block is answered, the replies together in one reply as the
template renders several tool messages (`sep` between them). Otherwise the engine stops a turn on the
call's closing token: one call a turn. A call written inside an open reasoning block (`think`) is the
model thinking about a call, never run. With a chat template, the scaffold is the template's own
(templates.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
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
    sep:          between two replies of one turn (a format whose turns run to their end)
    think:        a reasoning block's opening and closing text ("", "": none)
    at_end:       the turn runs to its end (EOS) and its calls are read then (several a turn); else the
                  engine stops it on `close`, one call a turn
    user:         the text that follows a turn without a call (its EOS sampled) answered by the environment
                  as the user, `{}` its words, then the next generation prompt ("": the format has none)
    """

    open: str
    close: str
    body: str = "json"
    tool: str = ""
    reply: str = "{}"
    unreadable: str = "error: {}"
    cut: str = "…(cut)"
    sep: str = ""
    think: tuple[str, str] = ("", "")
    at_end: bool = False
    user: str = ""

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
        return self._parse(text[start + len(self.open): len(text) - len(self.close)])

    def calls(self, text: str) -> list[ToolCall | CallError]:
        """A whole turn's calls in order, those inside a reasoning block left out; each a ToolCall, or
        the CallError of one that cannot be read.

        >>> QWEN3.calls('<think>maybe <tool_call>{"name": "f"}</tool_call>?</think>'
        ...             '<tool_call>{"name": "g", "arguments": {}}</tool_call>\\n<tool_call>{"name": 1}</tool_call>')
        [ToolCall(tool_name='g', arguments={}), CallError('the call has no "name"')]
        """
        text = self.outside_reasoning(text)
        out: list[ToolCall | CallError] = []
        at = 0
        while (end := text.find(self.close, at)) >= 0:
            start = text.rfind(self.open, at, end) if self.open else at
            try:
                if start < 0:
                    raise CallError(f"{self.close!r} without {self.open!r}")
                out.append(self._parse(text[start + len(self.open): end]))
            except CallError as err:
                out.append(err)
            at = end + len(self.close)
        return out

    def outside_reasoning(self, text: str) -> str:
        """The text with its reasoning blocks taken out (an unclosed one to the end)."""
        opens, closes = self.think
        if not opens:
            return text
        kept, at = [], 0
        while (start := text.find(opens, at)) >= 0:
            kept.append(text[at:start])
            end = text.find(closes, start + len(opens))
            if end < 0:
                return "".join(kept)
            at = end + len(closes)
        return "".join(kept) + text[at:]

    def reasoning_open(self, text: str) -> bool:
        """The text ends inside a reasoning block (opened and not yet closed)."""
        opens, closes = self.think
        return bool(opens) and text.rfind(opens) > text.rfind(closes)

    def _parse(self, inner: str) -> ToolCall:
        inner = inner.strip()
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

    def written(self, call: ToolCall) -> str:
        """A call as a turn writes it (what `call` reads back), in the chat template's words for "json".

        >>> TINY.written(ToolCall("calc", {"expr": "12*34"}))
        '(12*34)'
        >>> QWEN3.written(ToolCall("calc", {"expr": "12*34"}))
        '<tool_call>\\n{"name": "calc", "arguments": {"expr": "12*34"}}\\n</tool_call>'
        """
        if self.body == "expr":
            return self.open + call.arguments["expr"] + self.close
        return f"{self.open}\n{json.dumps({'name': call.tool_name, 'arguments': call.arguments})}\n{self.close}"

    def text(self, *answers: str) -> str:
        """The text that follows a turn's calls answered `answers`."""
        head, tail = self.scaffold
        return head + self.sep.join(answers) + tail

    @property
    def scaffold(self) -> tuple[str, str]:
        """The reply's text before and after the environment's."""
        head, _, tail = self.reply.partition("{}")
        return head, tail


# Qwen3's chat template (Hermes tool calls): a call closes with the single token </tool_call>; a tool
# message is rendered inside the user turn as <tool_response>, then the assistant's generation prompt
QWEN3 = ToolFormat("<tool_call>", "</tool_call>", "json",
                   reply="<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n", sep="\n</tool_response>\n<tool_response>\n",
                   think=("<think>", "</think>"), user="\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")

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

    def ids(self, texts: str | Sequence[str], most: int | None, *, user: bool = False) -> tuple[list[int], bool]:
        """A turn's reply as ids (one text, or one per call of the turn; `user`: the environment's words as
        the user), at most `most` (None: any), and whether a text was cut to fit.

        The scaffold is kept whole and each text gets an equal share of what is left; a text is cut by
        characters first (what cannot fit is never tokenized), then by tokens, and the format's marker
        follows what was kept."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        head, tail = (self.encode(s) for s in self._scaffold(user))
        sep = self.encode(self.fmt.sep) if len(texts) > 1 else []
        share = None if most is None else (most - len(head) - len(tail) - len(sep) * (len(texts) - 1)) // len(texts)
        bodies, cut = [], False
        for text in texts:
            body, was_cut = self._body(printable(text), share)
            bodies.append(body)
            cut |= was_cut
        return head + [t for k, b in enumerate(bodies) for t in (sep if k else []) + b] + tail, cut

    def _body(self, text: str, room: int | None) -> tuple[list[int], bool]:
        cut = room is not None and len(text) > room * CHARS_PER_TOKEN
        if cut:
            text = text[: room * CHARS_PER_TOKEN]
        body = self.encode_text(text)
        if room is None or (not cut and len(body) <= room):
            return body, False
        marker = self.encode_text(self.fmt.cut)
        return body[: max(0, room - len(marker))] + marker, True

    def _scaffold(self, user: bool) -> tuple[str, str]:
        head, _, tail = self.fmt.user.partition("{}")
        return (head, tail) if user else self.fmt.scaffold

    def smallest(self, n: int = 1, *, user: bool = False) -> int:
        """The fewest tokens a cut reply to n calls (or to a turn, as the user) takes: the scaffold, and the
        marker and one token of text for each."""
        head, tail = (self.encode(s) for s in self._scaffold(user))
        sep = len(self.encode(self.fmt.sep)) if n > 1 else 0
        return len(head) + len(tail) + sep * (n - 1) + n * (len(self.encode_text(self.fmt.cut)) + 1)


def printable(text: str) -> str:
    """Text a tokenizer takes: lone surrogates (a tool's undecodable bytes) replaced."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def check_format(fmt_name: str, encode, encode_text, max_reply_tokens: int, fmt: ToolFormat | None = None) -> None:
    """The format's closing text is one token of the model's vocabulary where the engine stops a turn on
    it, and `env.max_reply_tokens` holds a cut reply (the scaffold, the marker and a token of text).
    `fmt`: the format as the model's chat template renders it (templates.py), else the named one's."""
    fmt = fmt or TOOL_FORMATS[fmt_name]
    n = len(encode(fmt.close))
    if n != 1 and not fmt.at_end:
        raise UsageError(f"env.tool_format = {fmt_name!r} closes a call with {fmt.close!r}, {n} tokens of this model's "
                         "vocabulary: the engine stops a turn on one token; choose the model's own format")
    least = Replies(fmt, encode, encode_text).smallest()
    if max_reply_tokens < least:
        raise UsageError(f"env.max_reply_tokens = {max_reply_tokens} cannot hold a reply in env.tool_format = "
                         f"{fmt_name!r}: its scaffold and cut marker take {least - 1} tokens of this model's "
                         f"vocabulary (set env.max_reply_tokens ≥ {least})")
