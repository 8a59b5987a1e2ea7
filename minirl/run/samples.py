"""What the model wrote, for a person to read: a few of each step's groups, as text, in
runs/<id>/samples.jsonl (`minirl samples` shows them).

One line a group: the step, the prompt as the model read it, and each response with what the step made
of it: the grader's score (and what it extracted), the reward after shaping, the advantage, how it
finished, its length, how many updates behind the weights that sampled it were, and whether it trained
(a group dynamic sampling left out, or an episode the environment's fault ended, did not). An episode is
its transcript: the model's turns and the environment's replies in order, each marked; the format's call
tags (where it has them) let a reader mark the calls.

Bounded: `metrics.samples_groups` groups a step (the first ones drawn: the prompts are a random draw
already), each text kept to its first and last `metrics.samples_max_chars` / 2 characters (a response's
end holds its answer). Crash-safe as the metrics rows are: a step's lines go in one write before its
metrics row, a kill can tear only the last, and a resumed run drops every line past its checkpoint (and a
torn one) before it writes again, so samples and metrics always cover the same steps.

No torch here: the reading side runs in the CLI, which starts without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minirl.data.written import clipped, grader_info, keep_through as truncate, parsed, text_of, written

FILE = "samples.jsonl"


def response_record(c, score, *, graded: float, reward: float, adv: float | None, trains: bool, trained_version: int,
                    decode: Callable[[list[int]], str], eos_id: int, most: int) -> dict[str, Any]:
    """One response as a person reads it, with what the step made of it."""
    sampled = [v for v, m in zip(c.versions or (), c.mask or [1] * len(c.token_ids)) if m]
    return {
        "score": None if score is None or score.info.get("not_graded") else float(score.score),
        "graded": graded, "reward": reward, "adv": adv, "trained": trains,
        "finish": c.finish, "tokens": len(c.token_ids),
        "behind": trained_version - min(sampled) if sampled else 0,
        **({"grader": grader_info(score.info)} if score is not None and score.info else {}),
        **written(c, decode, eos_id, most),
    }


def step_records(step: int, sampled: list, kept: list, adv_PG, *, groups: int, decode: Callable[[list[int]], str],
                 eos_id: int, most: int, calls: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """The first `groups` groups the step drew (run/groups.Group), one record each. `kept`: the groups
    it trained on, in the order of `adv_PG`'s rows (dynamic sampling leaves some out)."""
    row_of = {id(g): i for i, g in enumerate(kept)}
    out = []
    for n, g in enumerate(sampled[:groups]):
        i = row_of.get(id(g))
        responses = [response_record(c, s, graded=float(g.graded[j]), reward=float(g.rewards[j]),
                                     adv=None if i is None else float(adv_PG[i, j]),
                                     trains=i is not None and bool(g.trains[j]), trained_version=step - 1,
                                     decode=decode, eos_id=eos_id, most=most)
                     for j, (c, s) in enumerate(zip(g.completions, g.scores))]
        out.append({"step": step, "group": n, "prompt": clipped(decode(list(g.problem.prompt_ids)), most),
                    "trained": i is not None, **({"calls": list(calls)} if calls else {}), "responses": responses})
    return out


class SampleLog:
    """The run's samples file, opened for appending after the lines past `step` (a resume's
    checkpoint) are dropped."""

    def __init__(self, run_dir: Path, step: int, *, groups: int, most: int, decode, eos_id: int,
                 calls: tuple[str, str] | None = None):
        self.path = run_dir / FILE
        truncate(self.path, step)
        self.groups, self.most, self.decode, self.eos_id, self.calls = groups, most, decode, eos_id, calls
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, step: int, sampled: list, kept: list, adv_PG) -> list[dict]:
        """The step's records, in one write (flushed): what the sinks show as well."""
        recs = step_records(step, sampled, kept, adv_PG, groups=self.groups, decode=self.decode,
                            eos_id=self.eos_id, most=self.most, calls=self.calls)
        if recs:
            self._f.write("".join(json.dumps(r) + "\n" for r in recs))
            self._f.flush()
        return recs

    def close(self) -> None:
        self._f.close()


def flat(recs: list[dict]) -> list[dict[str, Any]]:
    """One row a response (the group's step, prompt and index beside its own fields): a table's rows."""
    return [{"step": r["step"], "group": r["group"], "response": j, "prompt": r["prompt"], "text": text_of(x),
             **{k: x.get(k) for k in ("score", "reward", "adv", "finish", "tokens", "behind", "trained")}}
            for r in recs for j, x in enumerate(r["responses"])]


def markdown(recs: list[dict]) -> str:
    """A step's samples as TensorBoard's text shows them: a heading per response, its text verbatim."""
    out = []
    for x in flat(recs):
        adv = "—" if x["adv"] is None else f"{x['adv']:+.3f}"
        out.append(f"**group {x['group']}, response {x['response']}**: score {x['score']}, reward {x['reward']:.3g}, "
                   f"advantage {adv}, {x['finish']}, {x['tokens']} tokens{'' if x['trained'] else ', not trained'}"
                   f"\n\n```\n{x['text']}\n```")
    return ("prompt:\n\n```\n" + recs[0]["prompt"] + "\n```\n\n" if recs else "") + "\n\n".join(out)


# ----- reading ------------------------------------------------------------------------------------
def newest(path: Path, chunk: int = 1 << 16) -> list[dict]:
    """The records of the file's newest step, read from its end (a long run's file is never read whole)."""
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        pos, tail = end, b""
        while pos > 0:
            pos = max(0, pos - chunk)
            f.seek(pos)
            tail = f.read(end - pos)
            lines = tail.split(b"\n")[1 if pos else 0:]  # the first may be a part of a line
            got = list(parsed(lines))
            if got and (pos == 0 or len({r["step"] for r in got}) > 1):
                last = got[-1]["step"]
                return [r for r in got if r["step"] == last]
    return []
