"""Math answers checked with math-verify (extraction of \\boxed{} / final answers, symbolic equivalence)."""

from __future__ import annotations

from typing import Any

from rewards.base import Score


class MathGrader:
    """1 if math-verify finds the response's final answer equivalent to the reference.

    >>> MathGrader()({"answer": "\\\\frac{1}{2}"}, "so the answer is \\\\boxed{0.5}.").score
    1.0
    """

    def __init__(self, answer_field: str = "answer", timeout_s: float = 5.0):
        self.answer_field, self.timeout_s = answer_field, timeout_s

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        from math_verify import parse, verify

        gold = parse(f"${record[self.answer_field]}$")
        pred = parse(response)
        if not pred:
            return Score(0.0, {"extracted": None})
        ok = verify(gold, pred, timeout_seconds=int(max(1, self.timeout_s)))
        return Score(float(ok), {"extracted": str(pred[-1]) if pred else None})
