"""Grading with a per-call time limit, inline or in a pool of worker processes.

Symbolic checks can hang on adversarial model output (a 1 MB response, 10^(10^10)); a run must
never stall or die on one. Every call therefore has a time limit, and a timeout or an exception
scores 0 with the reason in `info` (the loop counts both).

- workers = 0: graded in this process; the limit is a SIGALRM timer, which interrupts Python code
  (sympy, math-verify) but not a long C call. Fine for cheap graders such as `arith`.
- workers > 0: spawned worker processes (never forked: the parent holds vLLM/OpenMP threads),
  each limiting its own calls with SIGALRM; if a worker still does not answer within a hard
  deadline (a C-level hang), the pool is killed and rebuilt, and the unanswered calls score 0.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from rewards.base import Score, load_grader

MAX_RESPONSE_CHARS = 20_000  # graders see the tail: the final answer is at the end of a response


def checked(score: Any) -> Score:
    """A grader's answer held to its contract (#82): a `Score` whose score is a finite number in
    [0, 1]. Anything else (NaN, 2.0, a string, a bare number) is a grader error the row counts,
    scored 0, never trained on as it came."""
    if not isinstance(score, Score):
        return Score(0.0, {"error": f"the grader returned {type(score).__name__} {score!r:.80}, not a Score"})
    v = score.score
    if isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0:
        return score if type(v) is float else Score(float(v), score.info)
    return Score(0.0, {**score.info, "error": f"the grader scored {v!r:.80}: a score is a finite number in [0, 1]"})


class _Timeout(BaseException):  # BaseException: libraries that catch Exception must not swallow it
    pass


def _alarm(signum, frame):
    raise _Timeout


def call_with_limit(grader, record: dict, response: str, timeout_s: float) -> Score:
    """grader(record, response) with a SIGALRM time limit (main thread only; elsewhere no limit)."""
    return grade_with_limit(grader, [(record, response)], timeout_s)[0]


def grade_with_limit(grader, items: Sequence[tuple[dict, str]], timeout_s: float) -> list[Score]:
    """`call_with_limit` for each item, in order. The SIGALRM handler is installed once for the
    batch and each call only arms the timer: a handler swap per call would cost more than the
    grading of a short response."""
    use_alarm = timeout_s > 0 and threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGALRM, _alarm) if use_alarm else None
    try:
        return [_limited(grader, rec, resp[-MAX_RESPONSE_CHARS:], timeout_s if use_alarm else 0) for rec, resp in items]
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _limited(grader, record: dict, response: str, timeout_s: float) -> Score:
    """One call under an armed timer (0: none); the SIGALRM handler is the caller's business."""
    if timeout_s:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return checked(grader(record, response))
    except _Timeout:
        return Score(0.0, {"timeout": True})
    except Exception as e:  # noqa: BLE001 - a grader bug must never kill a run
        return Score(0.0, {"error": f"{type(e).__name__}: {e}"})
    finally:
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)


_WORKER_GRADER = None


def _worker_init(name: str, params: dict) -> None:
    global _WORKER_GRADER
    # Ctrl-C reaches the whole process group: the parent stops and closes the pool; a worker's own
    # KeyboardInterrupt would only print a traceback per worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # likewise a closed terminal's SIGHUP
    _WORKER_GRADER = load_grader(name, params)


def _worker_call(record: dict, response: str, timeout_s: float) -> Score:
    return call_with_limit(_WORKER_GRADER, record, response, timeout_s)


class GradingPool:
    def __init__(
        self,
        name: str,
        params: dict[str, Any] | None = None,
        *,
        workers: int = 0,
        timeout_s: float = 5.0,
        hard_slack_s: float = 30.0,
    ):
        self.name, self.params, self.workers, self.timeout_s = name, dict(params or {}), workers, timeout_s
        self.hard_slack_s = hard_slack_s  # extra wait for a whole batch before workers are killed
        self.grader = load_grader(name, self.params)  # fails fast (UsageError) on a bad name or params
        self._pool: cf.ProcessPoolExecutor | None = None

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                self.workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                initargs=(self.name, self.params),
            )
        return self._pool

    def grade(self, items: Sequence[tuple[dict, str]]) -> list[Score]:
        """Scores in input order; never raises on model output. A grader with its own batch
        method and limits (`grade_batch`: the code grader's sandboxes) grades the batch itself."""
        batch = getattr(self.grader, "grade_batch", None)
        if self.workers <= 0 and batch is not None:
            try:
                scores = list(batch([(rec, resp[-MAX_RESPONSE_CHARS:]) for rec, resp in items]))
            except Exception as e:  # noqa: BLE001 - a grader bug must never kill a run
                return [Score(0.0, {"error": f"{type(e).__name__}: {e}"}) for _ in items]
            if len(scores) != len(items):
                return [Score(0.0, {"error": f"the grader's batch answered {len(scores)} of {len(items)}"})
                        for _ in items]
            return [checked(x) for x in scores]
        if self.workers <= 0:
            return grade_with_limit(self.grader, items, self.timeout_s)
        pool = self._executor()
        futures = [pool.submit(_worker_call, rec, resp, self.timeout_s) for rec, resp in items]
        # Each worker enforces timeout_s per call; this outer deadline only catches C-level hangs.
        deadline = time.monotonic() + self.timeout_s * (len(items) / self.workers + 2) + self.hard_slack_s
        out: list[Score] = []
        for fut in futures:
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except cf.TimeoutError:
                out.append(Score(0.0, {"timeout": True, "hard": True}))
            except Exception as e:  # noqa: BLE001 - a dead worker scores 0, the pool is rebuilt
                out.append(Score(0.0, {"error": f"{type(e).__name__}: {e}"}))
        if any(s.info.get("hard") or "BrokenProcessPool" in str(s.info.get("error", "")) for s in out):
            self.close(kill=True)
        return out

    def grade_where(self, items: Sequence[tuple[dict, str]], needed: Sequence[bool]) -> list[Score]:
        """`grade` of the items `needed` marks; the others (an episode the environment scored, or
        whose fault leaves it no sample of the model) score 0 ungraded, marked `not_graded`."""
        got = iter(self.grade([item for item, need in zip(items, needed, strict=True) if need]))
        return [next(got) if need else Score(0.0, {"not_graded": True}) for need in needed]

    def close(self, kill: bool = False) -> None:
        if self._pool is None:
            return
        if kill:
            for p in list(getattr(self._pool, "_processes", {}).values()):
                p.kill()
        self._pool.shutdown(wait=not kill, cancel_futures=True)
        self._pool = None

    def __del__(self) -> None:
        try:
            self.close(kill=True)
        except Exception:  # noqa: BLE001
            pass
