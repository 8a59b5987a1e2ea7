"""`code`: a response passes when its program passes every one of the problem's tests, run in a
sandbox (rewards/sandbox.py, rewards/harness.py) that RL cannot game.

Two kinds of problem record:
- a function to complete, HumanEval's fields: `prompt` (signature and docstring), `test` (a
  `check(candidate)` function) and `entry_point` (the function's name);
- a program reading stdin, with cases `{"inputs": [...], "outputs": [...]}` in `input_output`
  (a dict or its JSON, APPS' layout) or as `inputs` / `outputs` fields.

The program is the last fenced Python block of the response (placed after the prompt, so the
prompt's imports and helpers are there and its own definition wins), or else the response as the
continuation of the prompt, cut where a completion model starts writing something else.

>>> rec = {"prompt": "def add(a, b):\\n", "test": "def check(c):\\n    assert c(2, 3) == 5\\n", "entry_point": "add"}
>>> CodeGrader()(rec, "    return a + b\\n").score, CodeGrader()(rec, "    return a - b\\n").info["verdict"]
(1.0, 'failed')
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rewards import sandbox
from rewards.base import Score

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)
# where a completion model stops writing the function: HumanEval's stop sequences, less "\ndef"
# (a helper after the function is part of the answer)
STOPS = ("\nclass ", "\nif __name__", "\nprint(", "\nassert ", "\n```")


class CodeGrader:
    """Sandboxed unit tests; 1 only when every test passed. `info["verdict"]` is passed, failed,
    error, timeout, killed or hack (with `why`). Never raises on model output."""

    def __init__(self, prompt_field: str = "prompt", test_field: str = "test", entry_point_field: str = "entry_point",
                 io_field: str = "input_output", timeout_s: float = 10.0, memory_mib: int = 1024,
                 parallel: int = 0):
        self.prompt_field, self.test_field, self.entry_point_field = prompt_field, test_field, entry_point_field
        self.io_field = io_field
        self.limits = sandbox.Limits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s)), memory_mib=memory_mib)
        # sandboxes mostly wait (start-up, pipes): more of them than cores keeps the cores busy
        self.parallel = parallel or 4 * (len(os.sched_getaffinity(0)) or 1)

    @property
    def fields(self) -> tuple[tuple[str, ...], ...]:
        """A function to complete (its tests and name), or stdin/stdout cases (APPS' layout or two fields)."""
        return (self.test_field, self.entry_point_field), (self.io_field,), ("inputs", "outputs")

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        return self.grade_batch([(record, response)])[0]

    def grade_batch(self, items: list[tuple[dict[str, Any], str]]) -> list[Score]:
        """Every item in a sandbox of its own, `parallel` at a time; scores in input order. The
        batch takes about one wall-clock limit longer than its slowest program, at most."""
        if len(items) <= 1:
            return [self._grade(r, s) for r, s in items]
        with ThreadPoolExecutor(min(self.parallel, len(items))) as pool:
            return list(pool.map(lambda item: self._grade(*item), items))

    def _grade(self, record: dict[str, Any], response: str) -> Score:
        try:
            job = self.job(record, response)
        except (KeyError, TypeError, ValueError) as e:  # the record, not the response: said, scored 0
            return Score(0.0, {"verdict": "error", "why": f"problem record: {type(e).__name__}: {e}"})
        try:
            outcome = sandbox.run(job, self.limits)
        except OSError as e:  # no process could start (descriptors, memory): the machine's trouble
            return Score(0.0, {"verdict": "error", "why": f"sandbox: {e}"})
        return verdict(outcome, len(job["tests"]))

    def job(self, record: dict[str, Any], response: str) -> dict:
        """What the harness runs: the program and the tests."""
        prompt = str(record.get(self.prompt_field) or "")
        cases = _cases(record, self.io_field)
        if cases is not None:
            program = extract_program(response, "", None)
            return {"program": program, "tests": [{"kind": "io", "stdin": i, "stdout": o} for i, o in cases]}
        entry = str(record[self.entry_point_field])
        test = {"kind": "function", "prompt": prompt, "test": str(record[self.test_field]), "entry_point": entry}
        return {"program": extract_program(response, prompt, entry), "tests": [test]}


def extract_program(response: str, prompt: str, entry_point: str | None) -> str:
    """The program a response stands for (see the module's docstring).

    >>> extract_program("Here:\\n```python\\ndef f():\\n    return 1\\n```", "def f():\\n", "f").endswith("return 1\\n")
    True
    """
    blocks = FENCE.findall(response)
    if blocks:
        defining = [b for b in blocks if entry_point and re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M)]
        block = (defining or blocks)[-1]
        return f"{prompt}\n{block}" if prompt else block
    body = response
    for stop in STOPS:
        cut = body.find(stop)
        body = body if cut < 0 else body[:cut]
    return prompt + body


def _cases(record: dict[str, Any], io_field: str) -> list[tuple[str, str]] | None:
    spec = record.get(io_field)
    if isinstance(spec, str) and spec.strip():
        spec = json.loads(spec)
    if not isinstance(spec, dict):
        spec = {"inputs": record.get("inputs"), "outputs": record.get("outputs")} if "inputs" in record else None
    if spec is None:
        return None
    ins, outs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs) or not ins:
        raise ValueError(f"{io_field}: need equally long, non-empty 'inputs' and 'outputs' lists")
    return [(_text(i), _text(o)) for i, o in zip(ins, outs)]


def _text(x) -> str:
    return x if isinstance(x, str) else "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def verdict(outcome: sandbox.Outcome, n_tests: int) -> Score:
    """1 only when the harness reported, with this run's secret, a pass for every test and then
    done; anything less scores 0 with the reason. Nothing the program prints counts."""
    passed = {i for kind, i, _ in outcome.reports if kind == "pass"}
    fails = [why for kind, _, why in outcome.reports if kind == "fail"]
    done = any(kind == "done" for kind, _, _ in outcome.reports)
    info = {"tests": n_tests, "passed": len(passed & set(range(n_tests))), "seconds": round(outcome.seconds, 3)}
    if done and passed == set(range(n_tests)):
        return Score(1.0, {"verdict": "passed", **info})
    if outcome.timed_out:
        return Score(0.0, {"verdict": "timeout", "why": "wall-clock limit", **info})
    why = fails[0] if fails else ""
    if why.startswith(("hack:", "exit:")) or (why.startswith("gone:") and "exited with code 0" in why):
        return Score(0.0, {"verdict": "hack", "why": why, **info})
    if why.startswith("gone:") or not done:
        return Score(0.0, {"verdict": "killed", "why": why or f"the sandbox ended with {outcome.returncode}", **info})
    return Score(0.0, {"verdict": "error" if why.startswith("error:") else "failed", "why": why, **info})
