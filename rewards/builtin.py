"""Built-in graders that need no symbolic maths: exact, numeric, regex and the embedded task's."""

from __future__ import annotations

import re
from typing import Any

from rewards.base import NeedsAnswer, Score

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


class ExactGrader(NeedsAnswer):
    """1 if the stripped response equals the answer field.

    >>> ExactGrader()({"answer": "Paris"}, " Paris ").score
    1.0
    """

    def __init__(self, answer_field: str = "answer", case_sensitive: bool = True):
        self.answer_field, self.case_sensitive = answer_field, case_sensitive

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        got, want = response.strip(), str(record[self.answer_field]).strip()
        if not self.case_sensitive:
            got, want = got.lower(), want.lower()
        return Score(float(got == want), {"extracted": got})


class NumericGrader(NeedsAnswer):
    """1 if the last number in the response is within `tol` (absolute or relative) of the answer.

    >>> NumericGrader(tol=1e-3)({"answer": "0.5"}, "so it is 0.5001").score
    1.0
    """

    def __init__(self, answer_field: str = "answer", tol: float = 1e-6, relative: bool = False):
        self.answer_field, self.tol, self.relative = answer_field, tol, relative

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        got = _last_number(response)
        if got is None:
            return Score(0.0, {"extracted": None})
        try:
            g, w = float(got), float(str(record[self.answer_field]).replace(",", ""))
        except ValueError:
            return Score(0.0, {"extracted": got, "error": "not a number"})
        bound = self.tol * max(abs(w), 1e-12) if self.relative else self.tol
        return Score(float(abs(g - w) <= bound), {"extracted": got})


class RegexGrader(NeedsAnswer):
    """Extract with `pattern` (first group, else whole match) and compare exactly to the answer.

    >>> RegexGrader(pattern=r"answer: (\\w+)")({"answer": "B"}, "... answer: B").score
    1.0
    """

    def __init__(self, pattern: str, answer_field: str = "answer"):
        self.pattern, self.answer_field = re.compile(pattern), answer_field

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        m = None
        for m in self.pattern.finditer(response):
            pass
        if m is None:
            return Score(0.0, {"extracted": None})
        got = (m.group(1) if m.groups() else m.group(0)).strip()
        return Score(float(got == str(record[self.answer_field]).strip()), {"extracted": got})


class ArithGrader(NeedsAnswer):
    """The embedded arithmetic task: the response (up to EOS) must be exactly the integer answer.

    Strict on purpose: "579" is right for 123+456, "0579" or "579 " are not; the model has to
    learn the format as well as the sum.

    >>> ArithGrader()({"answer": "579"}, "579").score, ArithGrader()({"answer": "579"}, "578").score
    (1.0, 0.0)
    """

    def __init__(self, answer_field: str = "answer"):
        self.answer_field = answer_field

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        return Score(float(response == str(record[self.answer_field])), {"extracted": response})
