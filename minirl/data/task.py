"""The embedded synthetic tasks, each with an exactly verifiable answer (`minirl init --task NAME`).

- `addition` (the default): 3-digit addition, "123+456=" -> "579<eos>". 3–4 answer digits plus
  EOS, each digit depending on a carry from the digit to its right. Graded by
  `rewards.builtin.ArithGrader`. Calibrated on the 2-core CPU (PLATFORM.md): ~1,000 cold-start SFT
  steps leave a 1M-param MoE at ~45–65% held-out accuracy, which RL lifts by 25+ points within
  minutes.
- `scratchpad`: 3–5-digit addition written out column by column, right to left, then the sum:
  "4827+3956=" -> "7+6=13,2+5+1=8,8+9=17,4+3+1=8;8783<eos>". 20–46 tokens of dependent steps (a
  carry is written as "+1" in the next column), so one early slip ruins the answer. Only the
  final answer counts (the regex grader reads what follows the last ";"): the reward stays
  binary and exactly verifiable, and RL is free to change how the steps are written. This is the
  stage for per-token effects (IS weights, clipping, length normalisation, routing drift) that
  4-token answers leave no room for (`minirl lab`).
- `scratchpad-long`: the same written-out addition on 10–13-digit operands: 71–127 response tokens
  (mean ~98), where a per-token gap adds up per response the way the paper's long responses do.
- `tools`: products of a 2–3-digit and a 2-digit number, "123*45=" -> "5535<eos>", which the tiny
  model cannot work out in its head, with a calculator it may call (multi-turn episodes, #84;
  minirl/data/tools.py): "(123*45)" calls it, the environment answers "=5535;" (not trained on), the
  model copies the answer. The cold start shows the call on half the problems and a bare answer on
  the other half; RL is left to learn that calling pays.

Train and held-out splits are disjoint in (a, b).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minirl.envs.contract import ToolCall
from minirl.envs.formats import TINY, ToolFormat

LO, HI = 100, 999


@dataclass(frozen=True)
class Task:
    name: str
    recipe: str  # the shipped recipe (recipes/<stem>.toml) a workspace of this task starts from
    problem: Callable[[random.Random], tuple[int, int]]  # draws one (a, b)
    answer: Callable[[int, int], str]  # the SFT target (the grader checks the result)
    op: str = "+"
    # a multi-turn task's SFT target as (text, trained) parts in a tool format: an environment's reply is
    # not trained on
    parts: Callable[[int, int, ToolFormat], list[tuple[str, bool]]] | None = None


def _addition(rng: random.Random) -> tuple[int, int]:
    return rng.randint(LO, HI), rng.randint(LO, HI)


def _scratchpad_problem(rng: random.Random) -> tuple[int, int]:
    d = rng.randint(3, 5)
    return rng.randint(10 ** (d - 1), 10 ** d - 1), rng.randint(10 ** (d - 1), 10 ** d - 1)


def _long_scratchpad_problem(rng: random.Random) -> tuple[int, int]:
    d = rng.randint(10, 13)
    return rng.randint(10 ** (d - 1), 10 ** d - 1), rng.randint(10 ** (d - 1), 10 ** d - 1)


def scratchpad(a: int, b: int) -> str:
    """The written-out column addition of a + b, then ";" and the sum.

    >>> scratchpad(4827, 3956)
    '7+6=13,2+5+1=8,8+9=17,4+3+1=8;8783'
    >>> scratchpad(999, 1)
    '9+1=10,9+0+1=10,9+0+1=10;1000'
    """
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        carry = s // 10
    return ",".join(steps) + f";{a + b}"


def _product_problem(rng: random.Random) -> tuple[int, int]:
    return rng.randint(10, 999), rng.randint(10, 99)


def tool_parts(a: int, b: int, fmt: ToolFormat = TINY) -> list[tuple[str, bool]]:
    """The tools task's cold-start target in a tool format: on half the problems (a + b even) the call,
    the calculator's reply (not trained on) and the answer copied; on the others the bare answer.

    >>> tool_parts(123, 45)
    [('(123*45)', True), ('=5535;', False), ('5535', True)]
    >>> tool_parts(12, 45)
    [('540', True)]
    """
    p = str(a * b)
    call = fmt.written(ToolCall("calc", {"expr": f"{a}*{b}"}))
    return [(call, True), (fmt.text(p), False), (p, True)] if (a + b) % 2 == 0 else [(p, True)]


TASKS = {
    "addition": Task("addition", "tiny", _addition, lambda a, b: str(a + b)),
    "scratchpad": Task("scratchpad", "tiny-scratchpad", _scratchpad_problem, scratchpad),
    "scratchpad-long": Task("scratchpad-long", "tiny-scratchpad-long", _long_scratchpad_problem, scratchpad),
    "tools": Task("tools", "tiny-tools", _product_problem, lambda a, b: str(a * b), op="*", parts=tool_parts),
}


def make_splits(train_size: int, heldout_size: int, seed: int = 0, task: str = "addition",
                fmt: ToolFormat = TINY) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out rows {"prompt", "answer", "target"}: `answer` is what the
    grader checks (the sum), `target` the full response the cold start imitates; a multi-turn task's
    rows have `parts` instead, (text, trained) pairs, in the tool format `fmt`."""
    t = TASKS[task]
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    total = train_size + heldout_size
    while len(pairs) < total:
        pairs.add(t.problem(rng))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    value = (lambda a, b: a * b) if t.op == "*" else (lambda a, b: a + b)
    recs = [{"prompt": f"{a}{t.op}{b}=", "answer": str(value(a, b)),
             **({"target": t.answer(a, b)} if task not in ("addition", "tools") else {}),
             **({"parts": t.parts(a, b, fmt)} if t.parts else {})}
            for a, b in ordered]
    return recs[:train_size], recs[train_size:]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path
