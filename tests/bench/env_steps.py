"""What a batch's environments cost: B episodes whose first turn each calls the Python tool
(`rewards.tools:PythonTool`, each call a fresh sandboxed process), each environment on its own worker
as the turn loop runs them (minirl/envs/hosting.py), against the same calls one after another; and B
episodes of an environment whose constructor and close each take `--start` seconds (a server's
session opened and closed), against the same batch with instant ones. The engine is a double that
returns the same two turns to every prompt (Qwen3's call format, a character tokenizer), so the
figures are the environments' alone.

    .venv/bin/python tests/bench/env_steps.py [--episodes 16] [--sleep 0.2] [--start 0.2]

`--sleep S`: each program sleeps S seconds first (a tool that waits on I/O: a search, a server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


CLOSE = 1_000_000  # Qwen3's "</tool_call>", one token as in its vocabulary


def encode(text: str) -> list[int]:
    """A character tokenizer that spells Qwen3's closing tag as the one token its vocabulary has."""
    parts = text.split("</tool_call>")
    return [t for k, part in enumerate(parts) for t in ([CLOSE] if k else []) + [ord(ch) for ch in part]]


def decode(ids) -> str:
    return "".join("</tool_call>" if t == CLOSE else chr(t) for t in ids)


def main() -> None:
    from minirl.envs.contract import Observation, ToolCall
    from minirl.envs.formats import QWEN3
    from minirl.rollout.engine import Completion
    from minirl.rollout.turn_loop import sample_episodes
    from rewards.tools import PythonTool

    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--start", type=float, default=0.2)
    args = ap.parse_args()

    code = f"import time; time.sleep({args.sleep}); print(6*7)" if args.sleep else "print(6*7)"
    call = encode("<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>")
    answer = encode("42") + [0]

    class Double:  # every prompt: the call, then the answer
        def __init__(self):
            self.turn = 0

        def generate(self, prompts, *, n, max_tokens, stop, **kw):
            ids = tuple(call if self.turn == 0 else answer)
            self.turn += 1
            return [[Completion(ids, (-0.5,) * len(ids), "stop") for _ in range(n)] for _ in prompts]

    B = args.episodes

    def batch(envs) -> tuple[float, list]:
        t0 = time.perf_counter()
        groups = sample_episodes(Double(), [encode("6*7=")] * B, envs, fmt=QWEN3, encode=encode, decode=decode, n=1,
                                 temperature=1.0, max_tokens=4096, max_turns=2, max_model_len=100_000,
                                 step_timeout_s=60)
        return time.perf_counter() - t0, groups

    envs = [[PythonTool(wall_s=10)] for _ in range(B)]
    for (env,) in envs:
        env.reset()
    together, groups = batch(envs)
    got = [c.episode for g in groups for c in g]
    assert all(e.tool_calls == 1 and e.tool_errors == 0 and e.env_errors == 0 for e in got), got[0]

    t0 = time.perf_counter()
    for (env,) in envs:  # the same calls, one after another (the turn loop before it stepped them together)
        assert env.step(ToolCall("python", {"code": code})).error is None
    serial = time.perf_counter() - t0
    cores = len(os.sched_getaffinity(0))
    print(f"{B} Python tool calls (sleep {args.sleep:g} s each, {cores} cores): stepped "
          f"together {together:.2f} s, one after another {serial:.2f} s ({serial / together:.1f}x)")

    class Session:  # a server's session: opened by the constructor, closed by close
        wait = 0.0

        def __init__(self):
            time.sleep(Session.wait)

        def reset(self):
            pass

        def step(self, action):
            return Observation(result="42")

        def close(self):
            time.sleep(Session.wait)

    call = encode('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    quick, _ = batch([[Session] for _ in range(B)])
    Session.wait = args.start
    slow, groups = batch([[Session] for _ in range(B)])
    assert all(c.episode.env_errors == 0 and c.episode.tool_calls == 1 for g in groups for c in g)
    print(f"{B} episodes whose constructor and close take {args.start:g} s each: the batch {slow:.2f} s against "
          f"{quick:.2f} s with instant ones: {slow - quick:.2f} s more (one after another: {2 * B * args.start:.1f} s)")


if __name__ == "__main__":
    main()
