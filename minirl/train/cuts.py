"""The sampler's cuts on the trainer's side (#97). Where the engine drew a token from a distribution cut by
top-k, top-p or min-p, it recorded how many tokens the cut kept (`Completion.kept`): the most likely ones,
as every one of those cuts keeps a prefix of the tokens ordered by probability. The trainer's π and its
entropy at that position are renormalized over as many of its own most likely tokens:

    log π_cut(y) = x_y − logsumexp_{v ∈ S} x_v,    S = the kept-many largest x_v,    x = logits / T

so that π_old is the distribution that sampled y and the ratio π/μ carries no kept mass (TRL #7269). The
kept set is taken from the engine, not recomputed from the trainer's logits: a token on a cut's edge may
fall on either side of two fp32 computations of the same model (tests/test_rollout.py). A sampled token
outside the trainer's own kept set (a mismatch at the edge) keeps its own logit over the kept set's
log-sum-exp, and is counted.
"""

from __future__ import annotations

import torch


def edge_of(x: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor | None:
    """The value below which each row of x [n, V] is cut: its kept-th largest, the sampler's kept set being
    that many of the most likely tokens (-inf where kept is 0: nothing cut); None where no row is cut."""
    if kept is None or not bool((kept > 0).any()):
        return None
    k = torch.where(kept > 0, kept.long().clamp(1, x.shape[-1]), x.shape[-1]).to(x.device)
    edge = x.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return torch.where((kept > 0).to(x.device)[:, None], edge, float("-inf"))


def cut(x: torch.Tensor, edge: torch.Tensor | None) -> torch.Tensor:
    """x with what the sampler's cut left out at -inf (ties at the edge kept, as vLLM's cut keeps them)."""
    return x if edge is None else x.masked_fill(x < edge, float("-inf"))


def count(stats: dict | None, x: torch.Tensor, lse: torch.Tensor, target_x: torch.Tensor,
           edge: torch.Tensor | None) -> None:
    """The cut rows' kept mass (the trainer's probability of the kept set) and targets outside it, into `stats`."""
    if stats is None or edge is None:
        return
    cut = torch.isfinite(edge[:, 0])
    if not bool(cut.any()):
        return
    mass = (lse - torch.logsumexp(x, dim=-1)).exp()
    stats["cut_tokens"] = stats.get("cut_tokens", 0) + int(cut.sum())
    stats["kept_mass"] = stats.get("kept_mass", 0.0) + float(mass[cut].sum())
    stats["outside_kept"] = stats.get("outside_kept", 0) + int((target_x < edge[:, 0])[cut].sum())


def row(stats: dict) -> dict:
    """A step's row of what its forwards read of the cuts: the trainer's probability of the kept set (mean
    over cut tokens) and the share of sampled tokens outside its own kept set. {} where nothing was cut."""
    n = stats.get("cut_tokens", 0)
    if not n:
        return {}
    return {"train/kept_mass": stats["kept_mass"] / n, "train/outside_kept_frac": stats["outside_kept"] / n}


def kept_of(batch, packed, device) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """A batch's kept counts as the trainer's forwards read them: per position [B, L-1], per target (packed:
    the batch's own order through `dst_N`) and, packed, per packed position [C·S]; Nones where nothing was cut."""
    if batch.kept_BT is None:
        return None, None, None
    kept = batch.kept_BT.to(device)
    if packed is None:
        return kept, kept.flatten(), None
    per_target = kept.flatten()[packed.dst_N]
    per_packed = torch.zeros(packed.tokens_CS.numel(), dtype=kept.dtype, device=device)
    return kept, per_target, per_packed.index_put_((packed.src_N,), per_target)
