"""A step's groups as graded: each prompt's G responses with their R, the shaped reward the advantages
are of, and which of them are samples of the model.

R(x, y) is the environment's where it gave one (`env.reward`), else the grader's score of the answer
(an episode's last turn), then the truncation rule (`loss.truncated_reward`) and the overlong shaping.
The grader scores only what it must: an episode the environment's fault ended is no sample of the
model (minirl/envs/outcome.py) and is not graded; it takes no part in its group's baseline, in dynamic
sampling's choice or in the step's reward and accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minirl.data.prompts import response_text
from minirl.envs import outcome
from minirl.train import objective


@dataclass(frozen=True)
class Group:
    """One prompt's G responses as graded: what the loss trains on."""

    problem: Any
    completions: list
    scores: list  # the grader's Score per response (its info: errors, timeouts; `not_graded`)
    graded: torch.Tensor  # [G] R(x, y) after the truncation rule
    rewards: torch.Tensor  # [G] R(x, y) with the overlong shaping: what the advantages are of
    trains: torch.Tensor  # [G] bool: a sample of the model (not an episode the environment's fault ended)


def graded(problems: list, groups: list, rec, grading, decode, eos_id: int) -> list[Group]:
    """Each prompt's group graded: R(x, y) by the truncation rule, then the overlong shaping."""
    G, mode = rec.train.group_size, rec.env.reward
    comps = [c for g in groups for c in g]
    texts: dict[tuple[int, ...], str] = {}  # a step's repeated answers (a group's twins) decoded once

    def text(ids) -> str:
        key = tuple(ids)
        if key not in texts:
            texts[key] = response_text(key, decode, eos_id)
        return texts[key]

    scores = grading.grade_where([(prob.record, text(outcome.answer_ids(c)))
                                  for prob, g in zip(problems, groups) for c in g],
                                 [outcome.needs_grade(c, mode) for c in comps])
    cut = [c.finish == "length" for c in comps]
    R = objective.sequence_rewards(outcome.rewards(comps, scores, mode), cut, rec.loss.truncated_reward).view(-1, G)
    lengths = torch.tensor([outcome.sampled(c) for c in comps]).view(-1, G)
    rewards = R + objective.overlong_penalty(lengths, rec.rollout.max_tokens, rec.loss.overlong_buffer,
                                             rec.loss.overlong_penalty)
    trains = torch.tensor([outcome.trains(c) for c in comps]).view(-1, G)
    return [Group(prob, g, scores[i * G:(i + 1) * G], R[i], rewards[i], trains[i])
            for i, (prob, g) in enumerate(zip(problems, groups))]


def samples_mean(values_G: list[torch.Tensor], groups: list[Group]) -> float:
    """The mean of a per-response value over the samples of the model (episodes the environment's
    fault ended left out); over every response where there is none."""
    values, trains = torch.cat(values_G), torch.cat([g.trains for g in groups])
    return float(values[trains].mean() if bool(trains.any()) else values.mean())
