"""LoRA RL (train/lora.py, [train.lora]): what trains, step 0, the merged weights the engine gets,
and the recipe's rules. One process on the tiny MoE (and a dense shape for `mlp`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from minirl.config import recipes
from minirl.disk import atomic
from minirl.errors import UsageError
from minirl.models.hub import fingerprint
from minirl.models.shapes import KNOWN_SHAPES, TINY, lora_targets
from minirl.setup.limits import Platform, check
from minirl.train import lora
from minirl.train.batch import build_batch
from minirl.train.objective import loss_for
from minirl.train.trainer import Trainer

ALL = ("q", "k", "v", "o", "experts")


def _batch(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    prompts = [[4, 5, 16]] * 6
    resps = [[int(x) for x in torch.randint(3, 30, (n,), generator=g)] + [2] for n in (1, 3, 2, 4, 1, 2)]
    return build_batch(prompts, resps, [[-1.0 - 0.1 * i for i in range(len(r))] for r in resps],
                       [0.5, -0.5, 1.0, -1.0, 0.2, -0.2], pad_id=0)


def _lora_trainer(rank=4, targets=ALL, shape=TINY, **kw):
    return Trainer(shape, lr=1e-2, seed=0, lora={"rank": rank, "alpha": 8.0, "targets": targets}, **kw)


def _update(tr: Trainer, b) -> None:
    fn = loss_for(recipes.load(None).loss)
    old, _, _ = tr.logprobs(b)
    tr.forward_backward(b.with_old_logp(old), fn)
    tr.optim_step()


def test_only_the_adapters_train_and_step_0_is_the_base_model():
    b = _batch()
    base = Trainer(TINY, lr=1e-2, seed=0)
    tr = _lora_trainer()
    tr.load_weights(base.full_state_dict())
    torch.testing.assert_close(tr.logprobs(b)[0], base.logprobs(b)[0], rtol=0, atol=0)  # B = 0: exactly the base

    before = {k: v.clone() for k, v in tr.model.state_dict().items() if not lora.is_adapter(k)}
    fn = loss_for(recipes.load(None).loss)
    old, _, _ = tr.logprobs(b)
    tr.forward_backward(b.with_old_logp(old), fn)
    with_grad = {n for n, p in tr.model.named_parameters() if p.grad is not None}
    assert with_grad and all(lora.is_adapter(n) for n in with_grad)
    adapters = {n for n, p in tr.model.named_parameters() if lora.is_adapter(n)}
    assert {n.rsplit(".", 1)[0] for n in adapters} >= {"layers.0.attention.qkv_linear.wq", "layers.0.attention.wo",
                                                       "layers.0.moe.routed_experts.inner_experts"}
    assert not any("router" in n or "embeddings" in n or "lm_head" in n for n in adapters)
    tr.optim_step()
    state = tr.optim.state_dict()["state"]
    assert len(state) == len(adapters)  # Adam moments for the adapters only
    after = tr.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the base never moves
    assert not torch.equal(tr.logprobs(b)[0], base.logprobs(b)[0])  # the adapters did


def test_in_bfloat16_the_base_is_held_in_bfloat16_and_only_the_adapters_in_float32():
    """A GPU's compute dtype (forced here on the CPU): the frozen base has no float32 copy, the
    adapters and their Adam moments are float32, and step 0 is still the base model."""
    b = _batch()
    tr = _lora_trainer(param_dtype="bfloat16")
    base = {p.dtype for n, p in tr.model.named_parameters() if not lora.is_adapter(n)}
    adapters = [p for n, p in tr.model.named_parameters() if lora.is_adapter(n)]
    assert base == {torch.bfloat16} and {p.dtype for p in adapters} == {torch.float32}
    plain = Trainer(TINY, lr=1e-2, seed=0, param_dtype="bfloat16")
    plain.load_weights(tr.full_state_dict())
    for p in plain.model.parameters():  # the same base, held as the LoRA trainer holds it
        p.data = p.data.to(torch.bfloat16)
    torch.testing.assert_close(tr.logprobs(b)[0], plain.logprobs(b)[0], rtol=0, atol=0)
    _update(tr, b)
    assert all(p.grad is None for p in tr.model.parameters())  # zeroed after the step
    moments = [t for s in tr.optim.state.values() for k, t in s.items() if k != "step"]
    assert len(moments) == 2 * len(adapters) and {t.dtype for t in moments} == {torch.float32}
    assert tr.full_state_dict()["layers.0.attention.wo.weight"].dtype == torch.bfloat16  # merged, as held


def test_the_merged_weights_compute_what_the_adapted_model_computes():
    """W + s·B·A loaded into a plain model gives the adapted model's log-probs: what the engine
    and an export receive."""
    b = _batch()
    tr = _lora_trainer()
    for _ in range(2):
        _update(tr, b)
    merged = tr.full_state_dict()
    assert not any(lora.is_adapter(k) for k in merged)
    plain = Trainer(TINY, lr=1e-2, seed=0)
    plain.load_weights(merged)
    torch.testing.assert_close(plain.logprobs(b)[0], tr.logprobs(b)[0], rtol=0, atol=1e-5)
    assert tr.hf_views() is None  # no live views: the engine's weights are made at each sync
    hf = tr.hf_state_dict()
    assert set(hf) == set(plain.hf_state_dict())


def test_a_dense_models_mlp_adapters_and_rank_bounds():
    dense = dataclasses.replace(KNOWN_SHAPES["Qwen3-0.6B"], n_layers=1, dim=64, n_heads=2, n_kv_heads=1,
                                head_dim=32, hidden_dim=96, vocab_size=32, max_seq_len=64)
    tr = _lora_trainer(rank=2, targets=("mlp",), shape=dense)
    names = {n.rsplit(".", 1)[0] for n, _ in tr.model.named_parameters() if lora.is_adapter(n)}
    assert names == {f"layers.0.feed_forward.w{i}" for i in (1, 2, 3)}
    assert lora_targets("all", dense) == ("q", "k", "v", "o", "mlp")
    assert lora_targets("all", TINY) == ALL


@pytest.mark.parametrize("sets, error", [
    (["train.lora.rank=-1"], "train.lora.rank = -1; it must be ≥ 0"),
    (["train.lora.rank=4", "train.lora.alpha=0"], "train.lora.alpha = 0.0; it must be > 0"),
    (["train.lora.rank=4", "train.lora.targets=q,gate"], "train.lora.targets = 'q,gate': name weights among"),
])
def test_the_recipe_refuses_lora_it_cannot_mean(sets, error):
    with pytest.raises(UsageError, match=error.replace("(", r"\(").replace(")", r"\)")):
        recipes.load(None, sets)


def test_the_model_and_machine_bound_lora():
    rec = recipes.load(None, ["train.lora.rank=4", "train.lora.targets=q,mlp"])
    with pytest.raises(UsageError, match="names mlp, which this model does not have"):
        check(rec, None, TINY)
    rec = recipes.load(None, ["train.lora.rank=200"])
    with pytest.raises(UsageError, match=r"train.lora.rank = 200 is above the width of the 'q' weights \(64\)"):
        check(rec, None, TINY)
    rec = recipes.load(None, ["train.lora.rank=4"])
    check(rec, Platform("cpu", 1, 2, 16.0), TINY)
    check(rec, Platform("cpu", 2, 2, 16.0), TINY)  # torchrun: sharded with the weights (test_parallel)
    # ahead of the trainer too: the engine's process is sent the merged weights (sync.queue)
    assert recipes.load(None, ["train.lora.rank=4", "rollout.max_staleness=1"]).rollout.max_staleness == 1


def test_the_merged_sync_puts_the_adapted_model_in_the_engine(engine32, tiny_dir):
    """fp32 vLLM after the merged sync scores as the LoRA trainer does (the control test's bound:
    float noise), after real updates that moved it."""

    from minirl.rollout import sync as weight_sync
    from tests.test_rollout import PROMPTS, mean_abs_diff, trainer_logprobs

    groups = engine32.generate(PROMPTS, n=4, temperature=1.0, max_tokens=6, seed=7)
    prompts = [p for p, g in zip(PROMPTS, groups) for _ in g]
    responses = [list(c.token_ids) for g in groups for c in g]
    tr = _lora_trainer(targets=ALL)
    tr.load_hf(tiny_dir)
    before = engine32.score(prompts, responses)
    original = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    try:
        b = build_batch(prompts, responses, None, [1.0 if i % 2 else -1.0 for i in range(len(prompts))], pad_id=0)
        for _ in range(3):
            tr.forward_backward(b, lambda lp, x: (-(lp * x.mask_BT).sum(-1).mul(x.adv_B).mean(), {}))
            tr.optim_step()
        weight_sync.sync(tr, engine32, bucket_bytes=1)  # what the loop calls: no live views with LoRA, buckets
        after = engine32.score(prompts, responses)
        assert mean_abs_diff(after, before) > 0.05  # the adapters moved the policy, and the engine with it
        assert mean_abs_diff(after, trainer_logprobs(tr, prompts, responses)) < 1e-5
    finally:
        engine32.load_weights(original.items())


def test_lora_with_r3_replays_the_engines_routes_on_every_position(engine_r3, tiny_dir):
    """The router is never adapted, so R3 replays the engine's routes through the adapted experts
    exactly as it does without LoRA, before and after updates."""
    from minirl.train.replay import route_agreement
    from tests.test_rollout import capture_batch, fed_positions

    comps, batch, routes = capture_batch(engine_r3)
    fed = fed_positions(comps, batch)
    tr = _lora_trainer()
    tr.load_hf(tiny_dir)
    fn = loss_for(recipes.load(None).loss)
    adv = torch.tensor([0.5 if i % 2 else -0.5 for i in range(len(batch))])
    b = dataclasses.replace(batch, adv_B=adv)
    for _ in range(2):
        old, _, used = tr.logprobs(b, routes=routes, record_routes=True)
        assert route_agreement(used, routes, fed).tolist() == [1.0] * TINY.n_layers
        tr.forward_backward(b.with_old_logp(old), fn, routes=routes)
        tr.optim_step()
    assert any(p.abs().sum() > 0 for n, p in tr.model.named_parameters() if ".lora_B" in n)


def test_a_checkpoint_holds_the_adapters_and_loads_only_onto_their_base_and_settings(tmp_path, tiny_dir):
    """Resume and rollback read the adapters back onto the base they name; a checkpoint never loads
    silently into a trainer without its adapters (DCP would read what the trainer asks for), nor a
    full one into a LoRA trainer, nor adapters onto other weights."""
    from torch.distributed.checkpoint import FileSystemReader

    from tests.conftest import random_hf_folder

    b = _batch()
    tr = _lora_trainer()
    tr.load_hf(tiny_dir)
    _update(tr, b)
    tr.save(tmp_path / "lora", {"step": 1})
    meta = FileSystemReader(str(tmp_path / "lora")).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model.") for k in meta if k.startswith("model.")}
    assert saved == set(lora.adapter_state(tr.model))  # of the model, the adapters alone: no base
    extra = json.loads((tmp_path / "lora" / "minirl.json").read_text())
    assert extra["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(ALL)}
    assert extra["base"] == {"path": str(tiny_dir), "fingerprint": fingerprint(tiny_dir)}

    again = _lora_trainer()
    with pytest.raises(RuntimeError, match="load_hf"):
        again.load(tmp_path / "lora")
    again.load_hf(tiny_dir)
    again.load(tmp_path / "lora")
    torch.testing.assert_close(again.logprobs(b)[0], tr.logprobs(b)[0], rtol=0, atol=0)
    assert again.optim.state_dict()["state"].keys() == tr.optim.state_dict()["state"].keys()

    other = _lora_trainer()
    other.load_hf(random_hf_folder(tmp_path / "other", TINY, std=0.1 + 1e-3))
    with pytest.raises(UsageError, match="holds other weights"):
        other.load(tmp_path / "lora")
    with pytest.raises(UsageError, match="holds LoRA adapters and this trainer has none"):
        Trainer(TINY, lr=0.0).load(tmp_path / "lora")
    narrow = _lora_trainer(rank=2)
    narrow.load_hf(tiny_dir)
    with pytest.raises(UsageError, match="another rank"):
        narrow.load(tmp_path / "lora")
    full = Trainer(TINY, lr=1e-2, seed=0)
    full.save(tmp_path / "full", {"step": 0})
    with pytest.raises(UsageError, match="no LoRA adapters"):
        _lora_trainer().load(tmp_path / "full")
    made = Trainer.for_checkpoint(recipes.load(None, ["train.lora.rank=4", "train.lora.alpha=8"]), TINY, tiny_dir)
    assert made.lora == {"rank": 4, "alpha": 8.0, "targets": ALL} and made.base == extra["base"]


def test_the_peft_adapter_on_its_base_computes_what_the_merged_export_computes(tmp_path, tiny_dir):
    """`minirl export --adapter`'s folder, loaded by `peft` onto the base model (transformers,
    float32), gives the merged export's logits: the names (experts split per expert) and the
    layout PEFT reads, and its own α/r, are ours."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from minirl.train.hf_io import save_hf_folder, save_peft_folder

    tr = _lora_trainer(rank=4)
    tr.load_hf(tiny_dir)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # trained-looking adapters: B ≠ 0 everywhere
        for n, p in tr.model.named_parameters():
            if ".lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    save_peft_folder(tmp_path / "adapter", TINY, lora.adapter_state(tr.model), rank=4, alpha=8.0,
                     base_model=str(tiny_dir))
    save_hf_folder(tmp_path / "merged", TINY, tr.full_state_dict(), tokenizer_dir=tiny_dir)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(tiny_dir))
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    ids = torch.randint(3, 30, (2, 12), generator=g)
    load = lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # noqa: E731
    with torch.no_grad():
        merged = load(tmp_path / "merged")(ids).logits
        adapted = PeftModel.from_pretrained(load(tiny_dir), tmp_path / "adapter")(ids).logits
        base = load(tiny_dir)(ids).logits
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-4)
    assert (adapted - base).abs().max() > 0.1  # the adapters change what the base computes


@pytest.mark.slow
def test_a_lora_run_with_r3_killed_and_resumed_repeats_itself_and_exports(tmp_path, tiny_dir):
    """`minirl run` with [train.lora], R3 and a learning-rate warmup on the tiny model end to end:
    SIGKILLed as step 4 begins (MINIRL_INJECT_KILL), resumed from its step-2 checkpoint (the
    adapters alone, onto the base it names), it redoes the step it lost sample for sample and
    update for update; then `minirl export` writes the merged model (export once read
    the base alone), `--adapter` the PEFT folder, and the checkpoint without its HF folder is
    rebuilt for `eval` and `doctor` as the same merged weights."""
    import os
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.conftest import ROOT, data_workspace, last_digit_rewards

    ws = data_workspace(tmp_path / "ws", train=64, heldout=8)
    shutil.copytree(tiny_dir, ws / "model" / "coldstart")
    last_digit_rewards(ws)  # the adapters' updates are not all zero
    sets = ["train.lora.rank=4", "train.lora.alpha=16", "train.lr=3e-3", "train.replay=r3", "train.prompts_per_step=4",
            "train.group_size=4", "eval.k=1", "eval.every=0", "checkpoint.every=2", "train.warmup_steps=3"]

    def minirl(*a, **env):
        return subprocess.run([sys.executable, "-m", "cli.main", *a], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "COLUMNS": "200", **env}, timeout=600)

    def figures(run):
        return [(m["step"], m["rollout/reward_mean"], m["train/loss"], m["train/grad_norm"], m["train/lr"])
                for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]

    args = ["--steps", "4", *[x for s in sets for x in ("--set", s)]]
    r = minirl("run", str(ws), *args, MINIRL_INJECT_KILL="0@4")
    assert r.returncode == -9, r.stdout + r.stderr
    (killed,) = (ws / "runs").iterdir()
    lost = figures(killed)
    assert [f[0] for f in lost] == [1, 2, 3]
    r = minirl("run", str(ws), "--resume", "--steps", "4")
    assert r.returncode == 0 and "resumed at step 2" in r.stdout, r.stdout + r.stderr
    again = figures(killed)
    assert again[:3] == lost and len(again) == 4  # step 3, lost with the kill, redone sample for sample
    assert all(f[3] > 0 for f in again)  # every step updated the adapters
    assert [f[4] for f in again] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])  # warmup over 3 steps, resumed too
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["recipe"]["train"]["lora"]["rank"] == 4
    ckpt = killed / "checkpoints" / "step_000004"
    assert json.loads((ckpt / "minirl.json").read_text())["lora"]["rank"] == 4

    assert minirl("export", str(ckpt), str(tmp_path / "out")).returncode == 0
    exported = load_file(next((tmp_path / "out").glob("*.safetensors")))
    own = load_file(next((ckpt / "hf").glob("*.safetensors")))  # what the run itself wrote from its trainer
    base = load_file(next(tiny_dir.glob("*.safetensors")))
    assert all(torch.equal(exported[k], own[k]) for k in own)
    assert not torch.equal(exported["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    r = minirl("export", str(ckpt), str(tmp_path / "adapter"), "--adapter")
    assert r.returncode == 0, r.stdout + r.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["base_model_name_or_path"] == str((ws / "model" / "coldstart").resolve())
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "library_name: peft" in card and "rank 4, α 16, on q, k, v, o, experts; this folder is the adapter" in card
    assert sorted(f.name for f in (tmp_path / "adapter").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "minirl_export.json", "training_curves.png"]

    # `eval` and `doctor` take a checkpoint through resolve_checkpoint: one without its HF folder is
    # rebuilt from the adapters and the base they name, and holds the run's merged weights again
    from minirl.config import recipes
    from minirl.eval.checkpoints import resolve_checkpoint
    from minirl.setup.workspace import Workspace

    shutil.move(ckpt / "hf", tmp_path / "run-hf")
    w = Workspace.open(ws)
    folder = resolve_checkpoint(w, recipes.load(w.recipe_path), str(ckpt))
    rebuilt = load_file(next(folder.glob("*.safetensors")))
    assert rebuilt.keys() == own.keys() and all(torch.equal(rebuilt[k], own[k]) for k in own)


def test_an_exported_adapter_is_evaluated_merged_onto_its_base(tmp_path, tiny_dir):
    """#63: `eval --checkpoint ADAPTER_FOLDER` serves the adapter merged onto the base its
    adapter_config.json names: the merged weights equal the merged export's (what the run's own
    sync gives vLLM), kept under the evaluations' folder and found again; the adapter's file is
    0644 like the rest of an export."""
    from minirl.eval.checkpoints import resolve_checkpoint
    from minirl.train.hf_io import load_hf_weights, save_hf_folder, save_peft_folder

    tr = _lora_trainer(rank=4)
    tr.load_hf(tiny_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if ".lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    save_peft_folder(tmp_path / "adapter", TINY, lora.adapter_state(tr.model), rank=4, alpha=8.0,
                     base_model=str(tiny_dir))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o666 & ~atomic.umask()
    save_hf_folder(tmp_path / "merged", TINY, tr.full_state_dict(), tokenizer_dir=tiny_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        got = resolve_checkpoint(None, recipes.load(None, []), str(tmp_path / "adapter"))
        assert got.parent == Path("minirl-evals/merged") and (tmp_path / got / "config.json").exists()
        want = load_hf_weights(tmp_path / "merged")
        have = load_hf_weights(got)
        assert have.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(have[k].float(), want[k].float(), rtol=0, atol=1e-5)
        stamp = (got / "model.safetensors").stat().st_mtime_ns
        assert resolve_checkpoint(None, recipes.load(None, []), str(tmp_path / "adapter")) == got  # merged once
        assert (got / "model.safetensors").stat().st_mtime_ns == stamp
