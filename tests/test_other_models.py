"""`minirl run --model DIR` on checkpoints minirl did not build: a Qwen3-MoE of another shape
(2 layers, 16 experts, top-4) and a dense Qwen3, each made and saved by transformers itself. The
architecture comes from their config.json; vLLM rolls out, TorchTitan trains, and the export is
again a folder transformers loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def make_folder(kind: str, out: Path, tok_dir: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    ids = json.loads((tok_dir / "minirl_special_ids.json").read_text())
    common = dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    torch.manual_seed(0)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                                                   norm_topk_prob=True, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=96, **common))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / f).exists():
            shutil.copy(tok_dir / f, out / f)
    return out


@pytest.fixture(scope="module")
def data_ws(tmp_path_factory) -> Path:
    """A workspace with the embedded task's data and no model of its own."""
    from tests.conftest import data_workspace

    return data_workspace(tmp_path_factory.mktemp("other") / "ws")


def minirl(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_run_trains_a_checkpoint_of_another_shape(kind, data_ws, tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_folder(kind, tmp_path / kind, tiny_dir)
    r = minirl("run", str(data_ws), "--model", str(folder), "--steps", "2",
               "--set", "train.prompts_per_step=8", "--set", "eval.k=1",
               # a random policy earns no exact sums; a number within 500 of the sum gives a signal
               "--set", "reward.grader=numeric", "--set", 'reward.params={"tol": 500}', "--set", "rollout.parity_every=1")
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = sorted(p for p in (data_ws / "runs").iterdir() if p.is_dir())[-1]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    assert any(m["rollout/reward_mean"] > 0 for m in rows)
    assert all(0 < m["sync/parity_abs_dlogp"] < 5e-2 for m in rows)  # vLLM (bf16) matches the trainer after sync
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recipe"]["model"] == {"id": str(folder), "path": ""}

    before = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    after = AutoModelForCausalLM.from_pretrained(summary["hf_folder"], dtype=torch.float32)
    assert type(after) is type(before)  # the export keeps the architecture
    sd0, sd1 = before.state_dict(), after.state_dict()
    assert sd0.keys() == sd1.keys()
    assert any(not torch.equal(sd0[k], sd1[k]) for k in sd0)  # and it holds the trained weights


def test_replay_on_a_dense_model_is_refused_in_one_line(data_ws, tiny_dir, tmp_path):
    folder = make_folder("dense", tmp_path / "dense", tiny_dir)
    r = minirl("run", str(data_ws), "--model", str(folder), "--replay", "r2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"minirl: error: train.replay = 'r2' replays MoE routes, and {folder} is a dense model; use off"]


def test_init_model_writes_a_recipe_suited_to_it(tiny_dir, tmp_path):
    """`minirl init --model`: the model's shipped recipe, or the generic one suited to a dense
    model; math data, grader and chat template; no cold start; only the config is read."""
    from minirl.config import recipes

    r = minirl("init", str(tmp_path / "moe"), "--model", "Qwen3-30B-A3B")
    assert r.returncode == 0, r.stderr
    rec = recipes.load(tmp_path / "moe" / "minirl.toml", [])
    assert (rec.model.id, rec.model.path, rec.parallel.ep, rec.rollout.precision) == ("Qwen3-30B-A3B", "", 8, "fp8")
    assert (rec.reward.grader, rec.data.chat_template, rec.data.prompt_field) == ("math", True, "problem")
    # the recipe does not depend on the machine that made it: this one has no GPU, and the cluster
    # values stay (what a CPU cannot do is refused where a run starts, validator.validate)
    shipped = recipes.load(recipes.for_model("Qwen3-30B-A3B"))
    assert (rec.rollout.sleep_level, rec.rollout.kv_cache_gib) == (shipped.rollout.sleep_level, shipped.rollout.kv_cache_gib)
    assert not (tmp_path / "moe" / "model").exists() or not any((tmp_path / "moe" / "model").iterdir())

    folder = make_folder("dense", tmp_path / "dense", tiny_dir)
    # the test model's context is 64 tokens: init refuses the recipe's lengths as every run would
    # (#64), and takes lengths that fit
    r = minirl("init", str(tmp_path / "dense-ws"), "--model", str(folder), "--set", "train.steps=7")
    assert r.returncode == 2 and "data.max_prompt_tokens = 1024: the model's context is 64 tokens" in r.stderr
    fits = ["--set", "data.max_prompt_tokens=16", "--set", "rollout.max_tokens=8"]
    r = minirl("init", str(tmp_path / "dense-ws"), "--model", str(folder), "--set", "train.steps=7", *fits)
    assert r.returncode == 0, r.stderr
    rec = recipes.load(tmp_path / "dense-ws" / "minirl.toml", [])
    assert (rec.model.id, rec.train.replay, rec.parallel.ep, rec.train.steps) == (str(folder), "off", 1, 7)
    # this test tokenizer has no chat template: the run says so before any engine starts (sleep
    # mode off: the recipe keeps its GPU sleep level, which a run on this CPU refuses where it
    # starts: the bad-input table's sleep-on-cpu row)
    r = minirl("run", str(tmp_path / "dense-ws"), "--set", "rollout.sleep_level=0")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"minirl: error: data.chat_template = true, and the tokenizer of {folder} has no chat template; "
        "set data.chat_template = false to send the prompt as plain text"]

    r = minirl("init", str(tmp_path / "nohub"), "--model", "someone/not-cached-here")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "model 'someone/not-cached-here' is not in the local Hugging Face cache" in r.stderr
    assert not (tmp_path / "nohub").exists()


def test_a_dense_qwen3s_rollout_with_its_prompts_prefilled_once_is_vllms_own_bit_for_bit(tiny_dir, tmp_path,
                                                                                          monkeypatch):
    """rollout/cpu/shared_prefill.py names dense Qwen3 beside Qwen3-MoE: its engine forwards a prompt's
    requests once too, and samples the same tokens with the same log μ as with vLLM's forward of every
    request (336 requests: some admitted while others decode)."""
    from minirl.rollout.cpu import shared_prefill
    from minirl.rollout.vllm import VLLMEngine
    from tests.test_rollout import PROMPTS, _on_and_off, _shared_prefill_on

    engine = VLLMEngine(make_folder("dense", tmp_path / "dense", tiny_dir), dtype="bfloat16", seed=0, max_model_len=32)
    assert engine._llm.collective_rpc(_shared_prefill_on) == [True]
    runs = _on_and_off(engine, monkeypatch, shared_prefill, PROMPTS * 14, seed=3)
    assert runs[True] == runs[False]
