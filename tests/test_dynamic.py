"""Dynamic sampling (#81, run/dynamic.py): a step trains groups whose rewards differ, refilled by
draws of more prompts up to the recipe's bound, and the rows count what it dropped and drew."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from minirl.run.dynamic import fill, informative
from minirl.run.groups import Group


def _groups(flat: list[bool], G: int = 4, tag: str = "") -> list[Group]:
    """Groups whose rewards are all 1 (`flat`) or half 1, half 0."""
    out = []
    for i, f in enumerate(flat):
        r = torch.ones(G) if f else torch.tensor([1.0, 0.0] * (G // 2))
        out.append(Group(f"{tag}{i}", [None] * G, [None] * G, r, r, torch.ones(G, dtype=torch.bool)))
        assert informative(out[-1]) is not f
    return out


def test_fill_drops_flat_groups_and_draws_until_the_batch_is_full():
    draws = iter([_groups([True, False, True, True], tag="a"), _groups([False, False, True, False], tag="b")])
    batch, sampled, row = fill(_groups([True, False, True, False]), lambda d: next(draws), size=4, max_draws=3)
    assert [g.problem for g in batch] == ["1", "3", "a1", "b0"]  # informative, in the order drawn
    assert len(sampled) == 12
    assert row == {"rollout/dynamic_dropped": 6, "rollout/dynamic_short": 0, "rollout/dynamic_surplus": 2,
                   "rollout/dynamic_draws": 2, "rollout/dynamic_rollouts": 2 * 4 * 4}


def test_fill_stops_at_its_bound_and_completes_the_batch_with_flat_groups():
    batch, _, row = fill(_groups([True, True, False, True]), lambda d: _groups([True] * 4, tag=f"d{d}"), size=4,
                         max_draws=2)
    assert [g.problem for g in batch] == ["2", "0", "1", "3"]  # the informative one, then flat ones, first drawn first
    assert row["rollout/dynamic_short"] == 3 and row["rollout/dynamic_dropped"] == 8  # 11 flat, 3 of them trained
    assert row["rollout/dynamic_draws"] == 2
    batch, _, row = fill(_groups([False] * 4), lambda d: pytest.fail("a full batch draws nothing"), size=4, max_draws=2)
    assert row == {"rollout/dynamic_dropped": 0, "rollout/dynamic_short": 0, "rollout/dynamic_surplus": 0,
                   "rollout/dynamic_draws": 0, "rollout/dynamic_rollouts": 0}


def test_on_several_training_ranks_it_is_refused_in_one_line():
    from minirl.config import recipes
    from minirl.errors import UsageError
    from minirl.models.shapes import TINY
    from minirl.setup.preflight import check_layout

    rec = recipes.load(None, ["train.dynamic_sampling=true"])
    check_layout(rec, TINY, 1)
    with pytest.raises(UsageError, match="train.dynamic_sampling on 2 training ranks: not supported yet"):
        check_layout(rec, TINY, 2)


class HalfFlatGrader:
    """Half the prompts (`flat`) score 1 whatever is answered: their groups have no variance; the
    others score the parity of the response's characters (the sum of their code points), which differs
    within 7 of 8 groups of 4 random responses (their lengths seldom do: most run to the limit)."""

    def __call__(self, record, response):
        from rewards.base import Score

        return Score(1.0 if record["flat"] else float(sum(map(ord, response)) % 2))


def _half_flat_workspace(root: Path) -> Path:
    from minirl.data.task import make_splits, write_jsonl
    from tests.conftest import data_workspace

    ws = data_workspace(root)
    train, _ = make_splits(400, 16, seed=0)
    write_jsonl(ws / "data/train.jsonl", [{**r, "flat": i % 2} for i, r in enumerate(train)])
    return ws


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_every_trained_batch_is_full_and_has_no_flat_group(k, tiny_dir, tmp_path, monkeypatch):
    """On data where half the groups have zero variance, with the real engine on the tiny model
    (k = 2: in its own process, sampling ahead; with R3): every step trains a full batch of
    prompts_per_step groups, none of them flat, and the rows count the groups dropped and the
    extra draws and rollouts it took; the staleness bound holds on the tokens trained."""
    from minirl.config import recipes
    from minirl.run import lifecycle
    from minirl.setup.workspace import Workspace
    from rewards import base

    monkeypatch.setitem(base.BUILTIN, "half-flat", f"{__name__}:HalfFlatGrader")
    ws = _half_flat_workspace(tmp_path / "ws")
    B, G = 8, 4
    rec = recipes.load(ws / "minirl.toml", [
        f"model.path={tiny_dir}", "train.steps=3", f"train.prompts_per_step={B}", f"train.group_size={G}",
        "train.dynamic_sampling=true", "train.dynamic_sampling_draws=4", "reward.grader=half-flat",
        "eval.max_problems=4", "eval.k=1", f"rollout.max_staleness={k}", *(["train.replay=r3"] if k else [])])
    cores = os.sched_getaffinity(0)
    summary = lifecycle.run(Workspace.open(ws), rec)
    assert summary["status"] == "finished", summary
    assert os.sched_getaffinity(0) == cores  # k = 2: the engine's process closed gave this one its cores back
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert m["rollout/zero_adv_groups"] == 0 and m["rollout/dynamic_short"] == 0, {k: v for k, v in m.items() if "dynamic" in k or "reward" in k or "adv" in k}
        assert round(m["rollout/resp_tokens"] / m["rollout/resp_len"]) == B * G  # B whole groups trained
        assert m["rollout/dynamic_dropped"] >= 1 and m["rollout/dynamic_draws"] >= 1
        assert m["rollout/dynamic_rollouts"] == m["rollout/dynamic_draws"] * B * G
        assert m["loss/tokens"] == m["rollout/resp_tokens"]
        if k:
            assert m["rollout/staleness_max"] <= k and sum(m["rollout/staleness_tokens"]) == m["rollout/resp_tokens"]
            assert m["replay/coverage"] == 1.0
    # the first step's draw: about half its groups flat, so about one extra draw refilled it
    assert sum(m["rollout/dynamic_dropped"] for m in rows) >= B


@pytest.mark.slow
def test_the_overlong_shaping_trains_and_the_grade_stays_the_graders(tiny_dir, tmp_path):
    """DAPO's soft overlong punishment over the last 3 of the 6 tokens a response may have: the
    reward the advantages are of is the grade plus the penalty of the responses past 3 tokens;
    rollout/acc and the held-out scores stay the grader's."""
    from minirl.config import recipes
    from minirl.run import lifecycle
    from minirl.setup.workspace import Workspace
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    rec = recipes.load(ws / "minirl.toml", [
        f"model.path={tiny_dir}", "train.steps=2", "train.prompts_per_step=8", "train.group_size=4",
        "reward.grader=numeric", 'reward.params={"tol": 500}', "loss.overlong_buffer=3", "loss.overlong_penalty=0.5",
        "eval.max_problems=4", "eval.k=1"])
    summary = lifecycle.run(Workspace.open(ws), rec)
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "finished" and len(rows) == 2
    for m in rows:
        assert 0 < m["rollout/overlong_frac"] <= 1 and -0.5 <= m["rollout/overlong_penalty"] < 0
        assert m["rollout/reward_mean"] == pytest.approx(m["rollout/graded_mean"] + m["rollout/overlong_penalty"],
                                                         abs=1e-5)
        assert m["rollout/acc"] == pytest.approx(m["rollout/graded_mean"])  # 0/1 grades: the grader's share right


def test_a_resume_draws_the_extra_prompts_the_run_would_have_drawn():
    """The extra draws come from a stream of their own whose position the checkpoint keeps: a
    resumed run draws at its next step what the run would have drawn; the steps' own batches
    draw what they would without dynamic sampling."""
    from minirl.config.recipe import RolloutConfig, TrainConfig
    from minirl.data.prompts import Problem, PromptSampler
    from minirl.launch import World
    from minirl.rollout import Rollouts
    from minirl.rollout.engine import Completion
    from minirl.stopwatch import Stopwatch

    class Echo:  # an engine that answers each prompt with itself
        def generate(self, prompts, *, n, temperature, max_tokens, seed=None):
            return [[Completion(tuple(p), (0.0,) * len(p), "stop")] * n for p in prompts]

        def set_version(self, version):
            pass

        def sleep(self):
            pass

    problems = [Problem((i,), {}) for i in range(50)]

    def rollouts():
        return Rollouts(Echo(), sampler=PromptSampler(problems, seed=0), world=World(), rollout=RolloutConfig(),
                        train=TrainConfig(prompts_per_step=4, group_size=2), clock=Stopwatch({}))

    def drawn(r, step, d):
        return [p.prompt_ids[0] for p in r.top_up(step, d)[0]]

    def step(r, s):  # the batch of step s, after the sync of the step before (k = 0)
        r._control.updated(s - 1)
        return [p.prompt_ids[0] for p in r.next(s)[0]]

    plain = rollouts()
    steps_only = [step(plain, s) for s in (1, 2)]
    first = rollouts()
    assert step(first, 1) == steps_only[0]
    early = drawn(first, 1, 1) + drawn(first, 1, 2)
    record = {**first.record(), "step": 1}
    assert step(first, 2) == steps_only[1]  # the steps' batches: as without
    later = drawn(first, 2, 1)
    again = rollouts()
    again.restore(record)
    assert step(again, 2) == steps_only[1] and drawn(again, 2, 1) == later
    assert len(set(early + later)) == 12  # a shuffled stream, no prompt twice within its epoch
