"""#98: what the model wrote, kept a few groups a step (minirl/run/samples.py) and read back by
`minirl samples` (cli/samples.py). A run's own samples: tests/test_e2e.py, tests/test_faults.py
(SIGKILL and --resume), tests/test_observability.py (TensorBoard, W&B), tests/test_episodes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minirl.rollout.engine import Completion, EpisodeInfo
from minirl.data.written import clipped, records, text_of
from minirl.run import samples as S
from minirl.run.groups import Group
from rewards.base import Score

ROOT = Path(__file__).resolve().parents[1]
CHARS = "abcdefghijklmnopqrstuvwxyz<>|"
EOS = 99


def decode(ids: list[int]) -> str:
    return "".join("<eos>" if i == EOS else CHARS[i % len(CHARS)] for i in ids)


class _Problem:
    def __init__(self, ids):
        self.prompt_ids, self.record = ids, {}


def group(prompt, comps, scores, rewards, trains=None):
    r = torch.tensor(rewards, dtype=torch.float32)
    t = torch.tensor(trains if trains is not None else [True] * len(comps))
    return Group(_Problem(prompt), comps, scores, r, r, t)


def test_a_step_keeps_its_first_groups_with_what_the_step_made_of_each_response():
    """Two groups drawn, dynamic sampling kept the second only: the first is marked untrained with no
    advantage; each response has its text (up to EOS), score, extracted answer, reward, advantage,
    finish, length and how many updates behind its oldest token was sampled."""
    g0 = group([0, 1], [Completion((2, 3, EOS), (-0.1,) * 3, "stop"), Completion((4, 5, EOS), (-0.1,) * 3, "stop")],
               [Score(1.0, {"extracted": "cd"}), Score(1.0, {"extracted": "ef"})], [1.0, 1.0])
    g1 = group([6], [Completion((7, 8, EOS), (-0.1,) * 3, "stop", versions=(4, 5, 5)),
                     Completion((9,) * 7, (-0.1,) * 7, "length", versions=(5,) * 7)],
               [Score(1.0, {"extracted": "hi"}), Score(0.0, {"extracted": None})], [1.0, 0.0])
    adv = torch.tensor([[0.7, -0.7]])
    recs = S.step_records(6, [g0, g1], [g1], adv, groups=5, decode=decode, eos_id=EOS, most=100)
    assert [(r["step"], r["group"], r["prompt"], r["trained"]) for r in recs] == [
        (6, 0, "ab", False), (6, 1, "g", True)]
    a, b = recs[1]["responses"]
    assert a == {"score": 1.0, "graded": 1.0, "reward": 1.0, "adv": pytest.approx(0.7), "trained": True,
                 "finish": "stop", "tokens": 3, "behind": 1, "grader": {"extracted": "hi"}, "text": "hi"}
    assert (b["finish"], b["tokens"], b["behind"], b["text"]) == ("length", 7, 0, "jjjjjjj")
    assert b["adv"] == pytest.approx(-0.7)
    assert all(x["adv"] is None and not x["trained"] for x in recs[0]["responses"])
    assert len(S.step_records(6, [g0, g1], [g1], adv, groups=1, decode=decode, eos_id=EOS, most=100)) == 1
    json.dumps(recs)  # a line of JSON as it is


def test_an_episode_is_its_turns_and_a_long_text_keeps_its_ends():
    """The model's tokens and the environment's replies as turns, in order; a fault's episode trains
    nothing and says why; a text over the limit keeps its first and last halves (the answer is at the end)."""
    c = Completion((0, 1, 2, 3, 4, 5, 6, EOS), (-0.1,) * 8, "stop", mask=(1, 1, 0, 0, 1, 1, 1, 1),
                   episode=EpisodeInfo(turns=2, tool_calls=1, ended="env_error", fault="raised KeyError"))
    g = group([0], [c], [Score(0.0, {"not_graded": True})], [0.0], trains=[False])
    [r] = S.step_records(1, [g], [g], torch.zeros(1, 1), groups=2, decode=decode, eos_id=EOS, most=100,
                         calls=("<", ">"))
    x = r["responses"][0]
    assert x["turns"] == [{"by": "model", "text": "ab"}, {"by": "env", "text": "cd"},
                          {"by": "model", "text": "efg<eos>"}]
    assert x["episode"] == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "env_errors": 0, "ended": "env_error",
                            "fault": "raised KeyError"}
    assert x["score"] is None and not x["trained"] and r["calls"] == ["<", ">"]
    assert text_of(x) == "[model]\nab\n[environment]\ncd\n[model]\nefg<eos>"
    assert clipped("x" * 50 + "ANSWER", 20) == "x" * 10 + "…[36 characters left out]…" + "xxxxANSWER"


def _write(path: Path, steps: dict[int, int], torn: bool = False) -> None:
    lines = [json.dumps({"step": s, "group": g, "prompt": f"p{s}", "responses": [{"text": f"s{s}g{g}", "reward": g}]})
             for s, n in steps.items() for g in range(n)]
    path.write_text("\n".join(lines) + "\n" + ('{"step": 9, "gro' if torn else ""))


def test_a_resume_keeps_whole_records_up_to_its_checkpoint(tmp_path):
    """What a resumed run does first: the lines past its checkpoint go, and a line a kill tore."""
    p = tmp_path / S.FILE
    _write(p, {1: 2, 2: 2, 3: 1}, torn=True)
    assert [r["step"] for r in records(p)] == [1, 1, 2, 2, 3]  # the torn line is no record
    S.truncate(p, 2)
    assert [(r["step"], r["group"]) for r in records(p)] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert p.read_text().endswith("\n") and len(p.read_text().splitlines()) == 4


@pytest.mark.parametrize("chunk", [7, 64, 1 << 16])
def test_the_newest_step_is_read_from_the_end(tmp_path, chunk):
    p = tmp_path / S.FILE
    _write(p, {s: 3 for s in range(1, 40)}, torn=True)
    got = S.newest(p, chunk=chunk)
    assert [(r["step"], r["group"]) for r in got] == [(39, 0), (39, 1), (39, 2)]
    _write(p, {5: 2})
    assert [r["group"] for r in S.newest(p, chunk=chunk)] == [0, 1]


def minirl(*args):
    """The command's output with the panels' borders out and every run of white space one space (a
    line the panel wraps reads as one)."""
    r = subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "160"})
    r.stdout = " ".join(r.stdout.replace("│", " ").split())
    return r


def test_the_samples_command_shows_a_step_sorts_filters_and_refuses_in_one_line(tmp_path):
    run = tmp_path / "ws" / "runs" / "20261205-000000"
    run.mkdir(parents=True)
    (tmp_path / "ws" / "minirl.toml").write_text("")
    r = minirl("samples", str(tmp_path / "ws"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"minirl: error: no samples in {run} (a run from before minirl kept them, or one with "
        "metrics.samples_groups = 0)"]
    recs = [{"step": s, "group": 0, "prompt": f"what is {s}?", "trained": True, "calls": ["<call>", "</call>"],
             "responses": [{"text": f"answer {s}", "score": float(s % 2), "reward": float(s), "adv": 0.5,
                            "finish": "stop" if s != 2 else "length", "tokens": 3, "trained": True,
                            "grader": {"extracted": str(s)}},
                           {"turns": [{"by": "model", "text": "<call>f(1)</call>"}, {"by": "env", "text": "REPLY7"},
                                      {"by": "model", "text": "done"}],
                            "score": None, "reward": 0.0, "adv": None, "finish": "stop", "tokens": 9, "trained": False,
                            "episode": {"turns": 2, "tool_calls": 1, "tool_errors": 0, "env_errors": 1,
                                        "ended": "env_error", "fault": "hung"}}]}
            for s in (1, 2, 3)]
    (run / S.FILE).write_text("".join(json.dumps(x) + "\n" for x in recs))
    r = minirl("samples", str(tmp_path / "ws"))
    assert r.returncode == 0, r.stderr
    assert "step 3 · group 0" in r.stdout and "what is 3?" in r.stdout and "answer 3" in r.stdout
    assert "step 2" not in r.stdout
    assert "environment" in r.stdout and "REPLY7" in r.stdout and "ended env_error: hung" in r.stdout
    assert "not graded" in r.stdout and "answer '3'" in r.stdout
    r = minirl("samples", str(tmp_path / "ws"), "--step", "1")
    assert "answer 1" in r.stdout and "answer 3" not in r.stdout
    r = minirl("samples", str(tmp_path / "ws"), "--best", "-n", "2")
    assert r.stdout.index("reward 3") < r.stdout.index("reward 2") and "reward 1 " not in r.stdout
    assert "4 more match" in r.stdout
    r = minirl("samples", str(tmp_path / "ws"), "--cut")
    assert "answer 2" in r.stdout and "answer 1" not in r.stdout and "(length cut)" in r.stdout
    r = minirl("samples", str(tmp_path / "ws"), "--grep", "ANSWER 1")
    assert "answer 1" in r.stdout and "answer 3" not in r.stdout
    r = minirl("samples", str(tmp_path / "ws"), "--step", "7")
    assert r.returncode == 2 and "no samples of step 7" in r.stderr and "steps 1…3 have some" in r.stderr


def test_an_evaluations_responses_are_shown_by_bench_name_or_file(tmp_path):
    ws = tmp_path / "ws"
    (ws / "evals").mkdir(parents=True)
    (ws / "minirl.toml").write_text("")
    f = ws / "evals" / "heldout-k2-coldstart-0123abcd.samples.jsonl"
    f.write_text("".join(json.dumps({"index": i, "problem": f"solve {i}", "answer": str(i), "responses": [
        {"text": f"I think {i}", "correct": True, "finish": "stop", "tokens": 4, "grader": {"extracted": str(i)}},
        {"text": "no idea", "correct": False, "finish": "length", "tokens": 9, "grader": {"extracted": None}}]}) + "\n"
        for i in range(3)) + '{"index": 3, "pro')
    r = minirl("samples", str(ws), "--eval", "heldout")
    assert r.returncode == 0, r.stderr
    assert "problem 0 · answer 0" in r.stdout and "solve 2" in r.stdout and "I think 2" in r.stdout
    assert "correct · stop" in r.stdout and "wrong · length (length cut)" in r.stdout
    assert "no answer found" in r.stdout
    r = minirl("samples", "--eval", str(f), "--worst", "-n", "3")
    assert r.stdout.count("wrong") == 3 and "correct ·" not in r.stdout and "3 more match" in r.stdout
    r = minirl("samples", str(ws), "--eval", "aime25")
    assert r.returncode == 2 and "no responses of an evaluation 'aime25'" in r.stderr
    r = minirl("samples", str(ws), "--eval", "heldout", "--step", "3")
    assert r.returncode == 2 and "--step and --run are a run's" in r.stderr
