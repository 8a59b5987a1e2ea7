"""The step's stops on a broken input to the loss, before any loss sees it: a grader that fails on
too many responses, an engine whose log μ is not finite. Each stop is one line that names what
broke and the settings known to avoid it."""

from __future__ import annotations

import torch

from minirl.config.recipe import Recipe
from minirl.errors import EngineFault, EnvFault, GraderFault
from minirl.launch import World
from minirl.train import objective
from minirl.train.batch import Batch


def grades(groups: list, rec: Recipe, step: int, world: World) -> None:
    """Stop when more than reward.max_error_frac of the step's responses had a grader error, or
    more than env.max_error_frac of its episodes ended in the environment's own error: counted over
    every rank, so that all stop together (a rank alone would leave the others in the next collective)."""
    errors = [s.info["error"] for g in groups for s in g.scores if "error" in s.info]
    episodes = [c.episode for g in groups for c in g.completions if c.episode is not None]
    faults = [e.fault for e in episodes if e.env_errors]
    graded = sum(not s.info.get("not_graded") for g in groups for s in g.scores)
    n = world.total({"graded": float(graded), "errors": float(len(errors)),
                     "episodes": float(len(episodes)), "faults": float(len(faults))})
    if n["errors"] and n["errors"] > rec.reward.max_error_frac * n["graded"]:
        first = errors[0][:200] if errors else "on another rank"
        raise GraderFault(f"step {step}: the grader {rec.reward.grader!r} failed on {int(n['errors'])} of "
                          f"{int(n['graded'])} responses (first: {first}); nothing of the step was trained: fix the "
                          "grader or choose another (reward.grader), or raise reward.max_error_frac")
    if n["faults"] and n["faults"] > rec.env.max_error_frac * n["episodes"]:
        first = faults[0][:200] if faults else "on another rank"
        raise EnvFault(f"step {step}: the environment {rec.env.name!r} failed in {int(n['faults'])} of "
                       f"{int(n['episodes'])} episodes (first: {first}); nothing of the step was trained: fix the "
                       "environment (or its server), or raise env.max_error_frac")


def engine_logp(batch: Batch, rec: Recipe, world: World, step: int) -> dict:
    """The step's response tokens and the share whose log μ is not finite (over all ranks), for
    its row; above guard.max_nonfinite_logp the engine is broken and the run stops before any
    loss sees the batch (`valid_mask` would drop those tokens, the step would train on the rest)."""
    n = world.mean({"resp": float(batch.mask_BT.sum()),
                    "bad": float(objective.nonfinite_tokens(batch.mask_BT, batch.rollout_logp_BT))},
                   sums=("resp", "bad"))
    frac = n["bad"] / max(n["resp"], 1.0)
    limit = rec.guard.max_nonfinite_logp
    if frac > limit:
        raise EngineFault(f"step {step}: the rollout engine returned non-finite log-probs for {frac:.1%} of the "
                          f"step's {int(n['resp']):,} response tokens (guard.max_nonfinite_logp = {limit:g}); "
                          f"nothing was trained on them: {engine_advice(rec, world.device)}")
    return {"rollout/resp_tokens": n["resp"], "rollout/logp_nonfinite_frac": frac}


def engine_advice(rec: Recipe, device: torch.device) -> str:
    """The settings that avoid what broke the engine before (the run's end adds how it goes on)."""
    r = rec.rollout
    cuda = device.type == "cuda"
    if cuda and r.precision == "fp8" and r.cuda_graphs:
        return ("FP8 decode through CUDA graphs after a weight reload is the suspect (docs/precision.md): set "
                "rollout.cuda_graphs = false, or rollout.precision = \"bf16\"")
    if cuda and r.cuda_graphs:
        return "rule out CUDA graphs with rollout.cuda_graphs = false, FP8 with rollout.precision = \"bf16\""
    if r.precision != "bf16":
        return f"rule out the rollout precision ({r.precision}) with rollout.precision = \"bf16\""
    return "no setting is known to cause it here (bf16, eager): keep the run's log for a report"
