"""Fault injection for tests, read here and nowhere else. `install` puts each fault where it happens
(around the run's step, its rollouts' output, its advantages, the trainer's loss and gradients, the
parity check) when a MINIRL_INJECT_* variable asks for it, so the step itself has no fault in it.

MINIRL_INJECT_KILL="1@3" SIGKILLs rank 1 as step 3 begins (as an OOM killer or a lost node
would), on a job's first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT), so that
`torchrun --max-restarts` has something to restart.

MINIRL_INJECT_NAN="loss@3,grad@5" makes step 3's loss and step 5's gradients NaN, to show that the
guard keeps them out of the weights: `at_step` says what to poison ("loss", "grad", "logp", "parity" or None).

MINIRL_INJECT_NAN="logp@2" breaks the rollout engine's output at step 2 as the FP8 engine broke on a
GPU (#72): every sampled token's log μ after a response's first is NaN (`break_logprobs`), which
the run must stop on before training. "parity@3": step 3's parity check comes back NaN.

MINIRL_INJECT_SKEW="3" shifts every log μ the engine returns by +0.5 from step 3 on: a mismatch
between engine and trainer that grows KL(μ‖π_old) beyond any lag (`skew_logprobs`), which the guard
must still roll back at k ≥ 1 (#74): "skew".

MINIRL_INJECT_DROP_WEIGHT="model.norm.weight" leaves that weight out of every weight sync, as a
trainer whose names the engine does not map would (`drop_weight`, called by rollout/sync.py on
what it sends): the first sync must stop the run in one line naming it (#79).

MINIRL_INJECT_END="kill" SIGKILLs the run as its final HF folder begins (an OOM kill at the end of
a 30B run, #80: the resume must write the summary, never try the same end again); "fail" makes
that write raise a full disk's OSError (the summary says so, exit code 4). `at_end`, called by
run/final_weights.py on the rank that writes.

MINIRL_INJECT_INVERT="100" trains on the rewards inverted (1 − r) from step 100 on, while the
reward logged and judged stays the grader's: the policy unlearns the task and the reward slides
with the entropy calm, the slide the guard must catch (#64): "invert".

MINIRL_INJECT_EVAL_STOP="1" sends `minirl eval` a SIGINT as soon as it has kept 1 problem (its progress
callback: `eval_progress`), a Ctrl-C at a known point: the evaluation must say what it kept and the same
command resume from there.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import signal


STEP_FAULTS = ("MINIRL_INJECT_KILL", "MINIRL_INJECT_NAN", "MINIRL_INJECT_INVERT", "MINIRL_INJECT_SKEW")


def at_step(step: int) -> str | None:
    """What step `step` is to suffer, one thing a step: a NaN first, else the inverted rewards, else the skew."""
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


def kill_at(step: int, rank: int) -> None:
    kill = os.environ.get("MINIRL_INJECT_KILL", "")
    if kill and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and kill == f"{rank}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def install(run) -> None:
    """Wrap an RLRun's parts with the step faults the environment asks for; with none, nothing is
    wrapped. The step under way is `run.state.step + 1` (the step sets its number as it ends)."""
    if not any(os.environ.get(k) for k in STEP_FAULTS):
        return
    trainer, rollouts = run.trainer, run.rollouts

    def now() -> str | None:
        return at_step(run.state.step + 1)

    def step(f=run.step):
        kill_at(run.state.step + 1, run.world.rank)  # as the step begins
        return f()

    def next_batch(at: int, f=rollouts.next):
        problems, groups = f(at)
        what = at_step(at)
        return problems, (break_logprobs(groups) if what == "logp" else
                          skew_logprobs(groups) if what == "skew" else groups)

    def advantages(rewards_PG, trains_PG=None, f=run.advantages):  # trained on 1 − r; the reward logged stays r
        return f(1 - rewards_PG if now() == "invert" else rewards_PG, trains_PG)

    def forward_backward(mb, loss_fn, f=trainer.forward_backward, **kw):
        if now() == "loss":
            loss_fn = poisoned(loss_fn)
        return f(mb, loss_fn, **kw)

    def clip_grads(f=trainer.clip_grads):
        if now() == "grad":
            trainer.fill_grads(math.nan)
        return f()

    def parity(f=run.parity):
        return math.nan if now() == "parity" else f()

    run.step, run.advantages, run.parity = step, advantages, parity
    rollouts.next, trainer.forward_backward, trainer.clip_grads = next_batch, forward_backward, clip_grads


def poisoned(loss_fn):
    """A loss function whose value comes out NaN, its metrics as they were."""
    def nan_loss(*args, **kw):
        value, metrics = loss_fn(*args, **kw)
        return value * math.nan, metrics
    return nan_loss


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


def eval_progress(on_progress):
    """`on_progress` of an evaluation, followed by a SIGINT to this process once MINIRL_INJECT_EVAL_STOP
    problems are kept; `on_progress` itself where it is not set."""
    at = os.environ.get("MINIRL_INJECT_EVAL_STOP", "")
    if not at.isdigit():
        return on_progress

    def progress(done: int, total: int) -> None:
        on_progress(done, total)
        if done >= int(at):
            os.kill(os.getpid(), signal.SIGINT)

    return progress
