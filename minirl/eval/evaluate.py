"""Held-out evaluation: k samples per problem from the rollout engine, graded by the run's grader.

avg@k  = mean over problems of (correct samples / k)   (the paper's avg@32 with k = 32)
pass@k = share of problems with at least one correct sample
maj@k  = share of problems whose most frequent extracted answer is a correct one
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minirl.config import recipes
from minirl.data.prompts import Problem, Prompter, prompt_ids, response_text
from minirl.disk import store
from minirl.disk.store import is_checkpoint, latest_trained
from minirl.envs.contract import environment_class, episode_seed
from minirl.envs.formats import check_format
from minirl.envs.hosting import check_start
from minirl.envs.outcome import answer_ids, needs_grade, rewards as episode_rewards, trains
from minirl.errors import EnvFault, UsageError
from minirl.eval import benchmarks
from minirl.models import hub
from minirl.setup.preflight import check_checkpoint, check_gradable, check_model_folder, instead
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

    return Truncation(top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p)


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


def _merged_adapter(ws, adapter: Path) -> Path:
    """A PEFT adapter folder merged onto the base its adapter_config.json names (a folder, or a Hub
    id fetched), once: kept under the evaluations' folder, named by both fingerprints, so that a
    resumed evaluation finds the same checkpoint."""
    from minirl.train.hf_io import merge_peft_folder  # deferred: torch (the CLI imports this module at start)

    named = str(json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or "")
    if not named:
        raise UsageError(f"{adapter}/adapter_config.json names no base model (base_model_name_or_path)")
    base = Path(named) if hub.is_local(named) else hub.fetch(named, weights=True)
    if not base.exists():
        raise UsageError(f"the adapter {adapter} applies to {named}, which is not here")
    check_model_folder(base)
    tag = hashlib.sha1((hub.fingerprint(adapter) + hub.fingerprint(base)).encode()).hexdigest()[:10]
    out = (ws.root / "evals" if ws else Path("minirl-evals")) / "merged" / f"{adapter.resolve().name}-{tag}"
    if not (out / "config.json").exists():
        merge_peft_folder(adapter, base, out)
    check_model_folder(out)
    return out


def resolve_checkpoint(ws, rec, checkpoint: str):
    """'latest' | 'coldstart' | HF folder | exported LoRA adapter folder | run checkpoint (DCP)
    folder | Hub id -> a checked HF folder vLLM can load."""

    def start_dir() -> Path:  # the model the workspace's runs start from
        if ws is None:
            raise UsageError(f"--checkpoint {checkpoint} needs a workspace (-w DIR)")
        return hub.model_dir(rec.model.id, rec.model.path, ws.root)

    if checkpoint == "coldstart":
        check_model_folder(start_dir())
        return start_dir()
    if checkpoint == "latest":
        if ws is None:
            raise UsageError("no workspace here: pass -w DIR, or --checkpoint with an HF folder or model id")
        path = latest_trained(ws)
        if path is None:
            raise UsageError(f"no run in {ws.runs} has trained a step yet; run `minirl run` first or pass "
                             "--checkpoint coldstart")
    else:
        path = Path(checkpoint)
        if not path.exists():
            if checkpoint.count("/") == 1 and not checkpoint.startswith((".", "/")):
                folder = hub.fetch(checkpoint, weights=True)
                check_model_folder(folder)
                return folder
            raise UsageError(f"checkpoint not found: {checkpoint}")
    if (path / "adapter_config.json").exists():  # an exported LoRA adapter: served merged onto its base
        return _merged_adapter(ws, path)
    for folder in (path, path / "hf"):
        if (folder / "config.json").exists():
            try:
                check_model_folder(folder)
            except UsageError as e:
                if ws is None or not is_checkpoint(path):
                    raise
                raise UsageError(f"{e}; {instead(path, check_model_folder(start_dir()), rec.model.id)}") from None
            return folder
    if is_checkpoint(path):  # a DCP step checkpoint: export its weights once
        from minirl.train.hf_io import save_hf_folder  # deferred: torch (the CLI imports this module at start)
        from minirl.train.trainer import Trainer

        shape = check_model_folder(start_dir())
        run_recipe = path.parent.parent / "recipe.toml"  # the model its run trained (LoRA adapters or not)
        # a run without a summary may be live: it prunes its old checkpoints as it goes, so what is read
        # is pinned first, and nothing is written into its folder (#82); an ended run's keeps its HF copy
        live = ws is not None and store.status(path.parent.parent) is None
        out = ws.root / ".cache" / "eval-hf" / checkpoint_label(path) if live else path / "hf"
        if live and (out / "config.json").exists():
            return out
        check_checkpoint(path, shape, rec.model.id)  # a damaged one: one line, nothing written
        with (_pinned(path, ws.root / ".cache") if live else contextlib.nullcontext(path)) as read:
            trainer = Trainer.for_checkpoint(recipes.load(run_recipe) if run_recipe.exists() else rec, shape,
                                             start_dir())
            trainer.load(read, with_optim=False)
        return save_hf_folder(out, shape, trainer.full_state_dict(), tokenizer_dir=start_dir())
    raise UsageError(f"{path} is neither an HF model folder nor a minirl checkpoint")


@contextlib.contextmanager
def _pinned(path: Path, cache: Path):
    """`path`'s files hard-linked into a folder of this process's own (a copy where links cannot be
    made): what a live run's pruning deletes then stays readable until it is read. A checkpoint
    pruned before it was pinned whole is one line."""
    pin = cache / "pins" / f"{os.getpid()}-{path.name}"
    shutil.rmtree(pin, ignore_errors=True)
    try:
        if not path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "pruned", str(path))
        for f in sorted(p for p in path.rglob("*") if p.is_file() and "hf" not in p.relative_to(path).parts):
            to = pin / f.relative_to(path)
            to.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, to)
            except FileNotFoundError:  # pruned meanwhile: below
                raise
            except OSError:  # no hard links here (another filesystem): a copy
                shutil.copy2(f, to)
    except FileNotFoundError:
        shutil.rmtree(pin, ignore_errors=True)
        raise UsageError(f"{path} was pruned by its run while it was read; evaluate a newer checkpoint "
                         "(--checkpoint latest again)") from None
    try:
        yield pin
    finally:
        shutil.rmtree(pin, ignore_errors=True)


def _format_prompt(tok, template: str, problem: str, chat_kwargs: dict | None = None, tools=()) -> list[int]:
    return prompt_ids(tok, problem, template=template, chat=bool(getattr(tok, "chat_template", None)),
                      chat_kwargs=chat_kwargs, tools=list(tools) or None)


def checkpoint_label(model_dir: Path) -> str:
    """A checkpoint's short name for a results file: `<run>-step_000300` for a run's checkpoint (its
    HF folder or DCP folder), else the folder's own name (`coldstart`, an export's)."""
    p = Path(model_dir).resolve()
    p = p.parent if p.name == "hf" else p
    name = f"{p.parent.parent.name}-{p.name}" if p.parent.name == "checkpoints" else p.name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def grader_of(bench_name: str, rec) -> tuple[str, dict]:
    """The grader and its params: the recipe's for the embedded task, a benchmark's own otherwise."""
    bench = benchmarks.get(bench_name)
    return (rec.reward.grader, rec.reward.params) if bench.hub_id is None else (bench.grader, {})


@dataclass(frozen=True)
class BenchData:
    """The problems an evaluation scores, the name its results are filed under, and how many
    problems the data holds (more than `records` when cut)."""

    name: str
    records: list[dict]
    total: int


def bench_records(bench_name: str, rec, *, heldout_path=None, data=None, data_dir=None,
                  max_problems: int = 0) -> BenchData:
    """The benchmark's problems ({"index", "problem", "answer"}): the embedded task's from the
    workspace's held-out split (at most eval.max_problems, as a run scores it), the others from
    --data, --data-dir or the Hub, every one unless `max_problems` cuts them. Data whose count is
    not the named benchmark's is not that benchmark: its results are filed under the file's own
    name. Cheap, so `minirl eval` asks first: a missing or unreachable benchmark fails at once."""
    bench = benchmarks.get(bench_name)
    if bench.hub_id is None:
        data = data or heldout_path
    elif data is None and data_dir is not None:
        data = Path(data_dir) / f"{bench.name}.jsonl"
    elif data is not None and (Path(data) / f"{bench.name}.jsonl").is_file():
        data = Path(data) / f"{bench.name}.jsonl"  # a folder of benchmark files, as --data-dir takes
    records = benchmarks.load_records(bench, data=data)
    name = bench.name
    if bench.problems is not None and data is not None and len(records) != bench.problems:
        name = Path(data).name  # e.g. `eval aime25 --data gsm8k.jsonl`: never filed as aime25
    cut = max_problems or (rec.eval.max_problems if bench.hub_id is None else 0)
    kept = records[:cut] if cut else records
    check_gradable(kept, str(data or bench.hub_id), *grader_of(bench_name, rec))
    return BenchData(name, kept, len(records))


def eval_benchmark(
    *,
    bench_name: str,
    model_dir,
    out_dir,
    rec,
    heldout_path=None,
    data=None,
    data_dir=None,
    records: BenchData | None = None,
    chunk: int = 16,
    on_progress=lambda done, total: None,
) -> dict:
    """`minirl eval`: k samples per problem with vLLM, graded with the benchmark's grader.

    records: `bench_records`' answer, if the caller has it already. Resumable: finished problems
    are appended to `<results>.partial.jsonl` chunk by chunk and are not generated again; the
    final JSON holds the summary and a per-problem breakdown.
    """
    import time

    from transformers import AutoConfig, AutoTokenizer

    from minirl.rollout import make_engine  # deferred: torch and vLLM (the CLI imports this module at start)

    bench = benchmarks.get(bench_name)
    got = records or bench_records(bench_name, rec, heldout_path=heldout_path, data=data, data_dir=data_dir)
    records = got.records
    grader_name, params = grader_of(bench_name, rec)
    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ctx = int(getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", 4096))
    if rec.eval.max_tokens >= ctx:
        raise UsageError(f"eval.max_tokens = {rec.eval.max_tokens}: the model's context is {ctx} tokens "
                         f"(max_position_embeddings in its config.json), prompt included; at most {ctx - 1}")
    max_tokens = min(rec.eval.max_tokens or rec.rollout.max_tokens, ctx - 1)  # a run's limit, fitted to this model
    budget = ctx - max_tokens
    template = rec.eval.prompt_template if bench.hub_id is not None and rec.eval.prompt_template else bench.prompt_template
    chat = bool(getattr(tok, "chat_template", None))
    if bench.chat_prompt_template and not rec.eval.prompt_template and chat:
        template = bench.chat_prompt_template
    episodes, tools = None, ()
    if rec.env.name:  # a multi-turn recipe: its episodes, with its environment, scored as the run scores them
        from minirl.rollout.environments import Environments  # deferred: torch (the CLI imports this module at start)

        # as a run's preflight: an environment that cannot run is one line before anything is written
        environment_class(rec.env.name)
        listed = check_start(rec.env, dict(records[0]), seed=episode_seed(rec.train.seed, 0, 0))
        tools = tuple(listed) if chat else ()  # told through the chat template, where there is one
        episodes = Environments(rec.env, tokenizer=tok, max_model_len=ctx, prompter=Prompter(
            "problem", template, chat, rec.data.chat_template_kwargs, tools, budget))
        check_format(rec.env.tool_format, lambda t: tok.encode(t, add_special_tokens=False),
                     lambda t: tok.encode(t, add_special_tokens=False, split_special_tokens=True),
                     rec.env.max_reply_tokens, episodes.fmt)  # as the model's chat template renders it
    prompts, truncated = [], 0
    for r in records:
        ids = _format_prompt(tok, template, r["problem"], rec.data.chat_template_kwargs, tools)
        if len(ids) > budget:  # keep the end, where the question is
            ids, truncated = ids[-budget:], truncated + 1
        prompts.append(ids)

    # everything that decides the samples and their grades, the checkpoint's resolved path among
    # them: an eval of another checkpoint or under other settings (precision, temperature, seed…)
    # neither resumes this one's partial results nor overwrites its file
    cuts = eval_cuts(rec.eval)
    settings = {"precision": rec.rollout.precision, "temperature": rec.eval.temperature, **cut_settings(cuts),
                "max_tokens": max_tokens,
                "seed": rec.train.seed, "template": template, "grader": [grader_name, params],
                "problems": len(records), "checkpoint": str(model_dir.resolve()),
                **({"env": [rec.env.name, rec.env.params, rec.env.tool_format, rec.env.max_turns, rec.env.reward,
                         *([rec.env.max_calls] if rec.env.max_calls > 1 else []),
                         *([rec.env.replies_to] if rec.env.replies_to != "calls" else [])]}
                   if rec.env.name else {})}
    tag = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{got.name}-k{rec.eval.k}-{checkpoint_label(model_dir)}-{tag}.json"
    partial = final.with_suffix(".partial.jsonl")
    done = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            try:
                row = json.loads(line)
                done[row["index"]] = row
            except json.JSONDecodeError:
                break  # a line cut by a crash: regenerate from there
    todo = [i for i in range(len(records)) if i not in done]
    on_progress(len(done), len(records))
    t0 = time.time()
    if todo:
        eos = tok.eos_token_id
        # an evaluation never sleeps between rollouts: the engine holds its memory throughout
        engine = make_engine(model_dir, rec.rollout, seed=rec.train.seed, max_model_len=ctx, sleep_level=0)
        pool = GradingPool(grader_name, params, workers=rec.eval.grader_workers, timeout_s=rec.reward.timeout_s)
        try:
            with partial.open("a") as f:
                for s in range(0, len(todo), chunk):
                    idx = todo[s : s + chunk]
                    # a seed per chunk (keyed by its first problem): chunks sharing one would give the j-th
                    # problem of every chunk the same noise
                    seed = (rec.train.seed + 1234) * 1_000_003 + idx[0]
                    if episodes is not None:
                        groups = episodes.sample(engine, [Problem(tuple(prompts[i]), records[i]) for i in idx],
                                                 n=rec.eval.k, temperature=rec.eval.temperature, max_tokens=max_tokens,
                                                 seed=seed, **cuts.kw)
                    else:
                        groups = engine.generate([prompts[i] for i in idx], n=rec.eval.k,
                                                 temperature=rec.eval.temperature, max_tokens=max_tokens, seed=seed,
                                                 **cuts.kw)
                    comps = [c for g in groups for c in g]
                    items = [(records[i], response_text(answer_ids(c), tok.decode, eos)) for i, g in zip(idx, groups)
                             for c in g]
                    mode = rec.env.reward
                    scores = pool.grade_where(items, [needs_grade(c, mode) for c in comps])
                    won = episode_rewards(comps, scores, mode)  # the grader's, or an episode's own reward
                    for j, i in enumerate(idx):
                        at = slice(j * rec.eval.k, (j + 1) * rec.eval.k)
                        ok = [trains(c) for c in comps[at]]  # a sample the environment's fault ended: left out
                        sc = [x for x, keep in zip(scores[at], ok) if keep]
                        row = {"index": i, "answer": records[i]["answer"],
                               "correct": [w >= 1.0 for w, keep in zip(won[at], ok) if keep],
                               "extracted": [x.info.get("extracted") for x in sc],
                               "timeouts": sum(bool(x.info.get("timeout")) for x in sc),
                               "errors": sum("error" in x.info for x in sc),
                               **({"env_faults": ok.count(False),
                                   "fault": next((c.episode.fault for c in comps[at] if not trains(c)), "")}
                                  if episodes is not None else {})}
                        f.write(json.dumps(row) + "\n")
                        done[i] = row
                    if episodes is not None:  # a broken environment stops the evaluation, not scores it 0
                        seen = list(done.values())
                        check_faults(rec.env, sum(r.get("env_faults", 0) for r in seen), rec.eval.k * len(seen),
                                     [r["fault"] for r in seen if r.get("fault")][:1], list)
                    f.flush()
                    on_progress(len(done), len(records))
        finally:
            pool.close()
    rows = [done[i] for i in range(len(records))]
    scored = [r for r in rows if r["correct"]]  # a problem whose every sample the environment's fault ended: none
    correct = [r["correct"] for r in scored]
    k = rec.eval.k
    result = {
        "benchmark": got.name,
        "of": got.total,  # problems in the data; "problems" (below) is how many were scored
        "checkpoint": str(model_dir.resolve()),  # the same checkpoint however its path was typed (export's card)
        **summarize(correct, [r["extracted"] for r in scored], k=k),
        # pass@j for j < k, unbiased from the k samples of each problem (Chen et al. 2021); pass@k
        # is the share of problems with a correct one among all k
        **{f"pass@{j}": sum(pass_at(len(c), sum(c), j) if len(c) >= j else float(any(c)) for c in correct)
                         / max(1, len(correct))
           for j in (1, 5, 10, 100) if j < k},
        **({"env_faults": sum(r.get("env_faults", 0) for r in rows)} if rec.env.name else {}),
        "temperature": rec.eval.temperature,
        **cut_settings(cuts),
        "rollout_precision": rec.rollout.precision,
        "seed": rec.train.seed,
        "max_tokens": max_tokens,
        "truncated_prompts": truncated,
        "grader": grader_name,
        "grader_timeouts": sum(r["timeouts"] for r in rows),
        "grader_errors": sum(r["errors"] for r in rows),
        "resumed_problems": len(records) - len(todo),
        "seconds": round(time.time() - t0, 1),
        "per_problem": rows,
        "results_file": str(final),
    }
    final.write_text(json.dumps(result, indent=2))
    partial.unlink(missing_ok=True)
    return result
