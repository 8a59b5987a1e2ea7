"""Held-out evaluation: k samples per problem from the rollout engine, graded by the run's grader.

avg@k  = mean over problems of (correct samples / k)   (the paper's avg@32 with k = 32)
pass@k = share of problems with at least one correct sample
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from minirl.data import Problem
from rewards.base import Grader, grade_safely


def response_text(token_ids: Sequence[int], decode: Callable[[list[int]], str], eos_id: int) -> str:
    """The response as the grader sees it: decoded, EOS (and anything after it) removed."""
    ids = list(token_ids)
    if eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return decode(ids)


def evaluate(
    engine,
    problems: Sequence[Problem],
    grader: Grader,
    *,
    k: int,
    temperature: float,
    max_tokens: int,
    decode: Callable[[list[int]], str],
    eos_id: int,
    seed: int = 1234,
) -> dict:
    groups = engine.generate(
        [p.prompt_ids for p in problems], n=k, temperature=temperature, max_tokens=max_tokens, seed=seed
    )
    per_problem = []
    for prob, group in zip(problems, groups):
        scores = [grade_safely(grader, prob.record, response_text(c.token_ids, decode, eos_id)).score for c in group]
        per_problem.append(sum(s >= 1.0 for s in scores) / k)
    n = len(per_problem)
    return {
        f"avg@{k}": sum(per_problem) / n,
        f"pass@{k}": sum(p > 0 for p in per_problem) / n,
        "problems": n,
        "k": k,
        "temperature": temperature,
    }


def resolve_checkpoint(ws, rec, checkpoint: str):
    """'latest' | 'coldstart' | HF folder | run checkpoint (DCP) folder -> an HF folder vLLM can load."""
    from pathlib import Path

    from minirl.errors import UsageError

    if checkpoint == "coldstart":
        return ws.path(rec.model.path)
    if checkpoint == "latest":
        run = ws.latest_run()
        ckpts = sorted((run / "checkpoints").glob("step_*")) if run else []
        ckpts = [c for c in ckpts if not c.name.endswith(".tmp")]
        if not ckpts:
            raise UsageError(f"no run checkpoint in {ws.runs}; run `minirl run` first or pass --checkpoint coldstart")
        path = ckpts[-1]
    else:
        path = Path(checkpoint)
        if not path.exists():
            raise UsageError(f"checkpoint not found: {checkpoint}")
    if (path / "config.json").exists():
        return path
    if (path / "hf" / "config.json").exists():
        return path / "hf"
    if (path / "minirl.json").exists():  # a DCP step checkpoint: export its weights once
        from minirl.hf_io import save_hf_folder
        from minirl.models import shape_for
        from minirl.train import Trainer

        shape = shape_for(rec.model.id)
        trainer = Trainer(shape, lr=0.0)
        trainer.load(path, with_optim=False)
        return save_hf_folder(path / "hf", shape, trainer.model.state_dict(), tokenizer_dir=ws.path(rec.model.path))
    raise UsageError(f"{path} is neither an HF model folder nor a minirl checkpoint")


def eval_checkpoint(ws, rec, *, bench: str, checkpoint: str) -> dict:
    """Evaluate one checkpoint on the embedded held-out split; writes ws/evals/<bench>-<ckpt>.json."""
    import json
    import time

    from transformers import AutoTokenizer

    from minirl.data import load_problems
    from minirl.errors import UsageError
    from minirl.rollout import VLLMEngine
    from rewards.base import load_grader

    if bench != "heldout":
        raise UsageError(f"unknown benchmark {bench!r}; available here: heldout (the benchmark registry is issue 4)")
    model_dir = resolve_checkpoint(ws, rec, checkpoint)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems, _ = load_problems(
        rec.data.heldout, encode=lambda s: tok(s, add_special_tokens=False)["input_ids"],
        prompt_field=rec.data.prompt_field, answer_field=rec.data.answer_field,
        max_prompt_tokens=rec.data.max_prompt_tokens, base=ws.root,
    )
    problems = problems[: rec.eval.max_problems]
    engine = VLLMEngine(model_dir, dtype=rec.rollout.dtype, seed=rec.train.seed,
                        max_model_len=rec.data.max_prompt_tokens + rec.rollout.max_tokens + 1,
                        memory_fraction=rec.rollout.memory_fraction, kv_cache_gib=rec.rollout.kv_cache_gib, tensor_parallel=rec.rollout.tensor_parallel)
    result = evaluate(engine, problems, load_grader(rec.reward.grader, rec.reward.params), k=rec.eval.k,
                      temperature=rec.eval.temperature, max_tokens=rec.rollout.max_tokens,
                      decode=lambda ids: tok.decode(ids), eos_id=tok.eos_token_id)
    result["checkpoint"] = str(model_dir)
    out = ws.root / "evals" / f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    result["results_file"] = str(out)
    out.write_text(json.dumps(result, indent=2))
    return result
