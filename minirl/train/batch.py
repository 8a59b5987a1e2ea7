"""The stage record between rollouts and the trainer: one right-padded token batch (`Batch`), and
how completions become one (`build_batch`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Batch:
    """A right-padded token batch for the trainer.

    tokens_BL:        int64 [B, L]    prompt + response token ids, padded with pad id
    mask_BT:          float [B, L-1]  1.0 where position t predicts a response token tokens[:, t+1]
    rollout_logp_BT:  float [B, L-1]  log μ_θold(tokens[:, t+1]) at those positions, 0 elsewhere
    adv_B:            float [B]       A(x, y) per response
    old_logp_BT:      float [B, L-1]  log π_θold at those positions, once the trainer computed it (else None)
    prompt_len_B:     int64 [B]       tokens of each row's prompt  } what shared-prompt packing needs
    seq_len_B:        int64 [B]       tokens of prompt + response   } (packing.py); None: never packed
    behind_BT:        float [B, L-1]  1.0 where the token was sampled by weights older than those
                                      trained (rollout.max_staleness ≥ 1); None: every token fresh
    temperature:      float           T the responses were sampled at: the policy is softmax(z / T),
                                      and every log π and entropy of the batch is taken at it
    kept_BT:          int32 [B, L-1]  where the sampler cut its distribution (top-k, top-p, min-p): how
                                      many of the most likely tokens it kept, over which log π and the
                                      entropy are renormalized (0: nothing cut there); None: no cut

    Example (B=1): prompt [4, 16] ("1="), response [5, 2] ("2<eos>"):
        tokens_BL = [[4, 16, 5, 2]]; mask_BT = [[0, 1, 1]]; rollout_logp_BT = [[0, -0.1, -0.05]]
    """

    tokens_BL: torch.Tensor
    mask_BT: torch.Tensor
    rollout_logp_BT: torch.Tensor
    adv_B: torch.Tensor
    old_logp_BT: torch.Tensor | None = None
    prompt_len_B: torch.Tensor | None = None
    seq_len_B: torch.Tensor | None = None
    behind_BT: torch.Tensor | None = None
    temperature: float = 1.0
    kept_BT: torch.Tensor | None = None

    def select(self, idx: torch.Tensor | slice) -> "Batch":
        return Batch(*(None if t is None else t[idx] for t in self._tensors()), temperature=self.temperature,
                     kept_BT=None if self.kept_BT is None else self.kept_BT[idx])

    def to(self, device: torch.device) -> "Batch":
        """The whole batch on `device` (the trainer's): masks, advantages and log-probs included."""
        return Batch(*(None if t is None else t.to(device, non_blocking=True) for t in self._tensors()),
                     temperature=self.temperature,
                     kept_BT=None if self.kept_BT is None else self.kept_BT.to(device, non_blocking=True))

    def with_old_logp(self, old_logp_BT: torch.Tensor) -> "Batch":
        return dataclasses.replace(self, old_logp_BT=old_logp_BT)

    def _tensors(self) -> tuple:
        return (self.tokens_BL, self.mask_BT, self.rollout_logp_BT, self.adv_B, self.old_logp_BT, self.prompt_len_B,
                self.seq_len_B, self.behind_BT)

    def __len__(self) -> int:
        return self.tokens_BL.shape[0]

    @property
    def live_rows(self) -> int:
        """Rows with a token to train (an episode the environment's fault ended has none): what the
        losses' mean over responses counts (objective.aggregate)."""
        return int((self.mask_BT.sum(dim=-1) > 0).sum())


def build_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    rollout_logps: Sequence[Sequence[float]] | None,
    adv: Sequence[float] | None,
    *,
    pad_id: int,
    versions: Sequence[Sequence[int] | None] | None = None,
    trained: int = 0,
    temperature: float = 1.0,
    masks: Sequence[Sequence[int] | None] | None = None,
    kept: Sequence[Sequence[int] | None] | None = None,
) -> Batch:
    """`versions`: each response token's policy version (`Completion.versions`; None: the
    trained weights'); a token of a version below `trained`, the weights the step trains, is behind.
    `temperature`: what the responses were sampled at (`rollout_logps` are log μ at it). `masks`:
    a multi-turn episode's (`Completion.mask`): 1 where its engine sampled the token, 0 where an
    environment's reply put it, which no loss, IS weight or staleness counts (None: all sampled).
    `kept`: the sampler's kept counts per response token (`Completion.kept`; None: nothing cut)."""
    B = len(prompts)
    L = max(len(p) + len(r) for p, r in zip(prompts, responses))
    tokens, mask, rlp = [], [], []  # rows as lists, one tensor each at the end (a tensor per row is slower)
    behind = [] if versions is not None and any(v is not None for v in versions) else None
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n_p, n_r = len(p), len(r)
        own = masks[i] if masks is not None and masks[i] is not None else None
        if own is not None and len(own) != n_r:
            raise ValueError(f"row {i}: a mask of {len(own)} for {n_r} response tokens")
        tokens.append([*p, *r] + [pad_id] * (L - n_p - n_r))
        mask.append([0.0] * (n_p - 1) + ([float(x) for x in own] if own is not None else [1.0] * n_r)
                    + [0.0] * (L - n_p - n_r))
        if rollout_logps is not None:
            rlp.append([0.0] * (n_p - 1) + [float(x) for x in rollout_logps[i]] + [0.0] * (L - n_p - n_r))
        if behind is not None:
            v = versions[i] or (trained,) * n_r
            behind.append([0.0] * (n_p - 1) + [float(x < trained) * m for x, m in zip(v, mask[-1][n_p - 1:])]
                          + [0.0] * (L - n_p - n_r))
    adv_t = torch.tensor(list(adv), dtype=torch.float32) if adv is not None else torch.zeros(B)
    n_p = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    n = n_p + torch.tensor([len(r) for r in responses], dtype=torch.long)
    mask_t = torch.tensor(mask, dtype=torch.float32)
    rlp_t = torch.tensor(rlp, dtype=torch.float32) if rollout_logps is not None else torch.zeros(B, L - 1)
    behind_t = torch.tensor(behind, dtype=torch.float32) if behind is not None else None
    kept_t = None
    if kept is not None and any(k is not None for k in kept):
        kept_t = torch.tensor([[0] * (len(p) - 1) + list(k or [0] * len(r)) + [0] * (L - len(p) - len(r))
                               for p, r, k in zip(prompts, responses, kept)], dtype=torch.int32)
    return Batch(torch.tensor(tokens, dtype=torch.long), mask_t, rlp_t, adv_t, prompt_len_B=n_p, seq_len_B=n,
                 behind_BT=behind_t, temperature=float(temperature), kept_BT=kept_t)


def batch_of(prompts: Sequence[Sequence[int]], comps: Sequence, adv: Sequence[float] | None, *, pad_id: int,
             trained: int = 0, temperature: float = 1.0, masks: Sequence[Sequence[int] | None] | None = None,
             kept: bool = True) -> Batch:
    """`build_batch` of completions (rollout.engine.Completion: their tokens, log μ, versions and the
    sampler's kept counts, unless `kept` is false: loss.renormalize_kept's ablation), one per prompt given."""
    return build_batch(prompts, [c.token_ids for c in comps], [c.logprobs for c in comps], adv, pad_id=pad_id,
                       versions=[c.versions for c in comps], trained=trained, temperature=temperature, masks=masks,
                       kept=[c.kept for c in comps] if kept else None)
