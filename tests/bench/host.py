"""Where a benchmark ran: the commit it measured and the machine as its runs recorded it.

The figures of a round belong to a commit and a host (the CPU's vector instructions pick different
kernels, and the hosts lent here differ by 1.5× in speed: docs/results/speed.md). `commit()` is read
before the runs; `machine(env)` reads the `env` a run wrote into its summary.json, so the line says
what the measured process itself saw.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The checkout's commit, and whether tracked files differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on this machine
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown (not a git checkout)"
    return head + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine(env: dict) -> str:
    """One line of a run summary's `env`: the CPU, its vector flags, threads and the engines' versions."""
    flags = ", ".join(env.get("cpu_flags") or []) or "none of AVX2, AVX-512, AMX"
    return (f"{env.get('cpu', '?')} (family/model {env.get('cpu_family_model', '?')}; {flags}), "
            f"{env.get('threads', '?')} threads; torch {env.get('torch', '?')}, vLLM {env.get('vllm', '?')}")
