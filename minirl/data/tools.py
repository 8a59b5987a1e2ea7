"""The embedded tools task's environment (`minirl init --task tools`, #84): a calculator, in OpenEnv's
shape (minirl/envs/contract.py), and as a TRL environment class (`CalculatorTools`, Qwen3's format).
`calc` evaluates integer arithmetic (+, −, × and brackets) of at most 32 characters; anything else is
answered "?", which the tiny vocabulary can write."""

from __future__ import annotations

import ast

from minirl.envs.contract import Observation

MAX_EXPR = 32


def calc(expr: str) -> str:
    """The value of an integer expression, or "?".

    >>> calc("123*45"), calc("2+3*(4-1)"), calc("12/3"), calc("__import__('os')"), calc("9" * 40)
    ('5535', '11', '?', '?', '?')
    """
    if not isinstance(expr, str) or not 0 < len(expr) <= MAX_EXPR:
        return "?"
    try:
        tree = ast.parse(expr.lstrip("0") or "0", mode="eval").body
    except SyntaxError:
        return "?"

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
                else left * right
        raise ValueError(ast.dump(node))

    try:
        return str(value(tree))
    except ValueError:
        return "?"


class Calculator:
    """One episode's calculator: the tool `calc` with the argument `expr`."""

    def reset(self, seed=None, episode_id=None, **row) -> Observation:
        self.calls = 0
        return Observation(metadata={"tools": ["calc"]})

    def step(self, action, timeout_s=None, **kw) -> Observation:
        self.calls += 1
        if action.tool_name != "calc":
            return Observation(result="?")
        return Observation(result=calc(action.arguments.get("expr", "")))

    def close(self) -> None:
        pass


class CalculatorTools:
    """The same calculator as TRL's `environment_factory` writes an environment (the tools task in
    Qwen3's chat format): its public method is the tool, described to the model by its signature and
    docstring through the chat template; the grader scores the answer."""

    def reset(self, **row) -> None:
        return None

    def calc(self, expr: str) -> str:
        """Evaluate integer arithmetic.

        Args:
            expr: integers with +, - and *, and brackets
        """
        return calc(expr)
