"""`minirl run`'s live view (cli/render.py RunView): what its RL bar counts."""

from __future__ import annotations

import io
import itertools

from rich.console import Console

from cli.render import RunView


def _start(step: int) -> dict:
    return {"run_dir": "runs/x", "step": step, "startup_s": 7.0, "skipped_rows": {}, "train_rows": 100,
            "startup_parts": {}, "engine_cache": None, "resumed_from": "step_000050" if step else None,
            "recipe_changes": {}}


def test_the_rl_bars_clock_starts_after_the_engines_start_and_the_first_held_out_eval():
    """The bar is made before the engine starts; its elapsed time counts from the end of the start's held-out
    evaluation, as the summary's "time: rl" does, and a resumed run's bar starts at its step."""
    view = RunView(Console(file=io.StringIO(), width=80), total_steps=100, eval_key="avg@4")
    with view:
        bar = view.progress.tasks[0]
        made = bar.start_time
        clock = itertools.count(made + 1)  # a clock that moves at every reading
        view.progress.get_time = lambda: next(clock)
        view.on_event("start", _start(0))
        started = bar.start_time
        assert started > made
        before_eval_ends = view.progress.get_time()
        view.on_event("eval", {"which": "start", "avg@4": 0.3, "problems": 500, "temperature": 1.0})
        assert bar.start_time >= before_eval_ends > started and bar.completed == 0
        view.on_event("step", {"step": 1})
        before_later_eval = bar.start_time
        view.on_event("eval", {"which": "step 1", "avg@4": 0.4, "problems": 500, "temperature": 1.0})
        assert bar.start_time == before_later_eval and bar.completed == 1  # a periodic eval is the run's time

    resumed = RunView(Console(file=io.StringIO(), width=80), total_steps=100, eval_key="avg@4")
    with resumed:
        resumed.on_event("start", _start(50))
        bar = resumed.progress.tasks[0]
        assert bar.completed == 50
