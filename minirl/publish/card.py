"""The model card (README.md) of an exported checkpoint, through huggingface_hub's `ModelCard`:
its YAML metadata comes from `ModelCardData` (model-index from `EvalResult`s), its body from the
Jinja template below. Every figure is read from the run's own files."""

from __future__ import annotations

from pathlib import Path

from minirl.data.loader import load_rows
from minirl.data.written import clipped, records, text_of
from minirl.disk import store
from minirl.disk.store import Checkpoint, metric_rows
from minirl.models.hub import repo_id as hub_repo
from minirl.models.shapes import TINY_ID


TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ origin }}, trained with reinforcement learning by minirl with the MiniRL recipe ("Stabilizing Reinforcement Learning with LLMs", arXiv 2512.01374): the token-level
objective as a first-order approximation of the sequence reward, token-level importance-sampling
correction against the rollout engine, and decoupled clipping{{ replay_words }}.

This folder is checkpoint **step {{ step }}** of run `{{ run_name }}`: {{ why }}.

## Results

| evaluation | metric | before RL | this checkpoint |
|---|---|---|---|
{%- for r in results %}
| {{ r.name }} | {{ r.metric }} | {{ r.before }} | {{ r.after }} |
{%- endfor %}

## Training run

| | |
|---|---|
| steps | {{ step }} of {{ planned_steps }} planned ({{ status }}) |
| wall time | {{ wall }} |
| prompts × responses per step | {{ B }} × {{ G }} |
| rollbacks by the guard | {{ rollbacks | length }} |
{%- for rb in rollbacks %}
| rollback at step {{ rb.step }} | {{ rb.reason }}; back to step {{ rb.to }} |
{%- endfor %}

![reward, entropy, KL, IS weights, clipping and parity per step; rollbacks dashed red](training_curves.png)
{%- if samples %}

## What it writes

{{ samples_source }}
{% for x in samples %}
**{{ x.head }}**
{% if x.prompt %}
```text
{{ x.prompt }}
```
{% endif %}
```text
{{ x.text }}
```
{% endfor %}
{%- endif %}

## Recipe

| | |
|---|---|
| loss | `{{ rec.loss.name }}`; length normalisation {{ rec.loss.length_norm }}; group-mean advantage{{ " / std" if rec.loss.adv_std else "" }} |
| IS correction | `{{ rec.loss.is_mode }}`, cap {{ rec.loss.tis_cap }} |
| clipping | ε_low {{ rec.loss.eps_low }}, ε_high {{ rec.loss.eps_high }} |
| mini-batches per step (N) | {{ rec.train.minibatches }} |
{%- if rec.rollout.max_staleness %}
| sampled ahead (k) | at most {{ rec.rollout.max_staleness }} update(s) behind{{ ", in-flight updates" if rec.rollout.inflight_updates else "" }}; stale tokens clipped against {{ "their sampler" if rec.loss.clip_against == "sampler" else "π_old (proximal)" }} |
{%- endif %}
| routing replay | {{ rec.train.replay }} |
| precision | rollouts {{ rollout_precision }} (vLLM), training {{ train_precision }} (TorchTitan) |
| learning rate | {{ rec.train.lr }} |
| reward | `{{ rec.reward.grader }}` grader on `{{ rec.data.train }}` |
{%- if lora %}
| LoRA | {{ lora }} |
{%- endif %}

<details><summary>The whole recipe (minirl.toml)</summary>

```toml
{{ recipe_toml }}
```

</details>

## Use

With transformers:

```python
{{ transformers_snippet }}
```

With vLLM:

```python
{{ vllm_snippet }}
```
"""

TRANSFORMERS = """from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = "{model}"
PROMPT = {prompt!r}
tok = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL)
{encode}
out = model.generate(ids, max_new_tokens={max_tokens}, do_sample=True)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))"""

PEFT = """from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

BASE = "{base}"
# this LoRA adapter
MODEL = "{model}"
PROMPT = {prompt!r}
tok = AutoTokenizer.from_pretrained(BASE)
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), MODEL)
{encode}
out = model.generate(ids, max_new_tokens={max_tokens}, do_sample=True)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))"""

# vLLM 0.32 has LoRA layers for Qwen3-MoE's experts; minirl has not served its adapters through them
VLLM_LORA = """from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

BASE = "{base}"
# this LoRA adapter (untested with vLLM by minirl: `minirl export` without --adapter writes the merged
# model, which vLLM loads as any other)
MODEL = "{model}"
PROMPT = {prompt!r}
llm = LLM(model=BASE, enable_lora=True, max_lora_rank={rank})
{call}
print(out[0].outputs[0].text)"""

VLLM = """from vllm import LLM, SamplingParams

MODEL = "{model}"
PROMPT = {prompt!r}
llm = LLM(model=MODEL)
{call}
print(out[0].outputs[0].text)"""


def model_card(run_dir: Path, rec, ckpt, *, why: str, folder: Path, eval_results: list[dict],
               moe: bool, repo_id: str | None = None, lora: dict | None = None, adapter_of: str | None = None):
    """The card of checkpoint `ckpt` of `run_dir`, exported into `folder` (the name snippets load
    unless `repo_id` is given); moe: the model is a Qwen3-MoE. lora: the trainer's LoRA settings (rank, alpha, targets), if any;
    adapter_of: the folder is a PEFT LoRA adapter of this base model."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    summary = store.read_summary(run_dir)
    rows = metric_rows(run_dir / "metrics.jsonl", upto=ckpt.step)
    model_id = rec.model.id
    base = hub_repo(model_id)
    origin = (f"[{base}](https://huggingface.co/{base})" if base else
              "The embedded tiny Qwen3-MoE of minirl (0.9M parameters, cold-started on 3-digit addition)"
              if model_id == TINY_ID else f"The Qwen3 checkpoint `{model_id}`")
    k = rec.eval.k
    metric = f"avg@{k}"
    held = summary.get("heldout", {})
    before = held.get("start", {}).get(metric)
    known = known_score(run_dir, ckpt, metric)
    after = known[0] if known else None
    results = [{"name": f"held-out split `{rec.data.heldout}`", "metric": metric, "before": _fmt(before),
                "after": _fmt(after)}]
    eval_objs = []
    if after is not None:
        eval_objs.append(EvalResult(task_type="text-generation", dataset_type=rec.data.heldout,
                                    dataset_name="held-out split", dataset_split=rec.data.heldout_split,
                                    metric_type="accuracy", metric_name=metric, metric_value=round(after, 4)))
    for r in eval_results:
        key = f"avg@{r['k']}"
        cut = f", {r['problems']:,} of {r['of']:,} problems" if r.get("of", r.get("problems")) != r.get("problems") else ""
        results.append({"name": f"{r['benchmark']} (`minirl eval`{cut})", "metric": key, "before": "",
                        "after": _fmt(r.get(key))})
        eval_objs.append(EvalResult(task_type="text-generation", dataset_type=r["benchmark"],
                                    dataset_name=r["benchmark"], metric_type="accuracy", metric_name=key,
                                    metric_value=round(float(r[key]), 4)))
    rollbacks = [{"step": r["step"], "reason": r.get("guard/reason", ""), "to": r["guard/rollback_to_step"]}
                 for r in rows if "guard/rollback_to_step" in r]
    name = folder.name.removesuffix(".tmp") if repo_id is None else repo_id.split("/")[-1]
    data = ModelCardData(
        model_name=name,
        base_model=base,
        library_name="peft" if adapter_of else "transformers",
        pipeline_tag="text-generation",
        license="apache-2.0",  # Qwen3 and minirl's embedded model alike
        tags=["minirl", "reinforcement-learning", "qwen3_moe" if moe else "qwen3",
              f"replay-{rec.train.replay}", *(["lora"] if lora else [])],
        datasets=[d for d in (rec.data.train, rec.data.heldout) if _hub_dataset(d)] or None,
        eval_results=eval_objs or None,
    )
    ref = repo_id or f"./{name}"
    prompt = _sample_prompt(run_dir, rec)
    chat = rec.data.chat_template
    kw = rec.data.chat_template_kwargs  # as the run's prompts were made (Qwen3: enable_thinking)
    tok_kw = "".join(f", {k}={v!r}" for k, v in kw.items())
    encode = ('ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, '
              f'return_tensors="pt", return_dict=True{tok_kw})["input_ids"]' if chat else
              'ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids')
    sp = f"SamplingParams(temperature={rec.rollout.temperature}, max_tokens={rec.rollout.max_tokens})"
    lora_arg = ', lora_request=LoRARequest("minirl", 1, MODEL)' if adapter_of else ""
    chat_kw = f", chat_template_kwargs={dict(kw)!r}" if kw else ""
    call = (f'out = llm.chat([{{"role": "user", "content": PROMPT}}], {sp}{lora_arg}{chat_kw})' if chat else
            f"out = llm.generate([PROMPT], {sp}{lora_arg})")
    samples, samples_source = _samples(run_dir, ckpt, eval_results)
    wall = summary.get("wall_s") if summary and Path(summary.get("checkpoint", "")).name == ckpt.path.name else None
    wall = wall if wall is not None else next((r.get("timing/elapsed_s") for r in reversed(rows)), None)
    return ModelCard.from_template(
        data, template_str=TEMPLATE, model_name=name, origin=origin,
        replay_words={"r2": ", with Routing Replay R2 (the trainer's own routes replayed in every mini-batch)",
                      "r3": ", with Routing Replay R3 (the rollout engine's routes replayed in the trainer)"}.get(
                          rec.train.replay, ""),
        step=ckpt.step, run_name=run_dir.name, why=why, results=results, planned_steps=rec.train.steps,
        status=summary.get("status", "no summary: interrupted or running") if summary else
        "no summary: interrupted or running",
        wall=f"{wall:.0f} s" if isinstance(wall, (int, float)) else "unknown",
        B=rec.train.prompts_per_step, G=rec.train.group_size, rollbacks=rollbacks, rec=rec,
        rollout_precision={"fp8": "fp8 weights (torchao, per-row scales)"}.get(rec.rollout.precision,
                                                                              rec.rollout.precision),
        train_precision={"auto": "float32 on CPU, bfloat16 with float32 master weights on CUDA"}.get(
            rec.train.param_dtype, rec.train.param_dtype),
        recipe_toml=rec.to_toml().strip(), samples=samples, samples_source=samples_source,
        lora=_lora_words(lora, adapter_of),
        transformers_snippet=(PEFT.format(base=adapter_of, model=ref, prompt=prompt, encode=encode,
                                          max_tokens=rec.rollout.max_tokens) if adapter_of else
                              TRANSFORMERS.format(model=ref, prompt=prompt, encode=encode,
                                                  max_tokens=rec.rollout.max_tokens)),
        vllm_snippet=(VLLM_LORA.format(base=adapter_of, model=ref, prompt=prompt, call=call, rank=lora['rank'])
                      if adapter_of else VLLM.format(model=ref, prompt=prompt, call=call)),
    )


def _samples(run_dir: Path, ckpt, eval_results: list[dict], most: int = 3) -> tuple[list[dict], str]:
    """A few responses of these weights for the card, and what they are: the first response to each of the
    first problems of a `minirl eval` of this checkpoint that kept them (held-out first), else the first
    group the run sampled with these weights (its next step's), else none."""
    for r in sorted(eval_results, key=lambda r: r.get("benchmark") != "heldout"):
        path = Path(r.get("samples_file") or "")
        if not path.is_file():
            continue
        got = [x for x in records(path, key="index") if x["responses"]][:most]
        if got:
            return ([{"head": f"problem {x['index']} (reference answer {x['answer']}): "
                      + {True: "right", False: "wrong", None: "not scored"}[x["responses"][0].get("correct")],
                      "prompt": clipped(x["problem"], 600), "text": clipped(text_of(x["responses"][0]), 1000)}
                     for x in got],
                    f"The first response to each of the first {len(got)} problems of `minirl eval {r['benchmark']}` "
                    f"of this checkpoint (k = {r['k']}, T = {r['temperature']}):")
    path = run_dir / "samples.jsonl"
    if path.is_file():
        nxt = next((x for x in records(path) if x["step"] == ckpt.step + 1), None)  # sampled by these weights
        if nxt is not None:
            return ([{"head": f"response {j}: score {x.get('score')}, reward {x.get('reward')}",
                      "prompt": clipped(nxt["prompt"], 600) if j == 0 else "", "text": clipped(text_of(x), 1000)}
                     for j, x in enumerate(nxt["responses"][:most])],
                    f"What these weights wrote in training (the run's step {ckpt.step + 1}, its first group):")
    return [], ""


def _lora_words(lora: dict | None, adapter_of: str | None) -> str:
    """The card's LoRA row: what was adapted, and whether this folder is the merged model or the adapter."""
    if not lora:
        return ""
    what = (f"this folder is the adapter (PEFT) of `{adapter_of}`" if adapter_of else
            "merged into this model's weights (W + (α/r)·B·A)")
    return f"rank {lora['rank']}, α {lora['alpha']:g}, on {', '.join(lora['targets'])}; {what}"


def _fmt(v) -> str:
    return f"{float(v):.3f}" if isinstance(v, (int, float)) else "not measured"


def _hub_dataset(spec: str) -> bool:
    """A Hub dataset id (owner/name), not a local file."""
    return spec.count("/") == 1 and not Path(spec).suffix and not spec.startswith((".", "/"))


def _sample_prompt(run_dir: Path, rec) -> str:
    """A prompt as the model saw it in training (the recipe's template, without the chat wrapper)."""
    try:
        rows = load_rows(rec.data.heldout, base=run_dir.parent.parent, split=rec.data.heldout_split)
        text = str(rows.rows[0][rec.data.prompt_field])
    except Exception:  # noqa: BLE001 - a card without the data at hand still gets a snippet
        text = "What is 1 + 1?"
    return rec.data.prompt_template.format(problem=text)


def known_score(run_dir: Path, ckpt: Checkpoint, metric: str) -> tuple[float, str] | None:
    """A held-out score this checkpoint already has, and where it comes from."""
    got = store.read_scores(ckpt.path)
    if metric in got:
        return float(got[metric]), f"{store.SCORES} ({got.get('measured_by', 'measured by an earlier export')})"
    summary = store.read_summary(run_dir)
    if summary:
        held = summary.get("heldout", {})
        if ckpt.step == 0 and metric in held.get("start", {}):
            return float(held["start"][metric]), "the run's held-out evaluation at its start"
        if Path(summary.get("checkpoint", "")).name == ckpt.path.name and metric in (held.get("end") or {}):
            return float(held["end"][metric]), "the run's held-out evaluation at its end"
    return None
