"""The math grader (math-verify) on the real benchmark files and on the equivalences math answers
really show; adversarial outputs are cut off by the time limit, inline and in worker processes."""

import json
import re

import pytest

from rewards.base import Score
from rewards.math import MathGrader
from rewards.pool import GradingPool
from tests.conftest import SHARED

BENCH = SHARED / "data" / "benchmarks"


def rows(name):
    return [json.loads(line) for line in (BENCH / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["aime24", "aime25", "hmmt25", "amc23", "math500"])
def test_reference_answers_score_100_percent_and_wrong_ones_0(name):
    g = MathGrader()
    data = rows(name)
    failures = [(i, r["answer"]) for i, r in enumerate(data)
                if g(r, f"Let me work it out. ... so the answer is \\boxed{{{r['answer']}}}.").score != 1.0]
    assert failures == []
    assert sum(g(r, "so the answer is \\boxed{123456789}.").score for r in data) == 0
    # each row against the next row's answer, where the two differ ("x=5" and "5" do not: the grader
    # rightly accepts an equation for its value; MATH-500 rows 22/23 are such a pair)
    def norm(a):
        return re.sub(r"^[a-z]\s*=", "", a.replace(" ", ""))

    wrong = [(i, data[i]["answer"], data[i + 1]["answer"]) for i in range(len(data) - 1)
             if norm(data[i]["answer"]) != norm(data[i + 1]["answer"])
             and g(data[i], f"\\boxed{{{data[i + 1]['answer']}}}").score != 0.0]
    assert wrong == []


@pytest.mark.parametrize(
    "gold, response",
    [
        ("\\frac{1}{2}", "\\boxed{0.5}"),
        ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}"),
        ("0.5", "\\boxed{\\frac12}"),
        ("7", "\\boxed{007}"),  # leading zeros
        ("1000", "\\boxed{1,000}"),  # thousands separator
        ("1000", "The answer is 1,000."),
        ("30", "\\boxed{30^\\circ}"),  # degrees
        ("30^\\circ", "\\boxed{30}"),
        ("5", "\\boxed{5 \\text{ cm}}"),  # units
        ("3", "\\boxed{x = 3}"),
        ("x=3", "\\boxed{3}"),
        ("(1, 2]", "\\boxed{(1,2]}"),  # interval
        ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}"),  # set, any order
        ("\\sqrt{2}", "\\boxed{2^{1/2}}"),
        ("2\\pi", "\\boxed{2\\pi}"),
        ("\\pi", "\\boxed{3.14159265358979}"),
        ("-4", "answer: -4"),  # the answer pattern
        ("12", "so 5+7 = 12"),  # the last number
    ],
)
def test_equivalent_answers_score_1(gold, response):
    assert MathGrader()({"answer": gold}, response).score == 1.0


@pytest.mark.parametrize(
    "gold, response",
    [("\\frac{1}{2}", "\\boxed{0.6}"), ("(1,2]", "\\boxed{[1,2]}"), ("3", "\\boxed{x=4}"), ("5", "no answer here")],
)
def test_different_answers_score_0(gold, response):
    assert MathGrader()({"answer": gold}, response).score == 0.0


ADVERSARIAL = [
    "1" * 1_000_000,  # 1 MB response
    "\\boxed{" + "9" * 1_000_000 + "}",
    "\\boxed{10^{10^{10^{10}}}}",  # huge exponent
    "\\boxed{9^{9^{9^{9^9}}}}!",
    "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
]


# No wall-clock bounds below: a busy CI machine makes any of them flaky. What is asserted is the
# mechanism: a call past its limit returns a score marked as a timeout, the run's other answers
# are still graded, and the pool keeps working. If the limit did not work, the test would hang
# and pytest-timeout (a bound ~100x the expected time) would fail it.


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [0, 2])
def test_adversarial_outputs_score_0_and_time_out(workers):
    pool = GradingPool("math", workers=workers, timeout_s=2.0, hard_slack_s=5.0)
    try:
        scores = pool.grade([({"answer": "5"}, r) for r in ADVERSARIAL] + [({"answer": "5"}, "\\boxed{5}")])
        after = pool.grade([({"answer": "7"}, "\\boxed{7}")])
    finally:
        pool.close()
    assert [s.score for s in scores] == [0.0] * len(ADVERSARIAL) + [1.0]
    assert sum(bool(s.info.get("timeout")) for s in scores) >= 2  # the exponent towers hit the limit
    assert [s.score for s in after] == [1.0]  # the pool grades on afterwards


class _Spin:
    """A grader stuck in a pure-Python loop: only the time limit can end the call."""

    def __call__(self, record, response):
        while True:
            pass


@pytest.mark.timeout(120)
def test_the_inline_limit_interrupts_a_python_loop():
    from rewards.pool import call_with_limit

    s = call_with_limit(_Spin(), {}, "x", timeout_s=0.2)
    assert s.score == 0.0 and s.info == {"timeout": True}


@pytest.mark.timeout(120)
def test_one_handler_for_a_batch_limits_every_call_and_is_given_back():
    import signal

    from rewards.pool import grade_with_limit

    spin = _Spin()
    grader = lambda rec, resp: spin(rec, resp) if resp == "spin" else Score(float(resp == rec["answer"]), {})  # noqa: E731
    before = signal.getsignal(signal.SIGALRM)
    scores = grade_with_limit(grader, [({"answer": "1"}, "spin"), ({"answer": "1"}, "1"), ({"answer": "1"}, "spin"),
                                       ({"answer": "1"}, "2")], timeout_s=0.2)
    assert [(s.score, s.info) for s in scores] == [(0.0, {"timeout": True}), (1.0, {}), (0.0, {"timeout": True}), (0.0, {})]
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


HANG_PKG = {
    "minirl_hanggrader/__init__.py": (
        "import signal\n"
        "class CHang:\n"
        "    def __init__(self):\n"
        "        pass\n"
        "    def __call__(self, record, response):\n"
        "        from rewards import Score\n"
        "        if response == 'hang':  # like a long C call: the alarm never gets in\n"
        "            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "            while True:\n"
        "                pass\n"
        "        return Score(1.0, {})\n"
    ),
    "minirl_hanggrader-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: minirl-hanggrader\nVersion: 0.1\n",
    "minirl_hanggrader-0.1.dist-info/entry_points.txt": "[minirl.graders]\nc_hang = minirl_hanggrader:CHang\n",
}


@pytest.mark.timeout(300)
def test_a_c_level_hang_is_killed_and_the_pool_recovers(tmp_path, monkeypatch):
    for rel, text in HANG_PKG.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = GradingPool("c_hang", workers=1, timeout_s=0.5, hard_slack_s=1.0)
    try:
        scores = pool.grade([({}, "hang"), ({}, "fine")])
        assert scores[0].score == 0.0 and scores[0].info == {"timeout": True, "hard": True}  # killed, not waited for
        assert pool._pool is None  # the hung worker's pool was torn down ...
        assert [s.score for s in pool.grade([({}, "fine")])] == [1.0]  # ... and a fresh one took over
    finally:
        pool.close(kill=True)


# #81: a reasoning model's final answer. Drafts boxed before the final one; boxes inside a closed and an
# unclosed reasoning block; the block's closing tag without its opening one (the chat template opened it
# in the prompt: Qwen3's thinking mode); no tags.
REASONING = [
    ("7", "maybe \\boxed{5}. no wait, it is 7. The answer is \\boxed{7}", 1.0),  # the review's cases
    ("4", "\\boxed{3} is wrong, the right one is \\boxed{4}", 1.0),
    ("5", "maybe \\boxed{5}. no wait, it is 7. The answer is \\boxed{7}", 0.0),
    ("7", "<think>so it is \\boxed{7}</think> I cannot answer this.", 0.0),  # the answer inside the reasoning
    ("7", "<think>7 then. Let me check 3 + 4 = 7, so", 0.0),  # cut off mid-thought: no answer
    ("7", "<think>first \\boxed{6}</think>\nSo the answer is \\boxed{7}.", 1.0),
    ("6", "<think>first \\boxed{6}</think>\nSo the answer is \\boxed{7}.", 0.0),
    ("7", "the sum: 3 + 3 = 6, no, \\boxed{6} is off by one.</think>\n\nThe answer is \\boxed{7}", 1.0),
    ("6", "the sum: 3 + 3 = 6, no, \\boxed{6} is off by one.</think>\n\nThe answer is \\boxed{7}", 0.0),
    ("7", "<think>a</think> 7? <think>again, \\boxed{7}", 0.0),  # a block opened again and left open
    ("\\frac{1}{2}", "<think>hm</think> so \\boxed{\\frac{1}{2}}, i.e. \\boxed{0.5}", 1.0),
    ("12", "<think>5 + 7</think> answer: 12", 1.0),  # the pattern and the last number, in the final part
    ("12", "<think>it is 12</think> 5 + 7 = 11", 0.0),
    ("7", "The answer is \\boxed{7}.", 1.0),  # no tags: the whole response
]


@pytest.mark.parametrize("gold, response, want", REASONING)
def test_a_reasoning_models_final_answer_decides(gold, response, want):
    assert MathGrader()({"answer": gold}, response).score == want


def test_minirl_eval_grades_reasoning_as_the_math_grader_and_the_tags_are_a_setting():
    """`minirl eval` grades a named benchmark with the "math" grader and its defaults, in worker
    processes (rewards.pool, as evaluate.py builds it): the same scores. `reward.params` sets other
    tags, or [] to grade the whole response; a malformed pair is bad input, named."""
    from minirl.errors import UsageError
    from rewards.base import load_grader

    pool = GradingPool("math", {}, workers=2, timeout_s=10.0)
    try:
        got = pool.grade([({"answer": g}, r) for g, r, _ in REASONING])
    finally:
        pool.close()
    assert [s.score for s in got] == [w for _, _, w in REASONING]
    assert load_grader("math", {"reasoning_tags": []})({"answer": "7"}, REASONING[3][1]).score == 1.0
    tagged = load_grader("math", {"reasoning_tags": ["<reasoning>", "</reasoning>"]})
    assert tagged({"answer": "7"}, "<reasoning>\\boxed{7}</reasoning> no idea").score == 0.0
    with pytest.raises(UsageError, match="bad reward.params: reasoning_tags must be"):
        load_grader("math", {"reasoning_tags": ["<think>"]})
