"""reasoning-gym's tasks (#81): `minirl init --task rg:NAME` builds the splits from its generator,
its own scorer grades them (grader "rg"), read as a reasoning model writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minirl.data.gym import TINY_PARAMS, make_gym_splits
from minirl.errors import UsageError
from rewards import load_grader

ROOT = Path(__file__).resolve().parents[1]


def minirl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_the_splits_are_the_generators_entries_disjoint_and_seeded():
    train, heldout = make_gym_splits("rg:chain_sum", TINY_PARAMS["chain_sum"], 300, 50, seed=3)
    assert len(train) == 300 and len(heldout) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert make_gym_splits("rg:chain_sum", TINY_PARAMS["chain_sum"], 300, 50, seed=3) == (train, heldout)
    assert make_gym_splits("rg:chain_sum", TINY_PARAMS["chain_sum"], 300, 50, seed=4)[0] != train
    row = train[0]
    assert row["prompt"].startswith("State the final answer to the following arithmetic problem: ")
    meta = json.loads(row["metadata"])
    assert meta["source_dataset"] == "chain_sum" and meta["num_terms"] == 2
    expr = meta["expression"]
    assert str(eval(expr)) == row["answer"]  # noqa: S307 - the generator's own "a + b" / "a - b"


@pytest.mark.parametrize("task, params, needle", [
    ("rg:chain_summ", {}, "did you mean rg:chain_sum"),
    ("rg:chain_sum", {"min_terms": 3, "max_terms": 2}, "max_terms must be >= min_terms"),
    ("rg:chain_sum", {"nonsense": 1}, r"cold_start.task_params.nonsense: rg:chain_sum's config \(ChainSumConfig\) has "
                                      "no such field; its fields: min_terms, max_terms"),
    # #99: checked by the config class's types before the generator runs (it crashed in randrange, two tracebacks)
    ("rg:chain_sum", {"min_digits": 1.5}, r"cold_start.task_params.min_digits = 1.5: rg:chain_sum's config "
                                          r"\(ChainSumConfig\) takes int"),
    ("rg:chain_sum", {"allow_negation": "yes"}, "allow_negation = 'yes': .* takes bool"),
    ("rg:chain_sum", {"seed": 3}, "cold_start.task_params.seed is minirl's to set"),
    ("rg:chain_sum", {"min_terms": 1, "max_terms": 1, "min_digits": 1, "max_digits": 1}, "distinct questions"),
])
def test_a_task_or_config_reasoning_gym_refuses_is_one_line(task, params, needle):
    with pytest.raises(UsageError, match=needle):
        make_gym_splits(task, params, 100, 10)


@pytest.fixture(scope="module")
def rows():
    train, _ = make_gym_splits("rg:chain_sum", TINY_PARAMS["chain_sum"], 20, 1)
    return train


def test_the_scorer_reads_the_final_answer_as_a_reasoning_model_writes_it(rows):
    g, row = load_grader("rg"), rows[0]
    a = row["answer"]
    wrong = str(int(a) + 1)
    cases = {
        a: 1.0,
        f" {a}\n": 1.0,
        wrong: 0.0,
        f"<think>maybe {wrong}</think>{a}": 1.0,  # a closed reasoning block: its draft never counts
        f"<think>it is {a}</think>I cannot say": 0.0,  # the answer inside the block does not count
        f"<think>it is {a}": 0.0,  # a block never closed: no answer
        f"it is {wrong}... no</think>{a}": 1.0,  # the template opened it in the prompt
        f"<answer>{wrong}</answer> hmm <answer>{a}</answer>": 1.0,  # the last <answer> of the final part
        f"<think><answer>{a}</answer></think><answer>{wrong}</answer>": 0.0,
    }
    got = {resp: g(row, resp).score for resp in cases}
    assert got == cases
    assert g(row, f"<think>x</think> {a}").info["extracted"] == a


def test_a_scorer_or_a_row_that_fails_is_a_grader_error_not_a_crash(rows):
    from rewards.pool import grade_with_limit

    g, row = load_grader("rg"), rows[0]
    bad = [{**row, "metadata": "{not json"}, {**row, "metadata": json.dumps({"source_dataset": "no_such_task"})},
           {**row, "metadata": "{}"}]
    scores = grade_with_limit(g, [(r, row["answer"]) for r in bad], timeout_s=5)
    assert [s.score for s in scores] == [0.0, 0.0, 0.0] and all("error" in s.info for s in scores), scores
    assert "not a JSON object" in scores[0].info["error"] and "no source_dataset" in scores[2].info["error"]
    # another grading configuration: no tags at all, the whole response
    whole = load_grader("rg", {"reasoning_tags": [], "answer_tag": ""})
    assert whole(row, f"<think>x</think>{row['answer']}").score < 1.0


def test_init_refuses_an_unknown_task_in_one_line(tmp_path):
    r = minirl("init", str(tmp_path / "ws"), "--task", "rg:no_such_thing", timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "reasoning-gym has no task 'no_such_thing'" in r.stderr and not (tmp_path / "ws").exists()
    r = minirl("init", str(tmp_path / "ws"), "--task", "addition", "--set", 'cold_start.task_params={"a": 1}',
               timeout=120)
    assert r.returncode == 2 and "takes none" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_twenty_steps(tmp_path):
    """Another task than the documented one (docs/tasks.md: rg:chain_sum, 300 steps): init writes
    the tiny model's size of it into the recipe, the rows carry the entries, and 20 steps of RL run
    on its scorer with no grader error."""
    import tomllib

    ws = tmp_path / "ws"
    r = minirl("init", str(ws), "--task", "rg:basic_arithmetic", "--set", "cold_start.max_steps=60",
               "--set", "cold_start.train_size=3000", "--set", "cold_start.heldout_size=64",
               "--set", "cold_start.batch_size=32", "--set", "cold_start.dev_size=32")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = tomllib.loads((ws / "minirl.toml").read_text())
    assert rec["cold_start"]["task"] == "rg:basic_arithmetic"
    assert rec["cold_start"]["task_params"] == TINY_PARAMS["basic_arithmetic"] and rec["reward"]["grader"] == "rg"
    first = json.loads((ws / "data/train.jsonl").read_text().splitlines()[0])
    assert first["prompt"].startswith("Calculate ") and json.loads(first["metadata"])["source_dataset"] == "basic_arithmetic"
    assert json.loads((ws / "model/coldstart/config.json").read_text())["vocab_size"] == 128

    r = minirl("run", str(ws), "--steps", "20", "--set", "train.prompts_per_step=8", "--set", "eval.k=1")
    assert r.returncode == 0, r.stderr[-3000:]
    run = next((ws / "runs").iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "rollout/reward_mean" in x]
    assert len(steps) == 20 and all(x["rollout/grader_errors"] == 0 for x in steps)
    assert any(x["rollout/reward_mean"] > 0 for x in steps)  # the scorer gives credit the model earns
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished"
    # `minirl eval` of the workspace's held-out split grades as the run did: the rows keep their metadata
    r = minirl("eval", "heldout", str(ws), "--k", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(next((ws / "evals").glob("heldout-*.json")).read_text())
    assert result["problems"] == 64 and result["grader_errors"] == 0, result
    # what the model wrote (#98): the run's newest step and the evaluation's responses, as a person reads them
    shown = minirl("samples", str(ws))
    assert shown.returncode == 0 and "step 20 · group 0" in shown.stdout and "Calculate " in shown.stdout
    shown = minirl("samples", str(ws), "--eval", "heldout", "-n", "2")
    assert shown.returncode == 0 and "problem 0 · answer" in shown.stdout and "answer '" in shown.stdout
