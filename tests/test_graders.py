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
