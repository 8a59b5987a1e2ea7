"""Graders: built-ins by name through the entry-point registry; they never raise on model output."""

import pytest

from minirl.errors import UsageError
from rewards import load_grader
from rewards.base import Score
from rewards.pool import call_with_limit


@pytest.mark.parametrize(
    "name, params, answer, response, expected",
    [
        ("arith", {}, "579", "579", 1.0),
        ("arith", {}, "579", "0579", 0.0),
        ("arith", {}, "579", "", 0.0),
        ("exact", {}, "Paris", " Paris\n", 1.0),
        ("exact", {"case_sensitive": False}, "Paris", "paris", 1.0),
        ("numeric", {"tol": 1e-3}, "0.5", "it is 0.5004", 1.0),
        ("numeric", {}, "1,234", "so 1234", 1.0),
        ("numeric", {}, "7", "no digits here", 0.0),
        ("regex", {"pattern": r"answer: (\w+)"}, "B", "answer: A ... answer: B", 1.0),
        ("math", {}, "\\frac{1}{2}", "so the answer is \\boxed{0.5}.", 1.0),
        ("math", {}, "70", "the answer is \\boxed{71}", 0.0),
    ],
)
def test_builtin_graders(name, params, answer, response, expected):
    assert load_grader(name, params)({"answer": answer}, response).score == expected


def test_unknown_grader_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown grader 'nope'; installed: .*arith"):
        load_grader("nope")


def test_bad_grader_params_are_a_usage_error():
    with pytest.raises(UsageError, match="bad reward.params"):
        load_grader("exact", {"bogus": 1})


def test_a_raising_grader_scores_zero_with_the_reason():
    def broken(record, response):
        raise KeyError("answer")

    s = call_with_limit(broken, {}, "x", timeout_s=1.0)
    assert s == Score(0.0, {"error": "KeyError: 'answer'"})


def test_grading_workers_leave_ctrl_c_to_the_parent():
    """Ctrl-C reaches the whole process group; the parent closes the pool, and a worker ignores
    it rather than print a KeyboardInterrupt traceback of its own (`minirl eval humaneval`)."""
    import signal

    from rewards.pool import _worker_init

    before = signal.getsignal(signal.SIGINT)
    try:
        _worker_init("exact", {})
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


class Misbehaving:
    """A colleague's grader: what it returns is the record's `returns`."""

    def __call__(self, record, response):
        return record["returns"]


class BatchOfOne:
    def __call__(self, record, response):
        return Score(1.0)

    def grade_batch(self, items):
        return [Score(float("nan"))] + [Score(1.0)] * (len(items) - 1)


@pytest.mark.parametrize("returns, score, error", [
    (Score(float("nan")), 0.0, "the grader scored nan: a score is a finite number in [0, 1]"),
    (Score(2.0), 0.0, "the grader scored 2.0"), (Score(-1), 0.0, "the grader scored -1"),
    (Score("1"), 0.0, "the grader scored '1'"), (0.5, 0.0, "the grader returned float 0.5, not a Score"),
    (None, 0.0, "the grader returned NoneType None, not a Score"),
    (Score(1), 1.0, None), (Score(0.25, {"extracted": "7"}), 0.25, None)])
def test_a_score_outside_the_contract_is_a_counted_grader_error(returns, score, error, monkeypatch):
    """#82: a score is a finite number in [0, 1]; NaN, 2.0, −1, a string or anything but a Score
    scores 0 with the reason (the row counts it as a grader error), in the trainer's process, in
    the workers' and through a grader's own batch method, never trained on as it came."""
    from rewards import base
    from rewards.pool import GradingPool

    monkeypatch.setitem(base.BUILTIN, "misbehaving", f"{__name__}:Misbehaving")
    got = GradingPool("misbehaving").grade([({"returns": returns}, "x")])[0]
    assert type(got.score) is float and got.score == score
    assert got.info.get("error", "").startswith(error) if error else "error" not in got.info
    monkeypatch.setitem(base.BUILTIN, "batch-of-one", f"{__name__}:BatchOfOne")
    got = GradingPool("batch-of-one").grade([({}, "x"), ({}, "y")])
    assert [s.score for s in got] == [0.0, 1.0] and "a finite number in [0, 1]" in got[0].info["error"]


def test_a_score_outside_the_contract_in_a_worker_is_an_error_too(monkeypatch):
    """What a grading worker runs for each call (its grader set as `_worker_init` sets it)."""
    import rewards.pool as pool

    monkeypatch.setattr(pool, "_WORKER_GRADER", Misbehaving())
    assert pool._worker_call({"returns": Score(1.0)}, "x", 1.0).score == 1.0
    assert "a finite number" in pool._worker_call({"returns": Score(float("inf"))}, "x", 1.0).info["error"]


class StartsBroken:
    def __init__(self):
        raise RuntimeError("no licence file")


@pytest.mark.parametrize("value, message", [
    ("no_such_module_here:Grader", "cannot be loaded: ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("rewards.builtin:NoSuchGrader", "cannot be loaded: AttributeError"),
    (f"{__name__}:StartsBroken", "failed to start: RuntimeError: no licence file")])
def test_a_plugin_that_cannot_load_or_start_is_one_line_naming_it(value, message, monkeypatch):
    from rewards import base

    monkeypatch.setitem(base.BUILTIN, "colleagues", value)
    with pytest.raises(UsageError) as e:
        load_grader("colleagues")
    assert str(e.value).startswith(f"grader 'colleagues' ({value}) ") and message in str(e.value), str(e.value)


class AlwaysRaises:
    def __call__(self, record, response):
        raise KeyError("answer_text")


@pytest.mark.slow
def test_a_step_whose_grades_are_mostly_errors_stops_the_run_naming_the_grader(tiny_dir, tmp_path, monkeypatch):
    """#82: past reward.max_error_frac of a step's grades being errors, the run stops before that
    step trains (its zeros would be trained on as wrong answers): summary grader_fault, the error
    naming the grader and its first error, no row, the step-0 checkpoint what a resume continues."""
    import json
    from pathlib import Path

    from minirl.config import recipes
    from minirl.run import lifecycle
    from minirl.setup.workspace import Workspace
    from rewards import base
    from tests.conftest import data_workspace

    monkeypatch.setitem(base.BUILTIN, "always-raises", f"{__name__}:AlwaysRaises")
    ws = data_workspace(tmp_path / "ws")
    rec = recipes.load(ws / "minirl.toml", [f"model.path={tiny_dir}", "train.steps=2", "train.prompts_per_step=4",
                                           "train.group_size=2", "reward.grader=always-raises", "eval.max_problems=2",
                                           "eval.k=1"])
    summary = lifecycle.run(Workspace.open(ws), rec)
    assert summary["status"] == "grader_fault" and summary["steps"] == 0, summary
    assert summary["error"].startswith("step 1: the grader 'always-raises' failed on 8 of 8 responses (first: "
                                       "KeyError: 'answer_text'); nothing of the step was trained"), summary["error"]
    run = Path(summary["run_dir"])
    assert (run / "metrics.jsonl").read_text() == "" and Path(summary["checkpoint"]).name == "step_000000"
    assert json.loads((run / "summary.json").read_text())["status"] == "grader_fault"
