"""Math answers: extract the final answer, then check equivalence with math-verify.

Extraction, in order: the last \\boxed{...}; else the last match of `answer_pattern`
("answer: 12", "the answer is 12"); else the last number. The extracted text and the reference
are parsed by math-verify (LaTeX and plain expressions) and compared symbolically; no hand-written
LaTeX parsing here. Time limits come from the caller (`rewards.pool`), so math-verify's own
SIGALRM timers are switched off rather than nested.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from rewards.base import NeedsAnswer, Score

# math-verify warns on every call that its own timeouts are off; we enforce them in rewards.pool.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
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

    def __init__(self, answer_field: str = "answer", answer_pattern: str = DEFAULT_PATTERN, last_number: bool = True):
        self.answer_field, self.pattern, self.last_number = answer_field, re.compile(answer_pattern), last_number

    def extract(self, response: str) -> tuple[str, str] | None:
        """(how, text) of the final answer, or None."""
        if "\\boxed" in response or "\\fbox" in response:
            return "boxed", response
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
