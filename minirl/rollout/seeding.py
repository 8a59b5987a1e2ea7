"""How rollouts are seeded: one generator seed per `generate` call, a pure function of the call's
seed and the rollout group's stream, so a resumed run or a repeated lab cell samples the same noise."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

# How `generate` seeds its samples; runs recorded under another scheme (the lab's cells) are not
# reused. 1: one seed per call (every prompt drew the same noise); 2: one seed per prompt;
# 3: unseeded requests under a per-call seed of the process's generators; 4: the same, and the
# held-out evaluation's requests seeded each (`seeded_requests`, #74).
SAMPLING = 4


def call_seed(seed: int, *, stream: int = 0) -> int:
    """The generator seed of one `generate` call: a pure function of the call's seed and the
    rollout group's stream (str seeds hash with sha512, the same in every process).

    >>> call_seed(7) == call_seed(7), call_seed(7) == call_seed(7, stream=1)
    (True, False)
    """
    return random.Random(f"minirl/{seed}/{stream}").getrandbits(63)


def top_up_seed(seed: int, step: int, draw: int) -> int:
    """The call seed of dynamic sampling's `draw`-th extra batch of `step` (a step's own batch is
    called with seed · 1,000,003 + step): apart from every step's, the same in a resumed run."""
    return random.Random(f"minirl/top-up/{seed}/{step}/{draw}").getrandbits(62)


def request_seed(base: int, prompt: int, slot: int | None, *, redraws: int = 0, turn: int = 0,
                 own: bool = False) -> int:
    """A seeded request's generator seed (`seeded_requests`): prompt i's n samples draw from base + i;
    a redrawn R3 sample draws anew. `own`: one sample asked alone (an episode's turn, its first
    included): a seed of its own for each (prompt, sample, turn, draw).

    >>> request_seed(5, 2, None), request_seed(5, 2, 0, own=True) == request_seed(5, 2, 1, own=True)
    (7, False)
    """
    if own:
        return random.Random(f"minirl/request/{base}/{prompt}/{slot}/{turn}/{redraws}").getrandbits(63)
    return (base + prompt + 1_000_003 * ((slot or 0) + 1) * redraws) % 2**63


@contextlib.contextmanager
def seeded_sampling(seed: int | None, *, stream: int = 0):
    """Run a `generate` call's sampling from the process's generators seeded for this call, and
    give them back their state afterwards (the trainer's draws are not disturbed).

    vLLM samples unseeded requests from the default generator: one draw per batch row and engine
    step (on CPU a [rows] `randint` that seeds each row's SplitMix64 noise; on CUDA the row's
    exponential noise), so every sample of a call draws its own noise, and the call repeats
    exactly for the same seed, prompts and weights. Seeded requests (`SamplingParams.seed`) would
    do the same from a generator per request, at a cost on CPU (a generator built per request
    and one `randint(...).item()` per request and step). A
    request's noise depends on the other requests of its call (the batch rows); the loop, the
    eval's chunks and the lab always make the same calls, and a resume repeats them.
    None: unseeded, whatever state the generators are in."""
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    numpy_state = np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            s = call_seed(seed, stream=stream)
            if devices:
                torch.random.manual_seed(s)  # seeds the CPU generator (and every CUDA device's; only this one is used)
            else:  # the CPU's alone: torch.manual_seed would also queue a CUDA seeding, with a stack trace, per call
                torch.default_generator.manual_seed(s)
            # vLLM's CUDA runner gives each unseeded request a seed from NumPy's global generator
            np.random.seed(s % 2**32)
            yield
    finally:
        np.random.set_state(numpy_state)
