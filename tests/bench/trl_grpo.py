"""TRL's GRPOTrainer on a minirl workspace: the other side of `tests/bench/speed.py`.

Not part of minirl: it runs with TRL on PYTHONPATH (speed.py installs it into .bench/trl, never
into minirl's environment) and shares minirl's torch and transformers, so both sides compute with
the same kernels.

Same as `minirl run` on the workspace: the cold-start weights (HF folder), the train prompts in
their file order, the reward (exact answer), G, prompts per step, lr (constant, AdamW β = (0.9,
0.95), no weight decay, grad clip 1.0), max response tokens and T = 1. TRL's side of the recipe:
HF `generate` rollouts, `loss_type="dr_grpo"`, `scale_rewards="none"`, β = 0 (no reference model),
one update per generation batch (on-policy, as minirl's N = 1).

Every `--eval-every` steps (and before the first) the training clock stops and the held-out set
is scored avg@k at T = 1 with HF `generate`; the result lands in the JSON written to `--out`:
{"startup_s", "curve": [[step, rl_s, avg_at_k], ...], "steps", "rl_s", "wall_s"}.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path

T_PROCESS = time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--seconds", type=float, default=120.0, help="RL wall-time budget (evals excluded)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-problems", type=int, default=500)
    ap.add_argument("--target", type=float, default=None, help="stop once held-out avg@k reaches it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=100_000, help="stop after this many steps (a curve per step)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ws = a.workspace.resolve()
    rec = tomllib.loads((ws / "minirl.toml").read_text())
    tr, ro, ev = rec["train"], rec["rollout"], rec["eval"]
    model_dir = ws / rec["model"]["path"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train = load_dataset("json", data_files=str(ws / rec["data"]["train"]), split="train")
    heldout = [json.loads(x) for x in (ws / rec["data"]["heldout"]).read_text().splitlines() if x.strip()]
    heldout = heldout[: a.eval_problems]
    k = ev["k"]

    def reward(prompts, completions, answer, **_):  # the embedded task's grader: exactly the answer
        return [float(c == str(ans)) for c, ans in zip(completions, answer)]

    @torch.no_grad()
    def heldout_avg() -> float:
        model.eval()
        ok = n = 0
        for s in range(0, len(heldout), 128):
            rows = heldout[s : s + 128]
            enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(**enc, do_sample=True, temperature=ev["temperature"], top_k=0, top_p=1.0,
                                 max_new_tokens=ro["max_tokens"], num_return_sequences=k,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for i, t in enumerate(texts):
                ok += t == str(rows[i // k]["answer"])
                n += 1
        model.train()
        return ok / n

    G, P = tr["group_size"], tr["prompts_per_step"]
    cfg = GRPOConfig(
        output_dir=str(a.out.parent / "trl-out"), use_cpu=True, bf16=False, seed=a.seed, data_seed=a.seed,
        per_device_train_batch_size=P * G, num_generations=G, gradient_accumulation_steps=1,
        max_completion_length=ro["max_tokens"], temperature=ro["temperature"], top_k=0, top_p=1.0,
        learning_rate=tr["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.0, max_grad_norm=tr.get("grad_clip", 1.0), beta=0.0, loss_type="dr_grpo",
        scale_rewards="none", num_iterations=1, max_steps=a.max_steps, logging_steps=10_000, save_strategy="no",
        report_to=[], disable_tqdm=True, shuffle_dataset=True, dataloader_num_workers=0,
    )

    class Clock(TrainerCallback):
        """Stops the RL clock around held-out evals; ends training at the budget or the target."""

        def __init__(self):
            self.curve, self.rl_s, self.t0, self.started = [], 0.0, None, None

        def _eval(self, step):
            self.curve.append([step, round(self.rl_s, 3), heldout_avg()])
            print(f"step {step}  rl {self.rl_s:.1f} s  held-out avg@{k} {self.curve[-1][2]:.3f}", flush=True)

        def on_train_begin(self, args, state, control, **kw):
            self.started = time.time()
            self._eval(0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.rl_s += time.perf_counter() - self.t0
            last = self.rl_s >= a.seconds or state.global_step >= a.max_steps
            if state.global_step % a.eval_every == 0 or last:
                self._eval(state.global_step)
                reached = a.target is not None and self.curve[-1][2] >= a.target
                if reached or last:
                    control.should_training_stop = True
            self.t0 = time.perf_counter()

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=train, processing_class=tok,
                          callbacks=[clock])
    trainer.train()
    a.out.write_text(json.dumps({
        "side": "trl", "startup_s": round(clock.started - T_PROCESS, 2), "curve": clock.curve,
        "steps": clock.curve[-1][0], "rl_s": round(clock.rl_s, 3), "wall_s": round(time.time() - T_PROCESS, 2),
    }))


if __name__ == "__main__":
    main()
