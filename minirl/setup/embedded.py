"""The embedded default that `minirl init` builds in a workspace: the tiny Qwen3-MoE's shape, its
tokenizer, the task's splits and the cold-start SFT, all through the real engines.

Writes, under the workspace:
    data/train.jsonl, data/heldout.jsonl   the task's splits (the held-out one never trained on)
    model/tokenizer/                       char-level HF tokenizer (Qwen3's chat tokens with a chat template)
    model/coldstart/                       the cold-start policy, HF folder, and minirl_coldstart.json
    model/coldstart-dcp/                   the same weights as a TorchTitan DCP checkpoint
"""

from __future__ import annotations

import dataclasses
import json
import time

from minirl.data.gym import is_gym, make_gym_splits
from minirl.data.prompts import prompts_ids, response_text
from minirl.data.task import make_splits, write_jsonl
from minirl.envs.formats import TINY as TINY_FORMAT
from minirl.envs.hosting import check_start
from minirl.envs.templates import format_for
from minirl.errors import UsageError
from minirl.models import sizing
from minirl.models.shapes import TINY, ModelShape, param_count
from minirl.setup.tokenizer import CHAT_VOCAB, WIDE_VOCAB, build_tokenizer
from rewards import load_grader


def tiny_shape(rec) -> ModelShape:
    """The tiny model `init` builds for a recipe: its [cold_start] layers, experts and top-k, with a
    context that fits the recipe's prompts and responses (a multiple of 32)."""
    cs, need = rec.cold_start, sizing.max_model_len(rec)  # a multi-turn task's replies included
    return dataclasses.replace(TINY, max_seq_len=max(TINY.max_seq_len, -(-need // 32) * 32), n_layers=cs.layers,
                               num_experts=cs.experts, top_k=cs.top_k,
                               # English text; with the chat template, Qwen3's chat tokens too
                               vocab_size=CHAT_VOCAB if rec.data.chat_template else
                               WIDE_VOCAB if is_gym(cs.task) else TINY.vocab_size)


def build_embedded_default(ws, rec, *, progress=None) -> dict:
    """Tokenizer, tiny Qwen3-MoE, task splits and the cold-start SFT in the workspace `ws` (setup/workspace.py's
    Workspace, which imports this module); returns what minirl_coldstart.json holds."""
    import torch  # deferred, with the three below: the CLI imports this module at start

    from minirl.train.hf_io import save_hf_folder  # deferred: torch
    from minirl.train.sft import cold_start, sampled_accuracy
    from minirl.train.trainer import Trainer

    def tell(stage: str, done: int, total: int, **info) -> None:
        if progress is not None:
            progress(stage, done, total, info)

    cs = rec.cold_start
    shape = tiny_shape(rec)
    t0 = time.time()
    chat = rec.data.chat_template  # the tiny model speaks Qwen3's chat format (setup/tokenizer.py)
    tok_dir = build_tokenizer(ws.root / "model" / "tokenizer", shape.vocab_size, shape.max_seq_len, chat=chat)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    eos = tok.eos_token_id
    tell("data", 0, 1)
    # the model is told its tools, and its calls and replies are written, as a run of this recipe does
    tools = check_start(rec.env, {}, seed=0) if chat and rec.env.name else []
    train, heldout = _task_splits(ws, rec, tok, tools)
    tell("data", 1, 1)

    tell("model", 0, 1)
    examples = _sft_examples(tok, rec, train, tools)
    trainer = Trainer(shape, lr=cs.lr, seed=cs.seed)
    tell("model", 1, 1)

    dev, sft_examples = examples[: cs.dev_size], examples[cs.dev_size :]
    is_correct = _dev_judge(rec, train, tok)
    losses: list[float] = []
    dev_acc: list[float] = []

    def on_step(step: int, loss: float) -> None:
        losses.append(loss)
        if step % 10 == 0:
            tell("cold-start", step + 1, cs.max_steps, loss=sum(losses[-10:]) / len(losses[-10:]),
                 dev_acc=dev_acc[-1] if dev_acc else 0.0)

    def reached_target(step: int) -> bool:
        dev_acc.append(sampled_accuracy(trainer, dev, eos_id=eos, max_tokens=rec.rollout.max_tokens, seed=step,
                                        is_correct=is_correct))
        return dev_acc[-1] >= cs.target_acc

    t_sft = time.time()
    steps_run, final_loss = cold_start(
        trainer, sft_examples, max_steps=cs.max_steps, batch_size=cs.batch_size, lr=cs.lr,
        pad_id=tok.pad_token_id, seed=cs.seed, stop_when=reached_target, on_step=on_step, check_every=cs.check_every,
    )
    # the bar ends where SFT stopped (the dev target can end it long before max_steps)
    tell("cold-start", steps_run, steps_run, loss=final_loss, dev_acc=dev_acc[-1] if dev_acc else 0.0)
    sft_s = time.time() - t_sft
    tell("save", 0, 1)
    out = ws.path(rec.model.path)
    save_hf_folder(out, shape, trainer.model.state_dict(), tokenizer_dir=tok_dir, dtype=torch.float32)
    trainer.save(ws.root / "model" / "coldstart-dcp", {"step": 0, "kind": "cold-start"})
    info = {
        "model": "tiny-qwen3-moe",
        "shape": {"layers": shape.n_layers, "experts": shape.num_experts, "top_k": shape.top_k,
                  "max_seq_len": shape.max_seq_len},
        "task": cs.task,
        "params": param_count(shape),
        "train_rows": len(train),
        "heldout_rows": len(heldout),
        "cold_start_steps": steps_run,
        "cold_start_final_loss": final_loss,
        "cold_start_dev_acc": dev_acc[-1] if dev_acc else None,
        "cold_start_target_acc": cs.target_acc,
        "cold_start_s": round(sft_s, 1),
        "response_tokens": _length_stats([len(ex[1]) for ex in examples]),  # of the SFT targets, EOS included
        "build_s": round(time.time() - t0, 1),
    }
    (out / "minirl_coldstart.json").write_text(json.dumps(info, indent=2))
    tell("save", 1, 1)
    return info


def _task_splits(ws, rec, tok, tools: list) -> tuple[list[dict], list[dict]]:
    """The task's train and held-out rows, written to the recipe's data files: reasoning-gym's, or an embedded
    task's, its calls and replies written in the format a run of this recipe writes them."""
    cs, chat = rec.cold_start, rec.data.chat_template
    fmt = (format_for(rec.env.tool_format, tok, chat=chat, chat_kwargs=rec.data.chat_template_kwargs, tools=tools)
           if rec.env.name else TINY_FORMAT)
    if is_gym(cs.task):
        train, heldout = make_gym_splits(cs.task, cs.task_params, cs.train_size, cs.heldout_size, seed=cs.seed)
        _check_prompts_fit(cs.task, train + heldout, rec.data.max_prompt_tokens)
    else:
        train, heldout = make_splits(cs.train_size, cs.heldout_size, seed=cs.seed, task=cs.task, fmt=fmt)
    write_jsonl(ws.path(rec.data.train), train)
    write_jsonl(ws.path(rec.data.heldout), heldout)
    return train, heldout


def _sft_examples(tok, rec, train: list[dict], tools: list) -> list[tuple]:
    """(prompt ids, target ids[, target mask]) for each train row. The target is the whole written-out response
    where the task has one, else the answer, then EOS; a multi-turn task's parts, its environment's reply
    masked out (the model reads it, never learns to write it)."""
    eos = tok.eos_token_id

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    def example(prompt: list[int], row: dict) -> tuple:
        if "parts" not in row:
            return prompt, ids(row.get("target", row["answer"])) + [eos]
        parts = [(ids(x), trained) for x, trained in row["parts"]]  # each part tokenized once
        return (prompt, [t for part, _ in parts for t in part] + [eos],
                [int(trained) for part, trained in parts for _ in part] + [1])

    prompts = prompts_ids(tok, [r["prompt"] for r in train], template=rec.data.prompt_template,
                          chat=rec.data.chat_template, chat_kwargs=rec.data.chat_template_kwargs, tools=tools or None)
    return [example(p, r) for p, r in zip(prompts, train)]


def _dev_judge(rec, train: list[dict], tok):
    """Whether a dev row's sampled response counts, as RL will count it (the recipe's grader). A multi-turn
    task is sampled without its environment: its first call written right counts (the environment would
    answer it; copying the answer is learnt alongside)."""
    grader = load_grader(rec.reward.grader, rec.reward.params)

    def is_correct(i: int, ids: list[int]) -> bool:
        text = response_text(ids, tok.decode, tok.eos_token_id)
        parts = train[i].get("parts") or []
        reply_at = next((j for j, (_, trained) in enumerate(parts) if not trained), None)
        if reply_at is not None and text.startswith("".join(x for x, _ in parts[:reply_at])):
            return True
        return grader(train[i], text).score >= 1.0

    return is_correct


def _check_prompts_fit(task: str, rows: list[dict], max_prompt_tokens: int) -> None:
    """The character tokenizer makes a prompt one token a character: one that is longer than
    data.max_prompt_tokens would be skipped by every run, so init says so before the cold start."""
    longest = max(len(r["prompt"]) for r in rows)
    if longest > max_prompt_tokens:
        over = sum(len(r["prompt"]) > max_prompt_tokens for r in rows)
        raise UsageError(f"--task {task}: {over} of {len(rows)} questions are longer than data.max_prompt_tokens = "
                         f"{max_prompt_tokens} (the longest {longest} characters, a token each): "
                         f"--set data.max_prompt_tokens={longest}, or cold_start.task_params for shorter ones")


def _length_stats(lengths: list[int]) -> dict:
    ordered = sorted(lengths)
    q = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return {"min": ordered[0], "p10": q(0.1), "median": q(0.5), "p90": q(0.9), "max": ordered[-1],
            "mean": round(sum(ordered) / len(ordered), 2)}
