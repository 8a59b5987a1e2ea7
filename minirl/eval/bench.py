"""`minirl eval`: a benchmark's problems, k samples each from vLLM, graded by the benchmark's grader
(the embedded task's: the recipe's), with avg@k / pass@k / maj@k; resumable, and every response kept
beside its grade (`<results>.samples.jsonl`, `minirl samples --eval`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from minirl.data.prompts import Problem, Prompter, prompt_ids, response_text
from minirl.data.written import grader_info, records, written
from minirl.disk import atomic
from minirl.envs.contract import environment_class, episode_seed, scores_itself
from minirl.envs.formats import check_format
from minirl.envs.hosting import check_start
from minirl.envs.outcome import answer_ids, needs_grade, rewards as episode_rewards, trains
from minirl.errors import UsageError
from minirl.eval import benchmarks
from minirl.eval.checkpoints import checkpoint_label
from minirl.eval.evaluate import check_faults, cut_settings, eval_cuts, pass_at, summarize
from minirl.setup.preflight import check_gradable
from rewards.pool import GradingPool


def _format_prompt(tok, template: str, problem: str, chat_kwargs: dict | None = None, tools=()) -> list[int]:
    return prompt_ids(tok, problem, template=template, chat=bool(getattr(tok, "chat_template", None)),
                      chat_kwargs=chat_kwargs, tools=list(tools) or None)


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
    answers = bench.hub_id is not None or not scores_itself(rec.env)  # the environment gives every R: no answers
    records = benchmarks.load_records(bench, data=data, answers=answers)
    name = bench.name
    if bench.problems is not None and data is not None and len(records) != bench.problems:
        name = Path(data).name  # e.g. `eval aime25 --data gsm8k.jsonl`: never filed as aime25
    cut = max_problems or (rec.eval.max_problems if bench.hub_id is None else 0)
    kept = records[:cut] if cut else records
    if answers:
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
    keep_samples: bool = True,
    on_progress=lambda done, total: None,
) -> dict:
    """`minirl eval`: k samples per problem with vLLM, graded with the benchmark's grader.

    records: `bench_records`' answer, if the caller has it already. Resumable: finished problems
    are appended to `<results>.partial.jsonl` chunk by chunk and are not generated again; the
    final JSON holds the summary and a per-problem breakdown. `keep_samples`: every response, whole,
    beside its grade and extracted answer in `<results>.samples.jsonl` (a line a problem, written
    before its row: a problem the partial file does not hold is generated again and its line replaced).
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
    chat = bool(getattr(tok, "chat_template", None))
    template = _template(bench, rec, chat=chat)
    episodes, tools = None, ()
    if rec.env.name:  # a multi-turn recipe: its episodes, with its environment, scored as the run scores them
        episodes, tools = _environment(rec, records[0], tok, template, chat=chat, ctx=ctx, budget=budget)
    prompts, truncated = [], 0
    for r in records:
        ids = _format_prompt(tok, template, r["problem"], rec.data.chat_template_kwargs, tools)
        if len(ids) > budget:  # keep the end, where the question is
            ids, truncated = ids[-budget:], truncated + 1
        prompts.append(ids)

    cuts = eval_cuts(rec.eval)
    final = _results_file(Path(out_dir), got, rec, model_dir, template=template, grader=[grader_name, params],
                          max_tokens=max_tokens, cuts=cuts)
    partial = final.with_suffix(".partial.jsonl")
    done = _rows_done(partial)
    todo = [i for i in range(len(records)) if i not in done]
    samples_path = final.with_suffix(".samples.jsonl")
    samples = _samples_file(samples_path, set(done)) if keep_samples else None
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
                        row = _problem_row(i, records[i], comps[at], scores[at], won[at], env=episodes is not None)
                        if samples:  # before its row: a row on disk always has its samples
                            samples.write(json.dumps(_problem_samples(i, records[i], comps[at], scores[at], won[at],
                                                                      tok.decode, eos)) + "\n")
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
            if samples:
                samples.close()
    result = _summary(rec, got, [done[i] for i in range(len(records))], model_dir=model_dir, cuts=cuts,
                      max_tokens=max_tokens, truncated=truncated, grader_name=grader_name,
                      resumed=len(records) - len(todo), seconds=round(time.time() - t0, 1), final=final,
                      samples_path=samples_path if keep_samples else None)
    # whole or not at all (a full disk, a kill): the partial rows stay until the results are in place
    atomic.write_text(final, json.dumps(result, indent=2))
    partial.unlink(missing_ok=True)
    return result


def _template(bench, rec, *, chat: bool) -> str:
    """The prompt template: a recipe's own for a named benchmark where it sets one, else the benchmark's
    (its chat form where the tokenizer has a chat template)."""
    if bench.hub_id is not None and rec.eval.prompt_template:
        return rec.eval.prompt_template
    if bench.chat_prompt_template and not rec.eval.prompt_template and chat:
        return bench.chat_prompt_template
    return bench.prompt_template


def _environment(rec, first: dict, tok, template: str, *, chat: bool, ctx: int, budget: int):
    """(a multi-turn recipe's episodes, the tools its prompts are told), checked as a run's preflight checks
    them: an environment that cannot run is one line before anything is written."""
    from minirl.rollout.environments import Environments  # deferred: torch (the CLI imports this module at start)

    environment_class(rec.env.name)
    listed = check_start(rec.env, dict(first), seed=episode_seed(rec.train.seed, 0, 0))
    tools = tuple(listed) if chat else ()  # told through the chat template, where there is one
    episodes = Environments(rec.env, tokenizer=tok, max_model_len=ctx, prompter=Prompter(
        "problem", template, chat, rec.data.chat_template_kwargs, tools, budget))
    check_format(rec.env.tool_format, lambda t: tok.encode(t, add_special_tokens=False),
                 lambda t: tok.encode(t, add_special_tokens=False, split_special_tokens=True),
                 rec.env.max_reply_tokens, episodes.fmt)  # as the model's chat template renders it
    return episodes, tools


def _results_file(out_dir: Path, got: BenchData, rec, model_dir: Path, *, template: str, grader: list,
                  max_tokens: int, cuts) -> Path:
    """Where an evaluation's results go, named by a hash of everything that decides the samples and their
    grades, the checkpoint's resolved path among them: an eval of another checkpoint or under other settings
    (precision, temperature, seed…) neither resumes this one's partial results nor overwrites its file."""
    env = rec.env
    settings = {"precision": rec.rollout.precision, "temperature": rec.eval.temperature, **cut_settings(cuts),
                "max_tokens": max_tokens,
                "seed": rec.train.seed, "template": template, "grader": grader,
                "problems": len(got.records), "checkpoint": str(model_dir.resolve()),
                **({"env": [env.name, env.params, env.tool_format, env.max_turns, env.reward,
                            *([env.max_calls] if env.max_calls > 1 else []),
                            *([env.replies_to] if env.replies_to != "calls" else [])]}
                   if env.name else {})}
    tag = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / f"{got.name}-k{rec.eval.k}-{checkpoint_label(model_dir)}-{tag}.json"


def _rows_done(partial: Path) -> dict[int, dict]:
    """The problems an earlier try of the same evaluation finished, by index, up to a line a crash cut."""
    done = {}
    for line in partial.read_text().splitlines() if partial.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by a crash: regenerate from there
        done[row["index"]] = row
    return done


def _problem_row(i: int, record: dict, comps: list, scores: list, won: list, *, env: bool) -> dict:
    """A problem's row of the results: its k samples' grades, what the grader extracted, its timeouts and
    errors; with an environment, the samples its fault ended (left out of the grades) and the first fault."""
    ok = [trains(c) for c in comps]  # a sample the environment's fault ended: left out
    sc = [x for x, keep in zip(scores, ok) if keep]
    return {"index": i, "answer": record.get("answer", ""),
            "correct": [w >= 1.0 for w, keep in zip(won, ok) if keep],
            "extracted": [x.info.get("extracted") for x in sc],
            "timeouts": sum(bool(x.info.get("timeout")) for x in sc),
            "errors": sum("error" in x.info for x in sc),
            **({"env_faults": ok.count(False), "fault": next((c.episode.fault for c in comps if not trains(c)), "")}
               if env else {})}


def _summary(rec, got: BenchData, rows: list[dict], *, model_dir: Path, cuts, max_tokens: int, truncated: int,
             grader_name: str, resumed: int, seconds: float, final: Path, samples_path: Path | None) -> dict:
    """The results file's content: avg@k, pass@j, maj@k over the problems scored, the settings that
    decided them, and every problem's row."""
    scored = [r for r in rows if r["correct"]]  # a problem whose every sample the environment's fault ended: none
    correct = [r["correct"] for r in scored]
    k = rec.eval.k
    return {
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
        "resumed_problems": resumed,
        "seconds": seconds,
        "per_problem": rows,
        "results_file": str(final),
        **({"samples_file": str(samples_path)} if samples_path is not None else {}),
    }


def _samples_file(path: Path, done: set[int]):
    """The evaluation's samples file, open to append, holding the lines of the problems done alone (a
    kill may have written a problem's line and not its row: it is generated again), each once."""
    kept, seen = [], set()
    for r in records(path, key="index") if path.exists() else ():  # a line a kill tore is none
        if r["index"] in done and r["index"] not in seen:
            kept.append(json.dumps(r))
            seen.add(r["index"])
    atomic.write_text(path, "".join(x + "\n" for x in kept))
    return path.open("a", buffering=1)  # a line at a time: a problem's samples are on disk before its row


def _problem_samples(i: int, record: dict, comps: list, scores: list, won: list, decode, eos_id: int) -> dict:
    """A problem's k responses, whole, as a person reads them, each with its grade (None: the
    environment's fault ended it, not scored) and what the grader extracted."""
    return {"index": i, "problem": record["problem"], "answer": record.get("answer", ""),
            "responses": [{**written(c, decode, eos_id, None), "correct": bool(w >= 1.0) if trains(c) else None,
                           **({"grader": grader_info(x.info)} if x.info else {}), "finish": c.finish,
                           "tokens": len(c.token_ids)}
                          for c, x, w in zip(comps, scores, won)]}
