"""Prompt sources (rows read through `datasets`: loader.py), tokenised and checked.

Rows with an empty prompt, a missing answer or a prompt over the token limit are skipped and
counted; a source with no usable row is an error.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minirl.data.loader import Rows, load_rows
from minirl.errors import UsageError


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt. `prompt_ids` are the tokenised prompt; `record` is the raw row for the grader."""

    prompt_ids: tuple[int, ...]
    record: dict[str, Any]


ENCODE_BATCH = 1024  # prompts a tokenizer call takes: its batch speed, without a whole dataset's encodings at once


def load_problems(
    spec: str,
    *,
    encode: Callable[[list[str]], list[list[int]]],
    prompt_field: str,
    answer_field: str,
    max_prompt_tokens: int,
    base: Path | None = None,
    split: str = "train",
    rows: Rows | None = None,
    answers: bool = True,
) -> tuple[list[Problem], dict[str, int]]:
    """Usable problems plus skip counts {"empty_prompt", "missing_answer", "too_long"}. `encode`
    tokenises a list of prompts in one call (a tokenizer's batch path: 20,000 prompts one call each
    took seconds of a run's start). rows: the source's, where already loaded (`load_rows` with `typed`
    the two fields). `answers` False: a row needs none (the environment scores every episode)."""
    if rows is None:
        rows = load_rows(spec, base=base, split=split, typed=(prompt_field, answer_field))
    for f in (prompt_field, answer_field) if answers else (prompt_field,):
        if f not in rows.column_names:
            raise UsageError(f"dataset {spec!r} has no field {f!r}; fields: {', '.join(rows.column_names)}")
    skipped = {"empty_prompt": 0, "missing_answer": 0, "too_long": 0}
    records, prompts = [], []
    for i, row in enumerate(rows.rows):
        prompt, answer = row.get(prompt_field), row.get(answer_field)
        if prompt is not None and not isinstance(prompt, str):
            raise UsageError(f"dataset {spec!r} row {i + 1}: field {prompt_field!r} must be a string, "
                             f"got {type(prompt).__name__}")
        if not prompt or not str(prompt).strip():
            skipped["empty_prompt"] += 1
            continue
        if answer is None or str(answer).strip() == "":
            if answers:
                skipped["missing_answer"] += 1
                continue
            # no answer to grade: an episode the environment leaves without R is a grader's error (counted),
            # never a grade of 0 against ""
            row = {k: v for k, v in row.items() if k != answer_field}
        # No tokenizer's tokens average 1,000 characters: a longer prompt is too long without the
        # cost of tokenizing it (a many-megabyte line takes seconds).
        if len(prompt) > 1000 * max_prompt_tokens:
            skipped["too_long"] += 1
            continue
        records.append(row)
        prompts.append(prompt)
    problems = []
    ids_of = (ids for i in range(0, len(prompts), ENCODE_BATCH) for ids in encode(prompts[i:i + ENCODE_BATCH]))
    for row, ids in zip(records, ids_of):
        if len(ids) > max_prompt_tokens:
            skipped["too_long"] += 1
            continue
        problems.append(Problem(tuple(ids), row))
    if not problems:
        raise UsageError(f"dataset {spec!r} has no usable rows (skipped: {skipped})")
    return problems, skipped


def prompt_ids(tok, text: str, *, template: str = "{problem}", chat: bool = False,
               chat_kwargs: dict | None = None, tools: list | None = None, suffix: str = "") -> list[int]:
    """The token ids a prompt is sent as: `text` put into `template` at "{problem}", `suffix` after it
    (an episode's reset observation), then, with `chat`, wrapped as one user turn by the tokenizer's
    chat template (generation prompt added), which reads `chat_kwargs` (data.chat_template_kwargs:
    Qwen3's enable_thinking) and renders `tools` (an environment's, as OpenAI function schemas) where
    it is given them."""
    return prompts_ids(tok, [text], template=template, chat=chat, chat_kwargs=chat_kwargs, tools=tools,
                       suffix=suffix)[0]


def prompts_ids(tok, texts: list[str], *, template: str = "{problem}", chat: bool = False,
                chat_kwargs: dict | None = None, tools: list | None = None, suffix: str = "") -> list[list[int]]:
    """`prompt_ids` of each text, the tokenizer called once for all of them."""
    texts = [template.format(problem=t) + suffix for t in texts]
    if chat:
        kw = {**(chat_kwargs or {}), **({"tools": tools} if tools else {})}
        return [list(ids) for ids in tok.apply_chat_template([[{"role": "user", "content": t}] for t in texts],
                                                             add_generation_prompt=True, tokenize=True,
                                                             return_dict=False, **kw)]
    return tok(texts, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class Prompter:
    """How a run renders a row's prompt (`data.prompt_template`, `data.chat_template`, its kwargs, the
    environment's tools), and renders it again with an episode's reset observation after the problem
    (TRL's rule: the text joins the last user message), within `max_tokens` (data.max_prompt_tokens):
    an observation that would pass it is cut, the `marker` where it was."""

    field: str
    template: str = "{problem}"
    chat: bool = False
    chat_kwargs: dict | None = None
    tools: tuple = ()
    max_tokens: int = 0
    marker: str = "…(cut)"

    def ids(self, tok, record: dict, suffix: str = "") -> list[int]:
        text = str(record.get(self.field, ""))

        def render(s: str) -> list[int]:
            return prompt_ids(tok, text, template=self.template, chat=self.chat, chat_kwargs=self.chat_kwargs,
                              tools=list(self.tools) or None, suffix=s)

        ids = render(suffix)
        if not suffix or not self.max_tokens or len(ids) <= self.max_tokens:
            return ids
        own = tok.encode(suffix, add_special_tokens=False, split_special_tokens=True)
        keep = len(own) - (len(ids) - self.max_tokens)
        while keep > 0:  # a cut re-tokenizes at its edge: take a token more off until it fits
            ids = render(tok.decode(own[:keep]) + self.marker)
            if len(ids) <= self.max_tokens:
                return ids
            keep -= 1
        return render("")


def response_text(token_ids: Sequence[int], decode: Callable[[list[int]], str], eos_id: int) -> str:
    """The response as the grader sees it: decoded, EOS (and anything after it) removed."""
    ids = list(token_ids)
    if eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return decode(ids)


class PromptSampler:
    """Epoch-shuffled batches of problems; its position is part of the checkpoint."""

    def __init__(self, problems: list[Problem], seed: int):
        self.problems, self.seed = problems, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffled()
            out.append(self.problems[self._order[self.pos]])
            self.pos += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffled()

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)
