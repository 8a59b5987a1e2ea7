"""Cold-start SFT of the tiny model through the TorchTitan trainer (used by `minirl init`).

Teacher-forced cross-entropy on the answer tokens (+ EOS) only, mean over answer tokens, with a
cosine learning-rate decay. It stops well short of mastery on purpose: RL needs a policy whose
held-out accuracy is clearly non-zero but far from perfect.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from minirl.train import Trainer, build_batch


def sft_loss(logp_BT: torch.Tensor, batch) -> tuple[torch.Tensor, dict]:
    n = batch.mask_BT.sum().clamp(min=1.0)
    return -(logp_BT * batch.mask_BT).sum() / n, {}


def cold_start(
    trainer: Trainer,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Run `steps` SFT steps over (prompt_ids, target_ids) pairs; returns the last loss."""
    rng = random.Random(seed)
    loss = float("nan")
    warmup = max(1, steps // 50)
    for step in range(steps):
        frac = step / max(1, steps - 1)
        trainer.set_lr(lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))))
        picks = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        batch = build_batch([p for p, _ in picks], [t for _, t in picks], None, None, pad_id=pad_id)
        loss, _ = trainer.forward_backward(batch, sft_loss)
        trainer.optim_step()
        if on_step is not None:
            on_step(step, loss)
    return loss
