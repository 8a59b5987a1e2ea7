"""Tasks from reasoning-gym (`minirl init DIR --task rg:NAME`): its procedural generators make the
splits, its own scorer grades them (rewards/gym.py).

A row is the generator's entry as minirl's data reads it: {"prompt": question, "answer": answer,
"metadata": the entry's metadata as JSON}. reasoning-gym scores an answer from the entry alone
(`get_score_answer_fn` builds its scorer with the task's default config), so the row is everything
the grader needs, whatever config generated it. Train and held-out rows are disjoint in their
question. reasoning-gym and its many small dependencies are imported here only, when a task of it
is asked for.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from minirl.errors import UsageError

PREFIX = "rg:"
RECIPE = "tiny-rg"  # the shipped recipe a workspace of a reasoning-gym task starts from
INSTALL_HINT = "reasoning-gym is not installed here: `pip install 'minirl[tasks]'` (bash .ci/setup installs it)"
# Configs sized for the tiny model's cold start (a few hundred SFT steps, then RL within minutes on
# 2 CPU cores); `init --task` writes them into the workspace's recipe, where --set changes them.
# A task not named here starts from reasoning-gym's own defaults.
TINY_PARAMS: dict[str, dict[str, Any]] = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                         "operators": ["+", "-", "*"]},
}


def is_gym(task: str) -> bool:
    return task.startswith(PREFIX)


def gym_name(task: str) -> str:
    return task[len(PREFIX):]


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
        import reasoning_gym  # noqa: F401 - registers every task
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return DATASETS


def check_task(task: str) -> None:
    """One line naming the problem when `task` ("rg:NAME") is not one of reasoning-gym's."""
    name, known = gym_name(task), _registry()
    if name not in known:
        near = difflib.get_close_matches(name, known, n=3)
        raise UsageError(f"--task {task}: reasoning-gym has no task {name!r}"
                         + (f"; did you mean {', '.join(PREFIX + n for n in near)}?" if near else
                            f" ({len(known)} tasks, e.g. {PREFIX}chain_sum, {PREFIX}basic_arithmetic)"))


def make_gym_splits(task: str, params: dict[str, Any], train_size: int, heldout_size: int,
                    seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out rows of reasoning-gym's task `task` ("rg:NAME") generated with
    its config `params` and `seed`; one line when the config is refused or the generator cannot
    make that many distinct questions."""
    check_task(task)
    from reasoning_gym import create_dataset

    total = train_size + heldout_size
    tries = 4 * total + 1000  # a generator that repeats itself this often has too few distinct questions
    try:
        ds = create_dataset(gym_name(task), **{**params, "seed": seed, "size": tries})
    except (TypeError, ValueError, AssertionError) as e:
        raise UsageError(f"--task {task}: reasoning-gym refuses cold_start.task_params {params}: "
                         f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}") from None
    rows: dict[str, dict] = {}
    for idx in range(tries):
        entry = ds[idx]
        q = entry["question"]
        if q not in rows:
            try:
                meta = json.dumps(entry["metadata"])
            except TypeError as e:  # the scorer would read it back otherwise than it was made
                raise UsageError(f"--task {task}: its entries' metadata is not JSON ({e}); a row could not carry "
                                 "it to the grader") from None
            rows[q] = {"prompt": q, "answer": str(entry["answer"]), "metadata": meta}
            if len(rows) == total:
                break
    if len(rows) < total:
        raise UsageError(f"--task {task}: its generator made {len(rows)} distinct questions in {tries} tries, "
                         f"fewer than the {total} asked for (cold_start.train_size + heldout_size): a smaller "
                         "split, or task_params with more variety")
    ordered = list(rows.values())
    return ordered[:train_size], ordered[train_size:]
