"""Math answers: extract the final answer, then check equivalence with math-verify.

The answer is read from the response's final part (#81): a reasoning model thinks inside
`<think>…</think>` (R1 and Qwen3; `reasoning_tags` for other conventions, none to grade the whole
response), and what it writes there is a draft, never its answer. The final part is what follows
the last closing tag (a chat template that opens the block in the prompt leaves only the closing
tag in the response); a block opened and never closed (cut off mid-thought) leaves no answer; a
response without tags is its own final part. Within it, in order: the last \\boxed{...} alone (a
model that boxes, doubts and boxes again means the last; math-verify given every box reads them as
one set); else the last match of `answer_pattern` ("answer: 12", "the answer is 12"); else the last
number. The extracted text and the reference are parsed by math-verify (LaTeX and plain
expressions) and compared symbolically. Time limits come from the caller (`rewards.pool`), so
math-verify's own SIGALRM timers are switched off rather than nested.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from rewards.base import REASONING_TAGS, NeedsAnswer, Score, final_part
from rewards.base import reasoning_tags as checked_tags

# math-verify warns on every call that its own timeouts are off; we enforce them in rewards.pool.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
DEFAULT_PATTERN = r"(?i)answer(?:\s+is)?\s*[:=]?\s*\$?([^\n$]+)"


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    return parse(f"${text}$", extraction_config=cfg, parsing_timeout=None) or parse(text, parsing_timeout=None)


def _parse_pred(text: str, *, boxed: bool):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if boxed:
        cfg = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
        return parse(text, extraction_config=cfg, parsing_timeout=None)
    return parse(f"${text}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)


class MathGrader(NeedsAnswer):
    """1 if the response's final answer is mathematically equivalent to the reference.

    >>> g = MathGrader()
    >>> g({"answer": "\\\\frac{1}{2}"}, "so the answer is \\\\boxed{0.5}.").score
    1.0
    >>> g({"answer": "70"}, "... Answer: 70").score, g({"answer": "70"}, "I get 69 then 70").score
    (1.0, 1.0)
    """

    def __init__(self, answer_field: str = "answer", answer_pattern: str = DEFAULT_PATTERN, last_number: bool = True,
                 reasoning_tags: tuple[str, str] | list[str] | None = REASONING_TAGS):
        self.answer_field, self.pattern, self.last_number = answer_field, re.compile(answer_pattern), last_number
        self.tags = checked_tags(reasoning_tags)

    def final_part(self, response: str) -> str | None:
        return final_part(response, self.tags)

    def extract(self, response: str) -> tuple[str, str] | None:
        """(how, text) of the final answer, or None."""
        response = self.final_part(response)
        if response is None:
            return None
        box = _last_box(response)
        if box is not None:
            return "boxed", box
        matches = self.pattern.findall(response)
        if matches:
            return "pattern", matches[-1].strip().rstrip(".")
        if self.last_number:
            nums = _NUMBER.findall(response)
            if nums:
                return "last_number", nums[-1].replace(",", "")
        return None

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        from math_verify import verify

        found = self.extract(response)
        if found is None:
            return Score(0.0, {"extracted": None})
        how, text = found
        pred = _parse_pred(text, boxed=how == "boxed")
        if not pred:
            return Score(0.0, {"extracted": None, "how": how})
        gold = _parse_gold(str(record[self.answer_field]))
        ok = verify(gold, pred, timeout_seconds=None)
        return Score(float(ok), {"extracted": str(pred[-1]), "how": how})


def _last_box(text: str) -> str | None:
    """The last \\boxed{…} (or \\fbox) of `text` with its braces balanced (to the end of the text
    when they never close), or None."""
    starts = [m for m in _BOX.finditer(text)]
    if not starts:
        return None
    start, depth = starts[-1], 1
    for i in range(start.end(), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start.start():i + 1]
    return text[start.start():]
