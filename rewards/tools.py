"""Environments whose tool runs code (#84): a model's Python, run in the code grader's sandbox
(rewards/sandbox.py: limits, namespaces, no network, its own small root), answered with what it printed.

OpenEnv's shape (minirl/envs/contract.py): `env.name = "rewards.tools:PythonTool"` with
`env.tool_format = "qwen3"`, and the model calls `{"name": "python", "arguments": {"code": "print(6*7)"}}`.
The task's grader scores the final answer; the tool gives no reward of its own.
"""

from __future__ import annotations

from minirl.envs.contract import Observation
from rewards import sandbox

MAX_CODE = 20_000  # characters of one call's program


class PythonTool:
    """One episode's Python: each call a fresh sandboxed process (nothing carries over between calls)."""

    def __init__(self, wall_s: float = 5.0, cpu_s: int = 5, memory_mib: int = 512):
        self.limits = sandbox.Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mib=memory_mib)

    def reset(self, seed=None, episode_id=None, **row) -> Observation:
        self.calls = 0
        return Observation(metadata={"tools": ["python"]})

    def step(self, action, timeout_s=None, **kw) -> Observation:
        self.calls += 1
        code = action.arguments.get("code")
        if action.tool_name != "python" or not isinstance(code, str):
            return Observation(error=f"no tool {action.tool_name!r} taking {sorted(action.arguments)}: "
                                     "call python with {\"code\": ...}")
        if len(code) > MAX_CODE:
            return Observation(error=f"a program of {len(code)} characters (at most {MAX_CODE})")
        out = sandbox.run({"program": code, "tests": [{"kind": "output", "stdin": ""}]}, self.limits)
        printed = [why for kind, _, why in out.reports if kind == "output"]
        if printed:
            return Observation(result=printed[0])
        if out.timed_out:
            return Observation(error=f"it ran past {self.limits.wall_s:g} s")
        failed = [why for kind, _, why in out.reports if kind == "fail"]
        return Observation(error=failed[0].removeprefix("error: ") if failed else
                           f"the sandbox ended with {out.returncode}")

    def close(self) -> None:
        pass
