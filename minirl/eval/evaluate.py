"""Held-out evaluation: k samples per problem from the rollout engine, graded by the run's grader.

avg@k  = mean over problems of (correct samples / k)   (the paper's avg@32 with k = 32)
pass@k = share of problems with at least one correct sample
maj@k  = share of problems whose most frequent extracted answer is a correct one
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from minirl.data.prompts import Problem, response_text
from minirl.envs.outcome import answer_ids, needs_grade, rewards as episode_rewards, trains
from minirl.errors import EnvFault
from rewards.pool import GradingPool

if TYPE_CHECKING:
    from minirl.rollout.engine import Truncation


def summarize(correct_PK: list[list[bool]], extracted_PK: list[list[str | None]], k: int | None = None) -> dict:
    """avg@k, pass@k and maj@k from per-sample correctness and extracted answers (`k`: the samples asked
    of each problem; a problem may have fewer, those an environment's fault ended left out).

    maj@k: the most frequent extracted answer (ties: first seen) decides; a problem counts as
    solved when that answer was graded correct.
    >>> summarize([[True, False], [False, False]], [["1", "2"], ["3", None]])["avg@2"]
    0.25
    """
    from collections import Counter

    k = k or (len(correct_PK[0]) if correct_PK else 0)
    maj = []
    for corr, ext in zip(correct_PK, extracted_PK):
        votes = Counter(e for e in ext if e is not None)
        if not votes:
            maj.append(False)
            continue
        top = votes.most_common(1)[0][0]
        maj.append(any(c for c, e in zip(corr, ext) if e == top))
    n = max(1, len(correct_PK))
    return {
        f"avg@{k}": sum(sum(c) / len(c) for c in correct_PK) / n,
        f"pass@{k}": sum(any(c) for c in correct_PK) / n,
        f"maj@{k}": sum(maj) / n,
        "problems": len(correct_PK),
        "k": k,
    }


def pass_at(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): 1 − C(n−c, k) / C(n, k), as a product.

    >>> pass_at(4, 1, 1), pass_at(4, 0, 2), round(pass_at(4, 1, 2), 3)
    (0.25, 0.0, 0.5)
    """
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def eval_cuts(settings) -> Truncation:
    """[eval]'s sampler cuts (top-p, top-k, min-p) as the engine takes them."""
    from minirl.rollout.engine import Truncation  # deferred: torch (the CLI imports this module at start)

    return Truncation.of(settings)


def cut_settings(cuts: Truncation) -> dict:
    """The cuts an evaluation sampled with, for its results and the key of its file: none where it has none
    (so an evaluation without them keeps the key it always had)."""
    return {"top_p": cuts.top_p, "top_k": cuts.top_k, "min_p": cuts.min_p} if cuts.cuts else {}


def evaluate(
    engine,
    problems: Sequence[Problem],
    grading: GradingPool,
    *,
    k: int,
    sampler,
    max_tokens: int,
    decode: Callable[[list[int]], str],
    eos_id: int,
    seed: int = 1234,
    gather: Callable[[list], list] = list,
    episodes=None,
) -> dict:
    """k samples per problem, graded: {avg@k, pass@k, maj@k, problems, k, temperature} (and the sampler's
    cuts where it has any: top_p, top_k, min_p). `sampler`: the [eval] section (its temperature and cuts).

    gather: joins the per-problem results of every rank (each passed its share of the problems).
    episodes: a multi-turn recipe's `Environments` (rollout/episodes.py): k episodes per problem, the
    last turn graded, or the environment's reward where it ended one with a reward."""
    # each problem's samples from a generator of its own: the score does not depend on what else the
    # engine holds or how many sequences it schedules (an engine sampling ahead at k ≥ 1, #74)
    temperature, cuts = sampler.temperature, eval_cuts(sampler)
    if episodes is not None:
        try:
            groups = episodes.sample(engine, problems, n=k, temperature=temperature, max_tokens=max_tokens, seed=seed,
                                     seeded_requests=True, **cuts.kw)
        finally:  # a client's sessions free again for the engine's process (k ≥ 1), or for training's next step
            episodes.release()
    else:
        groups = engine.generate([p.prompt_ids for p in problems], n=k, temperature=temperature, max_tokens=max_tokens,
                                 seed=seed, seeded_requests=True, **cuts.kw)
    comps = [c for g in groups for c in g]
    mode = episodes.settings.reward if episodes is not None else "final"
    items = [(prob.record, response_text(answer_ids(c), decode, eos_id))
             for prob, g in zip(problems, groups) for c in g]
    scores = grading.grade_where(items, [needs_grade(c, mode) for c in comps])
    rewards = episode_rewards(comps, scores, mode)
    # a sample the environment's fault ended is no sample of the model: left out of each problem's k
    per_problem = gather([[(rewards[j] >= 1.0, scores[j].info.get("extracted"), trains(comps[j]))
                           for j in range(i * k, (i + 1) * k)] for i in range(len(problems))])
    faults = [c.episode.fault for c in comps if not trains(c)]
    if episodes is not None:
        check_faults(episodes.settings, len(faults), len(comps), faults[:1], gather)
    kept = [[(c, e) for c, e, ok in p if ok] for p in per_problem]
    kept = [p for p in kept if p]
    return {
        **summarize([[c for c, _ in p] for p in kept], [[e for _, e in p] for p in kept], k=k),
        "k": k,
        "temperature": temperature,
        **cut_settings(cuts),
        **({"env_faults": sum(not ok for p in per_problem for _, _, ok in p)} if episodes is not None else {}),
    }


def check_faults(env, faults: int, episodes: int, first: list[str], gather) -> None:
    """Stop an evaluation whose episodes ended in the environment's fault past env.max_error_frac (over
    every rank): its avg@k would be the environment's, not the model's."""
    counts = gather([(faults, episodes, first)])
    n, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if n and n > env.max_error_frac * total:
        why = next((f[0] for _, _, f in counts if f), "")
        raise EnvFault(f"the environment {env.name!r} failed in {n} of {total} episodes of the evaluation (first: "
                       f"{why[:200]}); no score was taken: fix the environment (or its server), or raise "
                       "env.max_error_frac")
