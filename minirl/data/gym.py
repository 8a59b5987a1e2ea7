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


def check_params(task: str, params: dict[str, Any]) -> None:
    """Each of `params` (cold_start.task_params) a field of the task's own config class (reasoning-gym's
    dataclass), its value of that field's type: one line naming the key, before any generator runs."""
    import dataclasses
    import typing

    cfg = _registry()[gym_name(task)][1]
    fields = {f.name: f for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else {}
    try:
        hints = typing.get_type_hints(cfg)
    except Exception:  # noqa: BLE001 - annotations that do not resolve: the types go unchecked
        hints = {}
    for key, value in params.items():
        known = ", ".join(k for k in fields if k not in ("seed", "size"))
        if key in ("seed", "size"):
            raise UsageError(f"cold_start.task_params.{key} is minirl's to set (cold_start.seed, cold_start.train_size "
                             f"and heldout_size); {task}'s own fields: {known}")
        if fields and key not in fields:
            raise UsageError(f"cold_start.task_params.{key}: {task}'s config ({cfg.__name__}) has no such field; its "
                             f"fields: {known}")
        if key in hints and not _fits(value, hints[key]):
            raise UsageError(f"cold_start.task_params.{key} = {value!r}: {task}'s config ({cfg.__name__}) takes "
                             f"{_named(hints[key])}")


def _fits(value: Any, hint: Any) -> bool:
    """A JSON value against a config field's annotation (int, float, bool, str, Optional, list/tuple of
    them, Literal); an annotation of another kind is not checked here (the generator's error is one line)."""
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is type(None):
        return value is None
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint in (list, tuple) or origin in (list, tuple) or str(origin) == "<class 'collections.abc.Sequence'>":
        if not isinstance(value, (list, tuple)):
            return False
        inner = [a for a in args if a is not Ellipsis]
        return len(inner) != 1 or all(_fits(v, inner[0]) for v in value)
    return True


def _named(hint: Any) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")


def make_gym_splits(task: str, params: dict[str, Any], train_size: int, heldout_size: int,
                    seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out rows of reasoning-gym's task `task` ("rg:NAME") generated with
    its config `params` and `seed`; one line when the config is refused or the generator cannot
    make that many distinct questions."""
    check_task(task)
    check_params(task, params)
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
        try:
            entry = ds[idx]
        except Exception as e:  # noqa: BLE001 - its generator under these params: one line, nothing written
            raise UsageError(f"--task {task}: reasoning-gym's generator failed with cold_start.task_params {params}: "
                             f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}") from None
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
