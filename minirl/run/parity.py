"""The parity check after a sync: the engine and the trainer score the same fixed responses, and
mean |log μ − log π| over their tokens says whether the sync reached the engine whole (a policy
change cannot move it; a weight left behind, or broken log-probs, does)."""

from __future__ import annotations

import torch

from minirl.config.recipe import Recipe
from minirl.errors import EngineFault
from minirl.launch import World
from minirl.run import checks
from minirl.train.batch import build_batch

PARITY_BATCH = 16  # fixed (prompt, response) pairs re-scored by both engines after every sync


def fixed_pairs(rollouts, heldout: list, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The run's fixed pairs: the first held-out prompts, each with one response sampled at the start."""
    probs = heldout[:PARITY_BATCH]
    groups = rollouts.generate([p.prompt_ids for p in probs], n=1, temperature=1.0, max_tokens=max_tokens, seed=4321)
    return [(list(p.prompt_ids), list(g[0].token_ids)) for p, g in zip(probs, groups)]


def measure(pairs: list, rollouts, trainer, world: World, tp: int, pad_id: int) -> float:
    """mean |log μ − log π| over the pairs' tokens, over all ranks (a TP group scores its share once)."""
    pairs = world.group_share(pairs, tp)
    mu = world.member_share(rollouts.score([p for p, _ in pairs], [r for _, r in pairs]), tp)
    pairs = world.member_share(pairs, tp)
    batch = build_batch([p for p, _ in pairs], [r for _, r in pairs], mu, None, pad_id=pad_id)
    pi, _, _ = trainer.logprobs(batch)
    m = batch.mask_BT
    local = float(((batch.rollout_logp_BT - pi).abs() * m).sum() / m.sum())
    return world.mean({"parity": local}, weight=float(m.sum()))["parity"]


def broken(step: int, value: float, rec: Recipe, device: torch.device, row: dict) -> EngineFault:
    """The stop when the check itself is not finite: the step trained, its row stays (without the value)."""
    row.pop("sync/parity_abs_dlogp", None)  # no NaN in the file: the summary's error says what failed
    return EngineFault(f"step {step}: the parity check after the sync is {value} (mean |log μ − log π| over "
                       f"{PARITY_BATCH} fixed responses): the engine's log-probs are broken, not the policy; "
                       f"{checks.engine_advice(rec, device)}", row=row)
