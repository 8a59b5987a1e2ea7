"""Dynamic sampling (DAPO, `train.dynamic_sampling`): a step's batch of groups whose rewards differ.

MiniRL's advantage is A_i = R_i − mean_j R_j over a prompt's G responses: a group whose rewards are
all equal (every response right, or every one wrong) has A ≡ 0 and adds no gradient, but it still
costs its rollouts, its π_old and its share of the batch, and on a hard task most groups are such.
The loop drops them and draws more prompts until the batch holds B informative groups or the
recipe's bound on extra draws is reached; a batch still short is completed with the groups it
dropped, first drawn first, so that every step trains B groups as without dynamic sampling (those
add no gradient; the rows say how many: `rollout/dynamic_short`). Only a group's samples of the model
count: an episode the environment's fault ended (minirl/envs/outcome.py) never makes a group informative.
"""

from __future__ import annotations

from collections.abc import Callable

from minirl.run.groups import Group


def informative(g: Group) -> bool:
    """Whether the rewards of a group's samples of the model differ: the only groups with a nonzero advantage."""
    r = g.rewards[g.trains]
    return len(r) > 1 and bool(r.max() > r.min())


def fill(first: list[Group], draw: Callable[[int], list[Group]], *, size: int,
         max_draws: int) -> tuple[list[Group], list[Group], dict]:
    """(the batch: `size` groups, informative first; every group sampled; the row's counts).
    `draw(d)` samples and grades the d-th extra draw (d = 1, 2, ...)."""
    sampled = list(first)
    draws = 0
    while sum(map(informative, sampled)) < size and draws < max_draws:
        draws += 1
        sampled += draw(draws)
    useful = [g for g in sampled if informative(g)]
    flat = [g for g in sampled if not informative(g)]
    short = max(0, size - len(useful))
    batch = useful[:size] + flat[:short]
    G = len(first[0].completions) if first else 0
    return batch, sampled, {
        "rollout/dynamic_dropped": len(flat) - short,  # zero-variance groups sampled and left out
        "rollout/dynamic_short": short,  # zero-variance groups trained, for want of informative ones
        "rollout/dynamic_surplus": max(0, len(useful) - size),  # informative groups past a full batch
        "rollout/dynamic_draws": draws,  # extra draws of `size` prompts
        "rollout/dynamic_rollouts": draws * size * G,  # the responses they sampled
    }
