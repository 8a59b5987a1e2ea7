"""What a step trains, and an evaluation scores, of a completion: a multi-turn episode's (rollout/episodes.py)
or a single turn's alike. Decided here, once:

    trains        an episode that ended in the environment's fault (raised, hung, could not start, a
                  reply it could not read, a non-finite reward) is not a sample of the model: no
                  gradient, no place in its group's baseline, no group kept for it by dynamic sampling,
                  no score in an evaluation's avg@k. Everything else trains, a close that failed after
                  the episode had ended included (counted; the model's turns were whole).
    answer_ids    what the grader reads: an episode's last turn, after the last reply
    env_reward    R where the environment gave it (`env.reward`: the final observation's, or every
                  step's summed); None: the grader's score is R
    sampled       the tokens the engine sampled (replies left out): what the overlong shaping reads

Torch-free: the CLI imports the evaluation at its start.
"""

from __future__ import annotations

FAULT = "env_error"  # EpisodeInfo.ended of an episode the environment's fault ended


def trains(c) -> bool:
    """Whether a completion is a sample of the model (every single-turn one is)."""
    return c.episode is None or c.episode.ended != FAULT


def answer_ids(c) -> tuple[int, ...]:
    """What the grader reads of a completion: an episode's last turn, after the last reply (the answer)."""
    if c.mask is None or 0 not in c.mask:
        return c.token_ids
    last = len(c.mask) - c.mask[::-1].index(0)
    return c.token_ids[last:]


def env_reward(c, mode: str = "final") -> float | None:
    """R as the environment gave it, or None (the grader scores the answer). "final": the reward of the
    observation that ended the episode; "sum": every step's reward, summed (None where it gave none)."""
    e = c.episode
    if e is None:
        return None
    if mode == "sum":
        return float(sum(e.step_rewards)) if e.step_rewards else None
    return e.reward


def needs_grade(c, mode: str = "final") -> bool:
    """Whether the grader must score a completion: a sample of the model whose R the environment did not give."""
    return trains(c) and env_reward(c, mode) is None


def rewards(comps, scores, mode: str = "final") -> list[float]:
    """Each completion's R: the environment's where it gave one, else the grader's score of its answer
    (a faulted episode's is its placeholder score, 0: it trains on nothing)."""
    return [r if (r := env_reward(c, mode)) is not None and trains(c) else s.score
            for c, s in zip(comps, scores, strict=True)]


def sampled(c) -> int:
    """Tokens the engine sampled (an episode's replies left out): the length the overlong shaping reads."""
    return len(c.token_ids) if c.mask is None else sum(c.mask)


def trained_mask(c) -> tuple[int, ...] | None:
    """The loss mask the batch takes: the completion's (replies 0), all 0 for a faulted episode."""
    if trains(c):
        return c.mask
    return (0,) * len(c.token_ids)
