"""run/groups.py: a step's groups as graded."""

from __future__ import annotations

from minirl.config import recipes
from minirl.data.prompts import Problem
from minirl.rollout.engine import Completion
from minirl.run.groups import graded
from rewards.pool import GradingPool

DIGITS = {i + 3: str(i) for i in range(10)}  # token id → digit; 2 is EOS


def test_a_steps_repeated_answers_are_decoded_once_and_each_response_is_graded_as_its_own():
    """A group's twins (the same answer tokens) decode once; every response still gets its own score,
    and answers of one length that differ in a token are not taken for one another."""
    rec = recipes.load(None, ["train.group_size=4"])
    decoded = []

    def decode(ids):
        decoded.append(tuple(ids))
        return "".join(DIGITS[i] for i in ids)

    def comp(*ids):
        return Completion(token_ids=(*ids, 2), logprobs=(-0.1,) * (len(ids) + 1), finish="stop")

    problems = [Problem((3,), {"answer": "12"}), Problem((4,), {"answer": "7"})]
    groups = [[comp(4, 5), comp(4, 5), comp(4, 6), comp(4, 5)],  # 12, 12, 13, 12
              [comp(10), comp(4, 5), comp(10), comp(10)]]  # 7, 12, 7, 7
    out = graded(problems, groups, rec, GradingPool("arith"), decode, eos_id=2)
    assert [g.graded.tolist() for g in out] == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]]
    assert sorted(decoded) == [(4, 5), (4, 6), (10,)]
