"""What the model wrote, as a person reads it: a response's text (an episode's as its turns), kept to a
size, with the grader's findings beside it. Training samples (minirl/run/samples.py) and an evaluation's
(minirl/eval/evaluate.py) are written from it; `minirl samples` reads them."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from minirl.disk import atomic


def clipped(text: str, most: int | None) -> str:
    """`text` whole (`most` None, or the text no longer), or its first and last `most` / 2 characters
    with what was left out said between.

    >>> clipped("abcdefghij", 4)
    'ab…[6 characters left out]…ij'
    """
    if most is None or len(text) <= most:
        return text
    half = most // 2
    return f"{text[:half]}…[{len(text) - 2 * half} characters left out]…{text[len(text) - half:]}"


def transcript(c, decode: Callable[[list[int]], str], most: int | None) -> list[dict[str, str]]:
    """An episode's response as turns: runs of the model's tokens ("model") and of the environment's
    replies ("env"), in order, each decoded (special tokens kept: they are what the model read)."""
    out, ids, by = [], [], None
    for tok, m in zip(c.token_ids, c.mask):
        who = "model" if m else "env"
        if who != by and ids:
            out.append({"by": by, "text": clipped(decode(ids), most)})
            ids = []
        ids.append(tok)
        by = who
    if ids:
        out.append({"by": by, "text": clipped(decode(ids), most)})
    return out


def grader_info(info: dict) -> dict:
    """The grader's info a JSON line can hold (its extracted answer, an error), nothing else."""
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool)) or v is None}


def written(c, decode: Callable[[list[int]], str], eos_id: int, most: int | None) -> dict[str, Any]:
    """A completion's text up to its EOS, or an episode's turns and what its environment did."""
    if c.mask is None:
        ids = list(c.token_ids)
        return {"text": clipped(decode(ids[: ids.index(eos_id)] if eos_id in ids else ids), most)}
    e = c.episode
    return {"turns": transcript(c, decode, most),
            **({"episode": {"turns": e.turns, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
                            "env_errors": e.env_errors, "ended": e.ended, **({"fault": e.fault} if e.fault else {})}}
               if e is not None else {})}


def text_of(resp: dict) -> str:
    """A response's text as one string: an episode's turns each headed by who wrote it."""
    if "turns" not in resp:
        return resp.get("text", "")
    return "\n".join(f"[{'model' if t['by'] == 'model' else 'environment'}]\n{t['text']}" for t in resp["turns"])


def records(path: Path, key: str = "step", body: str = "responses") -> Iterator[dict]:
    """Every whole record of a samples file, in order (a torn last line, or any line that is not one
    record, is left out). `key`: what numbers a record ("step": a run's, "index": an evaluation's);
    `body`: the list every record holds ("sampled": the token record's, minirl/run/token_record.py)."""
    with path.open("rb") as f:
        yield from parsed(f, key, body)


def parsed(lines, key: str = "step", body: str = "responses") -> Iterator[dict]:
    """The lines that are whole records (a JSON object numbered by `key`, with its `body` list)."""
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get(key), int) and isinstance(r.get(body), list):
            yield r


def keep_through(path: Path, step: int, body: str = "responses") -> None:
    """Keep a run's whole records of steps ≤ `step`, in one atomic rewrite: what a resume from that
    step's checkpoint does first (it redoes the rest); a line a kill tore goes too."""
    if path.exists():
        atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in records(path, body=body) if r["step"] <= step))
