"""reasoning-gym's own scorers as a grader (`grader = "rg"`; tasks: minirl/data/gym.py).

A row carries the generator's entry: the question as its prompt, the answer, and the metadata as
JSON; the scorer of the task that made it (the metadata's `source_dataset`, else `task`) scores the
response's answer against that entry. The answer is read as a reasoning model writes it: from the
final part of the response (rewards.base.final_part: never inside a reasoning block), the last
<answer>…</answer> there if any (reasoning-gym's own prompt convention), else the whole final
part, stripped. A scorer that raises, or returns anything but a number in [0, 1], is a grader
error the row counts (rewards/pool.py), never a crash.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from rewards.base import REASONING_TAGS, Score, final_part
from rewards.base import reasoning_tags as checked_tags


@functools.lru_cache(maxsize=None)
def _scorer(name: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(name)


class GymGrader:
    """reasoning-gym's `score_answer` for the task that generated the row.

    >>> g = GymGrader()
    >>> row = {"prompt": "2 + 3 =", "answer": "5", "metadata": '{"source_dataset": "chain_sum"}'}
    >>> g(row, "<think>4?</think>5").score, g(row, "<think>5").score, g(row, "<answer>5</answer>").score
    (1.0, 0.0, 1.0)
    """

    fields = (("answer", "metadata"),)

    def __init__(self, task: str = "", answer_tag: str = "answer",
                 reasoning_tags: tuple[str, str] | list[str] | None = REASONING_TAGS):
        self.task, self.tags = task, checked_tags(reasoning_tags)
        self.answer_tag = re.compile(f"<{re.escape(answer_tag)}>(.*?)</{re.escape(answer_tag)}>", re.S) if answer_tag else None
        if task:
            _scorer(task)  # an unknown task fails at start, in one line (rewards.base.load_grader)

    def extract(self, response: str) -> str | None:
        part = final_part(response, self.tags)
        if part is None:
            return None
        tagged = self.answer_tag.findall(part) if self.answer_tag else []
        return (tagged[-1] if tagged else part).strip()

    def __call__(self, record: dict[str, Any], response: str) -> Score:
        try:
            meta = record["metadata"]
            meta = json.loads(meta) if isinstance(meta, str) else dict(meta)
        except (ValueError, TypeError) as e:
            return Score(0.0, {"error": f"the row's metadata is not a JSON object: {type(e).__name__}: {e}"[:200]})
        name = meta.get("source_dataset") or self.task
        if not name:
            return Score(0.0, {"error": "the row's metadata names no source_dataset, and reward.params sets no task"})
        answer = self.extract(response)
        entry = {"question": record.get("prompt", ""), "answer": str(record["answer"]), "metadata": meta}
        try:
            score = _scorer(name)(answer, entry)
        except Exception as e:  # noqa: BLE001 - any scorer's failure is counted, with its name
            return Score(0.0, {"extracted": answer, "error": f"reasoning-gym's {name} scorer: {type(e).__name__}: "
                                                              f"{(str(e).splitlines() or [''])[0][:160]}"})
        return Score(float(score) if isinstance(score, (int, float)) else score, {"extracted": answer})  # a score outside [0, 1] is counted by rewards/pool.py
