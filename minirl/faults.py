"""Fault injection for tests, read here and nowhere else. The step calls `at_step` once, as it begins.

MINIRL_INJECT_KILL="1@3" SIGKILLs rank 1 as step 3 begins (as an OOM killer or a lost node
would), on a job's first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT), so that
`torchrun --max-restarts` has something to restart.

MINIRL_INJECT_NAN="loss@3,grad@5" makes step 3's loss and step 5's gradients NaN, to show that the
guard keeps them out of the weights: `at_step` returns what to poison ("loss", "grad", "logp", "parity" or None).

MINIRL_INJECT_NAN="logp@2" breaks the rollout engine's output at step 2 as the FP8 engine broke on a
GPU (#72): every sampled token's log μ after a response's first is NaN (`break_logprobs`), which
the run must stop on before training. "parity@3": step 3's parity check comes back NaN.

MINIRL_INJECT_SKEW="3" shifts every log μ the engine returns by +0.5 from step 3 on: a mismatch
between engine and trainer that grows KL(μ‖π_old) beyond any lag (`skew_logprobs`), which the guard
must still roll back at k ≥ 1 (#74). `at_step` returns "skew".

MINIRL_INJECT_DROP_WEIGHT="model.norm.weight" leaves that weight out of every weight sync, as a
trainer whose names the engine does not map would (`drop_weight`, called by rollout/sync.py on
what it sends): the first sync must stop the run in one line naming it (#79).

MINIRL_INJECT_END="kill" SIGKILLs the run as its final HF folder begins (an OOM kill at the end of
a 30B run, #80: the resume must write the summary, never try the same end again); "fail" makes
that write raise a full disk's OSError (the summary says so, exit code 4). `at_end`, called by
run/final_weights.py on the rank that writes.

MINIRL_INJECT_INVERT="100" trains on the rewards inverted (1 − r) from step 100 on, while the
reward logged and judged stays the grader's: the policy unlearns the task and the reward slides
with the entropy calm, the slide the guard must catch (#64). `at_step` returns "invert".
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import signal


def at_step(step: int, rank: int) -> str | None:
    kill = os.environ.get("MINIRL_INJECT_KILL", "")
    if kill and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and kill == f"{rank}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    for item in os.environ.get("MINIRL_INJECT_NAN", "").split(","):
        what, _, at = item.strip().partition("@")
        if what in ("loss", "grad", "logp", "parity") and at.isdigit() and int(at) == step:
            return what
    invert = os.environ.get("MINIRL_INJECT_INVERT", "")
    if invert.isdigit() and step >= int(invert):
        return "invert"
    skew = os.environ.get("MINIRL_INJECT_SKEW", "")
    if skew.isdigit() and step >= int(skew):
        return "skew"
    return None


def at_end() -> None:
    what = os.environ.get("MINIRL_INJECT_END", "")
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "fail":
        raise OSError(errno.ENOSPC, "No space left on device (MINIRL_INJECT_END)")


def skew_logprobs(groups: list[list], by: float = 0.5) -> list[list]:
    """Completions as an engine that drifted from the trainer returns them: log μ shifted by `by`."""
    return [[dataclasses.replace(c, logprobs=tuple(x + by for x in c.logprobs)) for c in g] for g in groups]


def break_logprobs(groups: list[list]) -> list[list]:
    """Completions as a broken engine returns them: log μ NaN after each response's first token."""
    return [[dataclasses.replace(c, logprobs=tuple(c.logprobs[:1]) + (math.nan,) * (len(c.logprobs) - 1))
             for c in g] for g in groups]


def drop_weight(weights):
    """What a sync sends (a bucket of (name, tensor) pairs, or a dict of views), less the weight
    MINIRL_INJECT_DROP_WEIGHT names; unchanged when it names none."""
    name = os.environ.get("MINIRL_INJECT_DROP_WEIGHT", "")
    if not name:
        return weights
    if isinstance(weights, dict):
        return {k: v for k, v in weights.items() if k != name}
    return [(k, v) for k, v in weights if k != name]
