"""The GPU sequence's peer (tests/gpu/sequence.py, step trl-peer): TRL's GRPOTrainer with its
colocated vLLM on the model, batch and lengths of the sequence's (b) run, for seconds a step and
response tokens/s beside `minirl run` on the same GPU in the same call.

Not part of minirl: TRL travels in the GPU kit (tests/gpu/prepare.sh) and shares the image's torch,
transformers and the kit's vLLM. TRL's side as close to minirl's as its options go: 32 prompts × 8
responses a step (one generation batch a step, micro-batches of 16), up to 1,024 response tokens
at T = 1, bf16, β = 0, `loss_type="dr_grpo"`, `scale_rewards="none"`, one update a generation
(on-policy), vLLM colocated and asleep (level 2) while training. The reward is the embedded
task's (exactly the answer): with random weights it is 0 everywhere, which changes no step's cost.

    python tests/gpu/trl_peer.py WORKSPACE MODEL_DIR --steps 3 --out trl.json [--dry]
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workspace", type=Path)
    ap.add_argument("model", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry", action="store_true", help="this CPU, the tiny model, HF generate (no vLLM), 8 tokens")
    a = ap.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rec = tomllib.loads((a.workspace / "minirl.toml").read_text())
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32 if a.dry else torch.bfloat16)
    train = load_dataset("json", data_files=str(a.workspace / rec["data"]["train"]), split="train")
    prompts, group, tokens = (8, 4, 8) if a.dry else (32, 8, 1024)
    micro = prompts * group if a.dry else 16

    def reward(prompts, completions, answer, **_):
        return [float(c == str(ans)) for c, ans in zip(completions, answer)]

    cfg = GRPOConfig(
        output_dir=str(a.out.parent / "trl-out"), use_cpu=a.dry, bf16=not a.dry, seed=0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=prompts * group // micro,
        num_generations=group, max_completion_length=tokens, temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=float(rec["train"]["lr"]), lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dr_grpo",
        scale_rewards="none", num_iterations=1, max_steps=a.steps + 1, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=not a.dry,
        use_vllm=not a.dry, vllm_mode="colocate", vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=tokens + int(rec["data"].get("max_prompt_tokens", 16)) + 1,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.t0)

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=train, processing_class=tok,
                          callbacks=[clock])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    steady = clock.seconds[1:] or clock.seconds  # the first step warms up (compiles, first wake), as minirl's first
    per_step = sum(steady) / len(steady)
    tokens_step = (sum(lengths[1:]) / len(lengths[1:]) if len(lengths) > 1 else lengths[0]) * prompts * group
    a.out.write_text(json.dumps({"side": "trl", "steps": len(steady), "seconds_per_step": round(per_step, 3),
                                 "response_tokens_per_step": round(tokens_step, 1),
                                 "response_tokens_per_s": round(tokens_step / per_step, 1),
                                 "first_step_s": round(clock.seconds[0], 2), "vllm": not a.dry}))


if __name__ == "__main__":
    main()
