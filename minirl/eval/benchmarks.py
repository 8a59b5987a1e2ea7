"""Benchmark registry: name -> Hugging Face dataset (id, config, split) and its field mapping.

Loaded through `datasets`, from the Hub by default or from a local file/folder (`--data PATH`, or
`--data-dir DIR` holding `<name>.jsonl`), since some machines have no Hub. The ids below are the
public copies most evaluation code uses; they could not be fetched from the development machine
(no Hub access), so the local path is what the tests exercise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minirl.data.loader import load_rows
from minirl.errors import UsageError

BOXED_PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
CODE_CHAT_PROMPT = ("Complete the following Python function. Answer with the whole function, imports included, in one "
                    "```python code block.\n\n```python\n{problem}```")


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    name: str
    hub_id: str | None  # None: the workspace's own held-out split
    split: str = "test"
    config: str | None = None
    problem_field: str = "problem"
    answer_field: str = "answer"
    answer_after: str | None = None  # keep only the text after this marker (GSM8K: "#### ")
    grader: str = "math"
    prompt_template: str = BOXED_PROMPT
    chat_prompt_template: str | None = None  # instead of prompt_template where the model has a chat template
    row_fields: tuple[str, ...] = ()  # fields the grader reads besides the answer (code: tests, entry point)
    problems: int | None = None  # how many it has: data with another count is not this benchmark


REGISTRY: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark(name="aime24", problems=30, hub_id="HuggingFaceH4/aime_2024", split="train"),
        Benchmark(name="aime25", problems=30, hub_id="MathArena/aime_2025", split="train"),
        Benchmark(name="hmmt25", problems=30, hub_id="MathArena/hmmt_feb_2025", split="train"),
        Benchmark(name="amc23", problems=40, hub_id="math-ai/amc23", split="test", problem_field="question"),
        Benchmark(name="math500", problems=500, hub_id="HuggingFaceH4/MATH-500", split="test"),
        Benchmark(name="gsm8k", problems=1319, hub_id="openai/gsm8k", config="main", split="test", problem_field="question",
                  answer_after="#### "),
        # HumanEval: a base model completes the function; a chat model is asked for the whole of it
        Benchmark(name="humaneval", problems=164, hub_id="openai/openai_humaneval", split="test", problem_field="prompt",
                  answer_field="entry_point", grader="code", prompt_template="{problem}",
                  chat_prompt_template=CODE_CHAT_PROMPT, row_fields=("prompt", "test", "entry_point")),
        Benchmark(name="heldout", hub_id=None, grader="", prompt_template="{problem}"),
    ]
}

# Local copies sometimes name the problem field differently from the Hub copy.
PROBLEM_FIELD_ALIASES = ("problem", "question", "prompt")


def get(name: str) -> Benchmark:
    if name not in REGISTRY:
        raise UsageError(f"unknown benchmark {name!r}; available: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def load_records(bench: Benchmark, *, data: Path | None = None, data_dir: Path | None = None,
                 answers: bool = True) -> list[dict]:
    """Rows as {"problem", "answer", "index"} from a local file/folder or the Hub. `answers` False: a row
    needs none (the workspace's held-out split where the environment scores every episode), and a row
    without one has no "answer" key."""
    if data is None and data_dir is not None:
        data = Path(data_dir) / f"{bench.name}.jsonl"
    if data is not None:
        if not Path(data).exists():
            raise UsageError(f"benchmark data not found: {data}")
        # a field of mixed types would read as JSON text, quotes and all (#82): refused naming its line
        rows = load_rows(str(data), typed=(bench.problem_field, *PROBLEM_FIELD_ALIASES, bench.answer_field))
    else:
        rows = load_rows(bench.hub_id, split=bench.split, config=bench.config,
                         instead=f"pass a local copy with --data PATH (.jsonl with {bench.problem_field!r} and "
                                 f"{bench.answer_field!r})")
    fields = rows.column_names
    pf = bench.problem_field if bench.problem_field in fields else next((f for f in PROBLEM_FIELD_ALIASES if f in fields), None)
    if pf is None or (answers and bench.answer_field not in fields):
        raise UsageError(f"{bench.name}: need a problem field ({'/'.join(PROBLEM_FIELD_ALIASES)}) and "
                         f"{bench.answer_field!r}; the data has {', '.join(fields)}")
    missing = [f for f in bench.row_fields if f not in fields]
    if missing:
        raise UsageError(f"{bench.name}: the data has no {', '.join(map(repr, missing))} field; it has {', '.join(fields)}")
    out = []
    for i, row in enumerate(rows.rows):
        if not isinstance(row[pf], str):  # never str()-ed into a prompt: a number is no problem statement
            raise UsageError(f"{bench.name}: row {i + 1} of {data or bench.hub_id}: field {pf!r} holds a "
                             f"{type(row[pf]).__name__} ({row[pf]!r}); a problem is text")
        answer = "" if row.get(bench.answer_field) is None else str(row[bench.answer_field])  # none: not gradable
        if bench.answer_after and bench.answer_after in answer:
            answer = answer.rsplit(bench.answer_after, 1)[1].strip()
        # the workspace's own split keeps every field: its grader may read any (rg's metadata)
        extra = row if bench.hub_id is None else {f: row[f] for f in bench.row_fields}
        if not answers and not answer.strip():  # none needed, none there: an episode the environment leaves
            # without R is the grader's error (counted), never a grade against ""
            extra = {k: v for k, v in extra.items() if k != bench.answer_field}
            out.append({**extra, "index": i, "problem": str(row[pf])})
            continue
        out.append({**extra, "index": i, "problem": str(row[pf]), "answer": answer})
    if not out:
        raise UsageError(f"{bench.name}: no rows")
    return out
