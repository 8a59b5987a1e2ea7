"""Cold-start SFT of the tiny model through the TorchTitan trainer (used by `minirl init`).

Teacher-forced cross-entropy on the answer tokens (+ EOS) only, mean over answer tokens, constant
learning rate after a short warm-up. It stops as soon as the policy's *sampled* accuracy on a dev
split (carved from train, never the held-out split) reaches a target: RL needs a policy that is
clearly non-zero but far from perfect. A fixed step count would not do: on this task accuracy jumps
from ~2% to ~90% within ~150 steps once carrying is learned (measured: 300 steps 2%, 350 30%,
450 77%), so the stopping point must be measured, not guessed.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from minirl.models.titan import kv_cache
from minirl.train.batch import build_batch
from minirl.train.trainer import Trainer


# one more forward and backward of the tiny model costs as much as this many positions more in one
# (docs/results/cpu-path.md, `minirl/train/sft.py`)
FORWARD_POSITIONS = 256


def length_groups(lengths: Sequence[int], fixed: int = FORWARD_POSITIONS) -> list[list[int]]:
    """A batch's rows, given their lengths, in forwards of rows of like length, each padded to its own
    longest row rather than the batch's: the runs of the rows sorted by length that cost the fewest
    positions, `fixed` more for each forward. One forward in the batch's own order where no cut pays
    (a task whose targets are all about as long: its numbers are the one forward's, bit for bit)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    longest = [lengths[i] for i in order]
    # a forward starts and ends where the length changes: a cut between rows of one length saves nothing
    ends = [j for j in range(1, len(order)) if longest[j] != longest[j - 1]] + [len(order)] if order else []
    cost, start = {0: 0}, {}  # the fewest positions for the j shortest rows; where their last forward starts
    for b, j in enumerate(ends):
        cost[j], start[j] = min((cost[i] + fixed + longest[j - 1] * (j - i), i) for i in [0, *ends[:b]])
    groups, j = [], len(order)
    while j:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1] if len(groups) > 1 else [list(range(len(lengths)))]


def sft_loss(logp_BT: torch.Tensor, batch) -> tuple[torch.Tensor, dict]:
    n = batch.mask_BT.sum().clamp(min=1.0)
    return -(logp_BT * batch.mask_BT).sum() / n, {}


def sft_backward(trainer: Trainer, examples: Sequence[tuple], *, pad_id: int, fixed: int = FORWARD_POSITIONS) -> float:
    """Accumulate the gradient of the SFT loss of `examples`, (prompt_ids, target_ids[, target mask]) as
    one batch, in forwards of rows of like length (`length_groups`: a multi-turn task's targets run from
    an answer's few tokens to a call, its reply and the answer); each forward's token mean is weighed by
    its share of the batch's trained tokens, so the gradient is the whole batch's. Returns the loss."""
    trained = [sum(ex[2]) if len(ex) > 2 else len(ex[1]) for ex in examples]
    total = max(1, sum(trained))
    loss = 0.0
    for rows in length_groups([len(ex[0]) + len(ex[1]) for ex in examples], fixed):
        part = [examples[i] for i in rows]
        batch = build_batch([ex[0] for ex in part], [ex[1] for ex in part], None, None, pad_id=pad_id,
                            masks=[ex[2] if len(ex) > 2 else None for ex in part])
        share = sum(trained[i] for i in rows) / total  # one forward with tokens to train: 1.0 exactly, as before
        part_loss, _ = trainer.forward_backward(batch, sft_loss, scale=share)
        loss += share * part_loss
    return loss


@torch.no_grad()
def sampled_accuracy(
    trainer: Trainer,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    eos_id: int,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    is_correct: Callable[[int, list[int]], bool] | None = None,
) -> float:
    """Share of prompts whose sampled response (T=temperature) equals the target token ids, or,
    given `is_correct(i, response ids up to EOS)`, that it accepts (a grader of the final answer).

    Decoding with the TorchTitan model and a KV cache (models.kv_cache), prompts grouped by length
    so no padding is needed."""
    trainer.model.eval()
    gen = torch.Generator().manual_seed(seed)
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ex in enumerate(examples):
        by_len[len(ex[0])].append(i)
    correct = 0
    for n_p, idx in by_len.items():
        x = torch.tensor([list(examples[i][0]) for i in idx], device=trainer.device)
        with kv_cache(trainer.model):
            new = x
            for t in range(max_tokens):
                at = None if t == 0 else torch.full((1, 1), x.shape[1] - 1, device=x.device)
                logits = trainer.model(new, positions=at)[:, -1].float()
                if temperature > 0:
                    nxt = torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1, generator=gen)
                else:
                    nxt = logits.argmax(-1, keepdim=True).cpu()
                new = nxt.to(x.device)
                x = torch.cat([x, new], dim=1)
        for i, row in zip(idx, x[:, n_p:].tolist()):
            if eos_id in row:
                row = row[: row.index(eos_id) + 1]
            correct += is_correct(i, row) if is_correct is not None else row == list(examples[i][1])
    return correct / len(examples)


def cold_start(
    trainer: Trainer,
    examples: Sequence[tuple],
    *,
    max_steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int = 0,
    stop_when: Callable[[int], bool] | None = None,
    check_every: int = 25,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[int, float]:
    """SFT over (prompt_ids, target_ids) pairs until `stop_when(step)` or `max_steps`; a triple's third
    is the target's loss mask (a multi-turn target: 0 on an environment's reply).

    Returns (steps run, last loss)."""
    rng = random.Random(seed)
    loss = float("nan")
    warmup = 20
    for step in range(max_steps):
        trainer.set_lr(lr * min(1.0, (step + 1) / warmup))
        picks = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        loss = sft_backward(trainer, picks, pad_id=pad_id)
        trainer.optim_step()
        if on_step is not None:
            on_step(step, loss)
        if stop_when is not None and (step + 1) % check_every == 0 and stop_when(step + 1):
            return step + 1, loss
    return max_steps, loss
